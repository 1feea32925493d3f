# ruff: noqa: RUF002  (DeepSeek's special tokens are written with fullwidth bars)
"""The streaming parser of a family whose calls sit in a fixed frame (`CallFrame`).

Llama 3.x JSON, Mistral and DeepSeek V3 each write a call as literal text around a name and a
JSON object of arguments: `{"name": "NAME", "parameters": {...}}`, `[TOOL_CALLS]NAME[ARGS]{...}`,
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a json fence. One
incremental scan follows the frame; whitespace in and around its literals is optional, so
what an unconstrained model writes with other spacing is read too.

The guarantees are `hermes.ToolCallParser`'s: text streams at once (only what could be the
start of the block's opening is held); a block is held until it ends, and becomes calls only
if every call in it names an offered tool with object arguments, else it is released as the
text the model wrote; under a grammar (`forced`) the block streams, `ToolCallBegin` at the
arguments' `{` and their text piece by piece, each call's last piece waiting for what follows
it (the next call or the block's end decides where the tokens after the arguments go). Every
token fed is carried by exactly one chunk or returned by `finish`. A block whose close is the
end of the model's turn (`close` ""), or whose last call is whole when the turn ends, counts.
"""

from __future__ import annotations

import json
import string
from collections.abc import Collection

import attrs

