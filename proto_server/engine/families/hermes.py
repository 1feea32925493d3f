"""The Hermes family (Hermes, SmolLM2): calls as JSON in `<tool_call>` tags (Qwen's: qwen.py).

SmolLM2 was tuned to call tools as a JSON list inside tags (Hermes- and Qwen-style models write
one object there, which is accepted too):

    <tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls"}}]</tool_call>

The parser is sans-IO: it is fed decoded text, piece by piece with the tokens each piece took,
and returns chunks. Text streams as it comes; a block is held until `</tool_call>` and becomes
calls only if all of it is valid (JSON, offered names, object arguments); anything else is
released as the text the model wrote. Every token fed is carried by exactly one chunk (or
returned by `finish`), so usage counts stay exact.

A block decoded under a grammar (`forced=True`: a forced call, or a call the grammar took over)
cannot be invalid, so holding it would only delay the client: it streams instead, `ToolCallBegin`
at the arguments' `{` and their text piece by piece, with the same chunks, texts and tokens the
held path would give at the close (the last piece of each call waits for the `,` or `]` after it,
which decides whether the tokens after the arguments go to it or to the next call's begin).

The held path (`parse_calls`, `_scan_block`) and the streamed one
(`_scan_stream`) must turn a block into the same chunks, texts and tokens, and both work on
`ToolCallParser`'s token marks. One file is where that promise can be checked by reading.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import attrs

from proto_server.engine.chunks import (
    Chunk,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.families.base import (
    MAX_ARGUMENTS_DEPTH,
    WHITESPACE,
    Braces,
    CallFrame,
    ParsedCall,
    Quote,
    ToolSyntax,
    call_chunks,
    json_object,
    too_deep,
)
from proto_server.engine.families.stream import BlockStream, opening_prefix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_decoder = json.JSONDecoder()


FRAME = CallFrame(
    open=OPEN,
    list_open="[",
    name_prefix='{"name": "',
    name_suffix='", "arguments": ',
    args_suffix="}",
    separator=", ",
    close="]" + CLOSE,
)


class _Invalid(Exception):
    pass


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def _value(text: str, index: int) -> tuple[Any, int]:
    try:
        return _decoder.raw_decode(text, index)
    except ValueError as exc:
        raise _Invalid from exc


def _object(text: str, index: int) -> tuple[dict[str, tuple[Any, int, int]], int]:
    """A JSON object at `index`: each field's value with its span; and where the object ends."""
    if not text.startswith("{", index):
        raise _Invalid
    fields: dict[str, tuple[Any, int, int]] = {}
    index = _skip(text, index + 1)
    if text.startswith("}", index):
        return fields, index + 1
    while True:
        if not text.startswith('"', index):
            raise _Invalid
        key, index = _value(text, index)
        index = _skip(text, index)
        if not text.startswith(":", index):
            raise _Invalid
        start = _skip(text, index + 1)
        value, end = _value(text, start)
        fields[key] = (value, start, end)
        index = _skip(text, end)
        if text.startswith(",", index):
            index = _skip(text, index + 1)
        elif text.startswith("}", index):
            return fields, index + 1
        else:
            raise _Invalid


def _call(text: str, index: int, names: Collection[str]) -> tuple[ParsedCall, int]:
    fields, end = _object(text, index)
    if set(fields) != {"name", "arguments"}:
        raise _Invalid
    name, _, _ = fields["name"]
    arguments, a_start, a_end = fields["arguments"]
    if not isinstance(name, str) or name not in names:
        raise _Invalid
    if isinstance(arguments, dict) and not too_deep(text[a_start:a_end]):
        return ParsedCall(name, text[a_start:a_end], (a_start, a_end), index, end), end
    if isinstance(arguments, str) and json_object(arguments):  # a JSON string holding an object
        return ParsedCall(name, arguments, None, index, end), end
    raise _Invalid


def parse_calls(payload: str, names: Collection[str]) -> list[ParsedCall] | None:
    """The calls between the tags: a list of call objects or one object; None if not valid
    (arguments nested deeper than `MAX_ARGUMENTS_DEPTH` too: the list and the call object
    around them are looked at first, so the decoder cannot run out of stack)."""
    if too_deep(payload, MAX_ARGUMENTS_DEPTH + 2):
        return None
    try:
        index = _skip(payload, 0)
        calls = []
        if payload.startswith("[", index):
            index = _skip(payload, index + 1)
            while True:
                call, index = _call(payload, index, names)
                calls.append(call)
                index = _skip(payload, index)
                if payload.startswith(",", index):
                    index = _skip(payload, index + 1)
                elif payload.startswith("]", index):
                    index += 1
                    break
                else:
                    raise _Invalid
        else:
            call, index = _call(payload, index, names)
            calls.append(call)
        if _skip(payload, index) != len(payload):
            raise _Invalid
    except _Invalid:
        return None
    return calls


