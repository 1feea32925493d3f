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
Arguments nested deeper than `MAX_ARGUMENTS_DEPTH` leave the frame (a held block is text, a
streamed call ends there). The scan resumes where it stopped, so it reads each character
once however the text is split (stream.py).
"""

from __future__ import annotations

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
    Braces,
    CallFrame,
    ParsedCall,
    Quote,
    call_chunks,
    json_object,
)
from proto_server.engine.families.stream import BlockStream, opening_prefix

#: What a function's name is made of (OpenAI's `^[a-zA-Z0-9_-]+$`, and dots).
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


class _Deviation(Exception):
    """The block left the frame: it is not a call."""


def _match(text: str, index: int, literal: str, matched: int) -> tuple[int, int]:
    """`literal` read on from its `matched` characters at `index` (whitespace on either side of
    each character optional): where the reading got to, and how much of `literal` it matched
    (all of it, or as much as `text` holds: the next piece goes on from there)."""
    while matched < len(literal):
        char = literal[matched]
        if char in WHITESPACE:
            matched += 1
            continue
        index = _skip(text, index)
        if index >= len(text):
            break
        if text[index] != char:
            raise _Deviation
        index, matched = index + 1, matched + 1
    return index, matched


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


@attrs.define
class _Scan:
    """Where the scan of a block stands."""

    phase: str = "list_open"
    pos: int = 0
    matched: int = 0  # how much of the phase's literal is read, up to `pos`
    after: int = 0  # where the text after the last call's frame starts
    name: str = ""
    a_start: int = 0
    braces: Braces = attrs.Factory(Braces)
    quote: Quote = attrs.Factory(Quote)
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
        self._literals = {
            "list_open": frame.list_open,
            "prefix": frame.name_prefix,
            "suffix": frame.name_suffix,
            "id_key": f'"{frame.id_key}":',
            "args_suffix": frame.args_suffix,
            "after": (frame.separator or "") + frame.name_prefix,
            "close": frame.close,
        }

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        block = self._block
        if block is not None:
            scan = self._scan
            whole = scan.phase in ("after", "close", "tail")  # the last call is complete
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
        self._opener = opener
        self._scan = _Scan()
        self._streaming = self._forced
        return self._open(text[:start], text[start + len(opener) :])

    def _end_block(self) -> None:
        self._block = None
        self._streaming = False

    def _release(self, text: str) -> list[Chunk]:
        """A block that is not a call: the model's text, with all the block's tokens."""
        self._tokens += sum(tokens for _, tokens in self._marks)
        self._marks = []
        self._end_block()
        lead = self._take_lead()
        self._spoke = True  # a bare block's `{` is text now: it opens no other block
        return self._emit_text(lead + text)

    # -- inside a block --------------------------------------------------------------------------

    def _scan_block(self) -> list[Chunk]:
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
                self._rescan(block[scan.pos :])
                return chunks
            chunks = self._release(self._opener)
            self._rescan(block)
            return chunks
        if scan.end is not None:
            if self._streaming and scan.begun:
                chunks += self._end_call(everything=True)
                self.calls += len(scan.calls)
                self._lead = []
                self._spoke = False
                self._rescan(block[scan.end :])
                return chunks
            return self._close_held()
        if self._streaming and scan.phase == "args":
            chunks += self._deltas(self._pieces(scan.sent, len(block)))
            scan.sent = len(block)
        return chunks

    def _step(self, block: str, scan: _Scan, chunks: list[Chunk]) -> bool:
        """Advance one element of the frame; False when more text is needed."""
        phase = scan.phase
        if phase == "args":
            return self._arguments(block, scan, chunks)
        if phase == "name":
            return self._name(block, scan)
        if phase in ("args_start", "id", "id_value"):
            scan.pos = _skip(block, scan.pos)  # whitespace before them is read once
            if scan.pos >= len(block):
                return False
            if phase == "args_start":
                self._open_arguments(block, scan, chunks)
            elif phase == "id":  # `, "id": "..."` after the arguments, or not
                comma = block[scan.pos] == ","
                scan.pos += comma
                scan.phase = "id_key" if comma else "args_suffix"
            elif block[scan.pos] != '"':
                raise _Deviation
            else:
                scan.pos, scan.quote, scan.phase = scan.pos + 1, Quote(), "id_string"
            return True
        if phase == "id_string":
            end = scan.quote.end(block, scan.pos)
            scan.pos = len(block) if end is None else end
            if end is not None:
                scan.phase = "args_suffix"
            return end is not None
        if phase == "tail":  # calls past the allowed number, dropped up to the close
            return self._tail(block, scan)
        literal = self._literals[phase]
        try:
            scan.pos, scan.matched = _match(block, scan.pos, literal, scan.matched)
        except _Deviation:
            if phase != "after":
                raise
            scan.phase, scan.pos, scan.matched = "close", scan.after, 0  # no next call
            return True
        if scan.matched < len(literal):
            return False
        scan.matched = 0
        if phase == "after":
            self._next_call(scan, chunks)
        elif phase == "close":
            scan.end = scan.pos
        else:
            scan.phase = {
                "list_open": "prefix",
                "prefix": "name",
                "suffix": "args_start",
                "id_key": "id_value",
                "args_suffix": "close" if self._frame.separator is None else "after",
            }[phase]
            scan.after = scan.pos
        return True

    def _name(self, block: str, scan: _Scan) -> bool:
        """The called tool's name: no longer than the longest offered, read at most once a
        piece."""
        end = scan.pos
        while end < len(block) and block[end] in NAME_CHARS and end - scan.pos <= self._longest:
            end += 1
        if end - scan.pos > self._longest:
            raise _Deviation  # longer than any offered name
        if end == len(block):
            return False
        if block[scan.pos : end] not in self._names:
            raise _Deviation
        scan.name, scan.pos, scan.phase = block[scan.pos : end], end, "suffix"
        return True

    def _open_arguments(self, block: str, scan: _Scan, chunks: list[Chunk]) -> None:
        at = scan.pos
        if block[at] != "{":
            raise _Deviation
        scan.a_start, scan.pos, scan.braces, scan.phase = at, at + 1, Braces(), "args"
        if self._streaming:
            begin = sum(tokens for offset, tokens in self._marks if offset < at)
            self._marks = [(o, t) for o, t in self._marks if o >= at]
            chunks.append(ToolCallBegin(scan.name, begin))
            scan.begun += 1
            scan.sent = at
            self._lead = []

    def _arguments(self, block: str, scan: _Scan, chunks: list[Chunk]) -> bool:
        """Follow the arguments' braces to the `}` that closes them."""
        end = scan.braces.close(block, scan.pos)
        if end is None:
            scan.pos = len(block)
            if scan.braces.deep:
                raise _Deviation
            return False
        arguments = block[scan.a_start : end]
        scan.calls.append(ParsedCall(scan.name, arguments, (scan.a_start, end), scan.a_start, end))
        scan.pos = end
        scan.phase = "args_suffix" if self._frame.id_key is None else "id"
        if self._streaming:
            pieces = self._pieces(scan.sent, end)
            scan.sent = end
            chunks += self._deltas(pieces[:-1])
            scan.pending = pieces[-1]
        return True

    def _next_call(self, scan: _Scan, chunks: list[Chunk]) -> None:
        """The separator and the next call's name prefix came: another call, if allowed."""
        if self._max_calls is not None and len(scan.calls) >= self._max_calls:
            scan.phase, scan.pos = "tail", scan.after
            return
        if self._streaming:
            chunks += self._end_call(everything=False)
        scan.phase = "name"

    def _tail(self, block: str, scan: _Scan) -> bool:
        close = self._frame.close
        found = block.find(close, scan.pos) if close else -1
        if found < 0:
            if close:  # the next piece searches on from here
                scan.pos = max(scan.pos, len(block) - len(close) + 1)
            return False
        scan.end = found + len(close)
        return True

    # -- a block's calls out -------------------------------------------------------------------

    def _close_held(self) -> list[Chunk]:
        """A held block that ended: its calls if all are valid, else its text."""
        block, scan = self._block, self._scan
        assert block is not None and scan.end is not None
        payload, rest = block[: scan.end], block[scan.end :]
        calls = scan.calls
        if not all(json_object(call.arguments) for call in calls):
            chunks = self._release(self._opener + payload)
            self._rescan(rest)
            return chunks
        if self._max_calls is not None:
            calls = calls[: self._max_calls]
        chunks = call_chunks(payload, calls, self._marks)
        self._marks = []
        self.calls += len(calls)
        self._lead = []
        self._spoke = False
        self._rescan(rest)
        return chunks

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
        self._lead = []
        return chunks