from proto_server.engine.chunks import (
    Chunk,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.families.base import (
    WHITESPACE,
    CallFrame,
    ParsedCall,
    call_chunks,
    string_end,
)
from proto_server.engine.families.stream import BlockStream, Braces, opening_prefix

#: What a function's name is made of (OpenAI's `^[a-zA-Z0-9_-]+$`, and dots).
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


class _More(Exception):
    """The text so far does not decide: more is needed."""


class _Deviation(Exception):
    """The block left the frame: it is not a call."""


def _literal(text: str, index: int, literal: str) -> int:
    """Where `literal` ends when it starts at `index` (whitespace on either side optional)."""
    for char in literal:
        if char in WHITESPACE:
            continue
        while index < len(text) and text[index] in WHITESPACE:
            index += 1
        if index >= len(text):
            raise _More
        if text[index] != char:
            raise _Deviation
        index += 1
    return index


def _try(text: str, index: int, literal: str) -> int | _More | _Deviation:
    try:
        return _literal(text, index, literal)
    except (_More, _Deviation) as outcome:
        return outcome


@attrs.define
class _Scan:
    """Where the scan of a block stands."""

    phase: str = "list_open"
    pos: int = 0
    name: str = ""
    a_start: int = 0
    braces: Braces = attrs.Factory(Braces)
    calls: list[ParsedCall] = attrs.Factory(list)
    end: int | None = None  # where the block ended, once it did
    # streaming: what went out
    begun: int = 0
    sent: int = 0
    pending: tuple[str, int] | None = None


class FramedCallParser(BlockStream):
    """Text deltas and tool calls from a model writing calls in `frame` (module docstring).

    `max_calls`: a block holding more keeps the first ones (their tokens going to the last
    kept); 0 makes the frame plain text, as when no tool is offered."""

    def __init__(
        self,
        frame: CallFrame,
        tool_names: Collection[str],
        *,
        max_calls: int | None = None,
        forced: bool = False,
    ) -> None:
        super().__init__(tool_names, max_calls)
        self._frame = frame
        self._max_calls = frame.most_calls(max_calls)
        self._forced = forced
        self._opener = ""  # the opening as written ("" for a bare block)
        self._scan = _Scan()
        self._streaming = False

    def feed(self, text: str, tokens: int = 1) -> list[Chunk]:
        if self._block is not None:
            self._marks.append((len(self._block), tokens))
            self._block += text
            return self._advance()
        self._tokens += tokens
        self._text += text
        return self._scan_text()

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        block = self._block
        if block is not None:
            scan = self._scan
            whole = scan.phase in ("after", "tail")  # the last call is complete
            if self._streaming and scan.begun:
                # in its arguments (past them, the call is whole but for its frame)
                self.cut = scan.phase == "args"
                chunks += self._end_call(everything=True) if whole else self._cut()
                self.calls += len(scan.calls)
                self._end_block()
            elif whole:
                scan.end = len(block)
                chunks += self._close_held()
            else:
                chunks += self._release(self._opener + block)
        return self._finish_text(chunks)

    # -- text outside a block ------------------------------------------------------------------

    def _scan_text(self) -> list[Chunk]:
        if not self._names:
            return self._emit_text(self._take_text(len(self._text)))
        frame, text = self._frame, self._text
        start, opener = text.find(frame.open), frame.open
        if frame.bare and not self._spoke:
            first = len(text) - len(text.lstrip(WHITESPACE))
            if text.startswith("{", first) and (start < 0 or first < start):
                start, opener = first, ""
        if start < 0:
            held = opening_prefix(text, frame.open)
            return self._emit_text(self._take_text(len(text) - held))
        before, rest = text[:start], text[start + len(opener) :]
        chunks: list[Chunk] = []
        if self._spoke or before.strip(WHITESPACE):
            chunks = self._emit_text(before)
        else:
            self._lead = before
        self._text = ""
        self._block = ""
        self._opener = opener
        self._scan = _Scan()
        self._streaming = self._forced
        self._marks = [(0, self._tokens)]
        self._tokens = 0
        return chunks + self.feed(rest, 0)

    def _rescan(self, text: str) -> list[Chunk]:
        self._end_block()
        self._text = text
        return self._scan_text() if text else []

    def _end_block(self) -> None:
        self._block = None
        self._streaming = False

    def _release(self, text: str) -> list[Chunk]:
        """A block that is not a call: the model's text, with all the block's tokens."""
        self._tokens += sum(tokens for _, tokens in self._marks)
        self._marks = []
        self._end_block()
        lead, self._lead = self._lead, ""
        self._spoke = True  # a bare block's `{` is text now: it opens no other block
        return self._emit_text(lead + text)

    # -- inside a block --------------------------------------------------------------------------

    def _advance(self) -> list[Chunk]:
        block, scan = self._block, self._scan
        assert block is not None
        chunks: list[Chunk] = []
        try:
            while scan.end is None and self._step(block, scan, chunks):
                pass
        except _Deviation:
            if self._streaming and scan.begun:  # not under a grammar after all: end the calls
                chunks += self._cut()
                self.calls += len(scan.calls)
                return chunks + self._rescan(block[scan.pos :])
            return self._release(self._opener) + self._rescan(block)
        if scan.end is not None:
            if self._streaming and scan.begun:
                chunks += self._end_call(everything=True)
                self.calls += len(scan.calls)
                self._lead = ""
                self._spoke = False
                return chunks + self._rescan(block[scan.end :])
            return self._close_held()
        if self._streaming and scan.phase == "args":
            chunks += self._deltas(self._pieces(scan.sent, len(block)))
            scan.sent = len(block)
        return chunks

    def _step(self, block: str, scan: _Scan, chunks: list[Chunk]) -> bool:
        """Advance one element of the frame; False when more text is needed."""
        frame = self._frame
        try:
            if scan.phase == "args":
                return self._arguments(block, scan, chunks)
            if scan.phase == "list_open":
                scan.pos, scan.phase = _literal(block, scan.pos, frame.list_open), "prefix"
            elif scan.phase == "prefix":
                scan.pos, scan.phase = _literal(block, scan.pos, frame.name_prefix), "name"
            elif scan.phase == "name":
                end = scan.pos
                while end < len(block) and block[end] in NAME_CHARS:
                    end += 1
                if end == len(block):
                    raise _More
                if block[scan.pos : end] not in self._names:
                    raise _Deviation
                scan.name, scan.pos, scan.phase = block[scan.pos : end], end, "suffix"
            elif scan.phase == "suffix":
                scan.pos, scan.phase = _literal(block, scan.pos, frame.name_suffix), "args_start"
            elif scan.phase == "args_start":
                self._open_arguments(block, scan, chunks)
            elif scan.phase == "args_suffix":
                if frame.id_key is not None:
                    scan.pos = self._call_id(block, scan.pos, frame.id_key)
                scan.pos, scan.phase = _literal(block, scan.pos, frame.args_suffix), "after"
            elif scan.phase == "after":
                self._after_call(block, scan, chunks)
            else:  # "tail": calls past the allowed number, dropped up to the close
                found = block.find(frame.close, scan.pos) if frame.close else -1
                if found < 0:
                    raise _More
                scan.end = found + len(frame.close)
        except _More:
            return False
        return True

    @staticmethod
    def _call_id(block: str, pos: int, key: str) -> int:
        """Past `, "key": "..."` at `pos`, if the call holds it there."""
        comma = _try(block, pos, ",")
        if isinstance(comma, _Deviation):
            return pos
        if isinstance(comma, _More):
            raise _More
        start = _literal(block, comma, f'"{key}":')
        while start < len(block) and block[start] in WHITESPACE:
            start += 1
        if start >= len(block):
            raise _More
        if block[start] != '"':
            raise _Deviation
        end = string_end(block, start)
        if end < 0:
            raise _More
        return end

    def _open_arguments(self, block: str, scan: _Scan, chunks: list[Chunk]) -> None:
        at = scan.pos
        while at < len(block) and block[at] in WHITESPACE:
            at += 1
        if at >= len(block):
            raise _More
        if block[at] != "{":
            raise _Deviation
        scan.a_start, scan.pos, scan.braces, scan.phase = at, at + 1, Braces(), "args"
        if self._streaming:
            begin = sum(tokens for offset, tokens in self._marks if offset < at)
            self._marks = [(o, t) for o, t in self._marks if o >= at]
            chunks.append(ToolCallBegin(scan.name, begin))
            scan.begun += 1
            scan.sent = at
            self._lead = ""

    def _arguments(self, block: str, scan: _Scan, chunks: list[Chunk]) -> bool:
        """Follow the arguments' braces to the `}` that closes them."""
        end = scan.braces.close(block, scan.pos)
        if end is None:
            scan.pos = len(block)
            return False
        arguments = block[scan.a_start : end]
        scan.calls.append(ParsedCall(scan.name, arguments, (scan.a_start, end), scan.a_start, end))
        scan.pos, scan.phase = end, "args_suffix"
        if self._streaming:
            pieces = self._pieces(scan.sent, end)
            scan.sent = end
            chunks += self._deltas(pieces[:-1])
            scan.pending = pieces[-1]
        return True

    def _after_call(self, block: str, scan: _Scan, chunks: list[Chunk]) -> None:
        """The next call, or the block's close: whichever the text after a call is."""
        frame = self._frame
        more = (
            _try(block, scan.pos, frame.separator + frame.name_prefix)
            if frame.separator is not None
            else _Deviation()
        )
        if isinstance(more, int):
            if self._max_calls is not None and len(scan.calls) >= self._max_calls:
                scan.phase = "tail"
                return
            if self._streaming:
                chunks += self._end_call(everything=False)
            scan.pos, scan.phase = more, "name"
            return
        if isinstance(more, _More):
            raise _More
        if not frame.close:  # the turn's end closes it: what follows is text
            scan.end = scan.pos
            return
        scan.end = _literal(block, scan.pos, frame.close)

    # -- a block's calls out -------------------------------------------------------------------

    def _close_held(self) -> list[Chunk]:
        """A held block that ended: its calls if all are valid, else its text."""
        block, scan = self._block, self._scan
        assert block is not None and scan.end is not None
        payload, rest = block[: scan.end], block[scan.end :]
        calls = scan.calls
        if not all(_is_object(call.arguments) for call in calls):
            return self._release(self._opener + payload) + self._rescan(rest)
        if self._max_calls is not None:
            calls = calls[: self._max_calls]
        chunks = call_chunks(payload, calls, self._marks)
        self._marks = []
        self.calls += len(calls)
        self._lead = ""
        self._spoke = False
        return chunks + self._rescan(rest)

    def _end_call(self, *, everything: bool) -> list[Chunk]:
        scan = self._scan
        assert scan.pending is not None
        pending, scan.pending = scan.pending, None
        return self._last_piece(pending, everything=everything)

    def _cut(self) -> list[Chunk]:
        """A streamed block that stopped short or left the frame: its open call ends with what
        it has, so every begin has its end."""
        scan, block = self._scan, self._block
        assert block is not None
        chunks: list[Chunk] = []
        if scan.phase == "args":
            chunks += self._deltas(self._pieces(scan.sent, len(block)))
            chunks.append(ToolCallEnd())
            scan.calls.append(ParsedCall(scan.name, "", None, scan.a_start, len(block)))
        elif scan.pending is not None:
            chunks += self._end_call(everything=True)
        self._tokens += sum(count for _, count in self._marks)
        self._marks = []
        self._lead = ""
        return chunks


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