@attrs.define
class _Stream:
    """Where a forced block's incremental scan stands (`ToolCallParser._scan_stream`)."""

    phase: str = "open"
    pos: int = 0  # scanned up to here in the block
    listed: bool = True  # a list of calls, not one bare object
    name: str = ""
    a_start: int = 0
    sent: int = 0  # the arguments' text is out up to here
    braces: Braces = attrs.Factory(Braces)
    quote: Quote | None = None  # inside a string (a key or the name), which opened at `q_start`
    q_start: int = 0
    pending: tuple[str, int] | None = None  # a call's last arguments piece, and its tokens
    begun: int = 0  # calls whose begin went out
    kept: int = 0  # calls whose object closed


class _Deviation(Exception):
    """The forced block is not in the expected shape."""


class ToolCallParser(BlockStream):
    """Turns a model's streamed text into text deltas and complete tool calls.

    `feed(text, tokens)` returns the chunks that are certain; `finish()` flushes what was held.
    After a valid block `called` is true and the caller should stop decoding: the call is the
    end of the model's turn. Whitespace before anything was said is held, and dropped if a call
    follows, so a call does not open an empty message. With `max_calls`, a block holding more
    calls keeps the first ones (what the request allows), their tokens going to the last kept;
    `max_calls=0` makes tags plain text, as when no tool is offered. `forced`: a grammar makes
    every block valid, so blocks stream (module docstring); one in another shape than
    `[{"name": ..., "arguments": {...}}, ...]` is held as without it.
    """

    def __init__(
        self, tool_names: Collection[str], *, max_calls: int | None = None, forced: bool = False
    ) -> None:
        super().__init__(tool_names, max_calls)
        self._max_calls = max_calls
        self._forced = forced
        self._stream: _Stream | None = None
        self._head_at = 0  # a held block's leading whitespace is read up to here (-1: past it)
        self._searched = 0  # a held block holds no `</tool_call>` before here

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        if (stream := self._stream) is not None and stream.begun:
            # in its arguments (past them, the call is whole but for its frame: counted)
            self.cut = stream.phase == "args"
            chunks += self._cut_stream()
        elif self._block is not None:
            chunks += self._release_block(OPEN + self._block)
        return self._finish_text(chunks)

    # -- text outside a block ------------------------------------------------------------------

    def _scan_text(self) -> list[Chunk]:
        if not self._names:  # nothing was offered: tags are just text
            return self._emit_text(self._take_text(len(self._text)))
        start = self._text.find(OPEN)
        if start < 0:
            held = opening_prefix(self._text, OPEN)
            return self._emit_text(self._take_text(len(self._text) - held))
        self._stream = _Stream() if self._forced else None
        self._head_at = self._searched = 0
        return self._open(self._text[:start], self._text[start + len(OPEN) :])

    # -- inside a block --------------------------------------------------------------------------

    def _scan_block(self) -> list[Chunk]:
        return self._scan_held() if self._stream is None else self._scan_stream()

    def _scan_held(self) -> list[Chunk]:
        block = self._block
        assert block is not None
        if self._head_at >= 0:
            at = _skip(block, self._head_at)
            if at < len(block) and block[at] not in "[{":  # cannot be a call: it was prose
                chunks = self._release_block(OPEN)
                self._rescan(block)
                return chunks
            self._head_at = at if at == len(block) else -1
        end = block.find(CLOSE, self._searched)
        if end < 0:
            self._searched = max(self._searched, len(block) - len(CLOSE) + 1)
            return []
        payload, rest = block[:end], block[end + len(CLOSE) :]
        calls = parse_calls(payload, self._names)
        if calls is None:
            chunks = self._release_block(OPEN + payload + CLOSE)
            self._rescan(rest)
            return chunks
        if self._max_calls is not None:
            del calls[self._max_calls :]
        chunks = call_chunks(payload, calls, self._marks)
        self._marks = []
        self.calls += len(calls)
        self._lead = []
        self._spoke = False
        self._rescan(rest)
        return chunks

    def _end_block(self) -> None:
        self._block = None
        self._stream = None

    def _release_block(self, text: str) -> list[Chunk]:
        """A block that is not a valid call: the model's text, with all the block's tokens."""
        self._tokens += sum(tokens for _, tokens in self._marks)
        self._marks = []
        self._end_block()
        return self._emit_text(self._take_lead() + text)

    # -- a forced block, streamed ------------------------------------------------------------------

    def _scan_stream(self) -> list[Chunk]:
        """Scan what came; out go the begins and argument pieces that are certain."""
        stream = self._stream
        block = self._block
        assert stream is not None and block is not None
        chunks: list[Chunk] = []
        try:
            while self._step(stream, block, chunks):
                if self._block is None:  # the block closed; what came after it is queued
                    return chunks
        except _Deviation:
            if not stream.begun:  # nothing out yet: hold it as an unforced block
                self._stream = None
                return self._scan_held()
            chunks += self._cut_stream()  # not under a grammar after all: end the calls
            self._rescan(block[stream.pos :])
            return chunks
        if stream.phase == "args":
            chunks += self._deltas(self._pieces(stream.sent, len(block)))
            stream.sent = len(block)
        return chunks

    def _step(self, stream: _Stream, block: str, chunks: list[Chunk]) -> bool:
        """Advance the scan one syntax element; False when more text is needed."""
        phase = stream.phase
        if phase == "args":
            return self._scan_arguments(stream, block, chunks)
        if stream.quote is not None:
            return self._scan_string(stream, block)
        if phase == "tail":
            end = block.find(CLOSE, stream.pos)
            if end < 0:  # the next piece searches on from here
                stream.pos = max(stream.pos, len(block) - len(CLOSE) + 1)
                return False
            chunks += self._end_call(stream, everything=True)
            self.calls += stream.kept
            self._lead = []
            self._spoke = False
            self._rescan(block[end + len(CLOSE) :])
            return True
        at = stream.pos = _skip(block, stream.pos)  # whitespace is read once
        if at >= len(block):
            return False
        char = block[at]
        expected = {
            "open": "[{",
            "call": "{",
            "name_colon": ":",
            "comma": ",",
            "args_colon": ":",
            "args_start": "{",
            "call_end": "}",
            "after_call": ",]",
        }.get(phase)
        if expected is None:  # a string: a key or the name
            if char != '"':
                raise _Deviation
            stream.quote, stream.q_start, stream.pos = Quote(), at, at + 1
            return True
        if char not in expected:
            raise _Deviation
        stream.pos = at + 1
        if phase == "open":
            stream.listed = char == "["
            stream.pos = at + 1 if stream.listed else at
            stream.phase = "call"
        elif phase == "call":
            stream.phase = "name_key"
        elif phase == "name_colon":
            stream.phase = "name"
        elif phase == "comma":
            stream.phase = "args_key"
        elif phase == "args_colon":
            stream.phase = "args_start"
        elif phase == "args_start":
            begin = sum(tokens for offset, tokens in self._marks if offset < at)
            self._marks = [(o, t) for o, t in self._marks if o >= at]
            chunks.append(ToolCallBegin(stream.name, begin))
            stream.begun += 1
            stream.a_start = stream.sent = at
            stream.braces = Braces()
            stream.phase = "args"
            self._lead = []  # a call it is: the whitespace before it opens no message
        elif phase == "call_end":
            stream.kept += 1
            stream.phase = "after_call" if stream.listed else "tail"
        elif char == "," and (self._max_calls is None or stream.kept < self._max_calls):
            chunks += self._end_call(stream, everything=False)
            stream.phase = "call"
        else:  # the list ends, or holds more calls than allowed: they are dropped
            stream.phase = "tail"
        return True

    def _scan_string(self, stream: _Stream, block: str) -> bool:
        """A key or the name, read once however it is split."""
        assert stream.quote is not None
        end = stream.quote.end(block, stream.pos)
        if end is None:
            stream.pos = len(block)
            return False
        try:
            value = json.loads(block[stream.q_start : end])
        except ValueError:  # an escape JSON does not have
            raise _Deviation from None
        phase = stream.phase
        if phase == "name_key" and value == "name":
            stream.phase = "name_colon"
        elif phase == "name" and value in self._names:
            stream.name, stream.phase = value, "comma"
        elif phase == "args_key" and value == "arguments":
            stream.phase = "args_colon"
        else:
            raise _Deviation
        stream.quote, stream.pos = None, end
        return True

    def _scan_arguments(self, stream: _Stream, block: str, chunks: list[Chunk]) -> bool:
        """Follow the arguments' braces to the `}` that closes them."""
        end = stream.braces.close(block, stream.pos)
        if end is None:
            stream.pos = len(block)
            if stream.braces.deep:  # nested deeper than a call may be: it ends here
                raise _Deviation
            return False
        pieces = self._pieces(stream.sent, end)
        stream.sent = end
        chunks += self._deltas(pieces[:-1])
        stream.pending = pieces[-1]
        stream.pos = end
        stream.phase = "call_end"
        return True

    def _end_call(self, stream: _Stream, *, everything: bool) -> list[Chunk]:
        assert stream.pending is not None
        pending, stream.pending = stream.pending, None
        return self._last_piece(pending, everything=everything)

    def _cut_stream(self) -> list[Chunk]:
        """A streamed block that stopped short (or left its shape): its open call ends with
        what it has, so every begin has its end; the calls so far count."""
        stream = self._stream
        assert stream is not None
        chunks: list[Chunk] = []
        if stream.phase == "args":
            assert self._block is not None
            chunks += self._deltas(self._pieces(stream.sent, len(self._block)))
            chunks.append(ToolCallEnd())
            stream.kept += 1
        elif stream.pending is not None:
            chunks += self._end_call(stream, everything=True)
            if stream.phase == "call_end":
                stream.kept += 1
        self._tokens += sum(count for _, count in self._marks)
        self._marks = []
        self.calls += stream.kept
        self._end_block()
        self._lead = []
        return chunks


class Hermes(ToolSyntax):
    """Offered tools through the template where it takes them (Qwen's), else the system prompt
    of `describe_tools`; calls read by `ToolCallParser`, which also takes Qwen's single object
    and arguments written as a JSON string."""

    name = "hermes"
    frame = FRAME
    own_parser = ToolCallParser

    def stop(self, max_calls: int | None) -> list[str]:
        return [CLOSE]  # a Qwen block holds one object, without the list's `]`


HERMES = Hermes()
