"""gpt-oss: the harmony format, read as it streams (rendered by harmony_renderer.py).

gpt-oss has no chat template: a conversation is harmony messages, each
`<|start|>ROLE<|channel|>CHANNEL<|message|>CONTENT<|end|>`, rendered by OpenAI's
`openai-harmony` (engine/harmony_renderer.py). After the generation prompt `<|start|>assistant`
the model writes one or more messages: its reasoning on `analysis`, then either the answer on
`final` (ended by `<|return|>`) or a call addressed `to=functions.NAME` on `commentary`
(`<|call|>`); both are stop tokens, `<|end|>` (one message of several) is not.

`HarmonyParser` reads that text as it streams: `analysis` becomes `ReasoningDelta`, `final`
(and `commentary` addressed to no one, a preamble for the user) `TextDelta` at once, a call to
an offered tool `ToolCallBegin`/`ArgumentsDelta`/`End` (held until it ends and checked to be a
JSON object nested at most `MAX_ARGUMENTS_DEPTH` deep, streamed under a grammar, where a deeper
one ends there). The headers are not shown; their tokens go on the next chunk. What does not
read as harmony (no header where one must be, a call to a tool not offered, arguments that are
no object, a built-in tool such as `to=python`) is released as the text the model wrote. Every
token fed is carried by exactly one chunk or returned by `finish`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from proto_server.engine.chunks import (
    Chunk,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.families.base import (
    Braces,
    CallFrame,
    Rendering,
    ToolSyntax,
    json_object,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
#: What ends a message's content: `<|end|>` (another message follows), or the turn's end.
_ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."
#: A header longer than this is no header: what was held is released as text.
MAX_HEADER_CHARS = 256
#: The most text a header can take, `<|start|>assistant` and `<|message|>` included.
_HEADER_SPAN = len(START + "assistant") + MAX_HEADER_CHARS + len(MESSAGE)
_END = re.compile("|".join(map(re.escape, _ENDS)))
#: How far back of a piece an end token may have begun.
_END_SPAN = max(map(len, _ENDS)) - 1


def _held_end(text: str) -> int:
    """The length of the longest end of `text` that may begin a message's end token."""
    for length in range(min(len(text), max(map(len, _ENDS)) - 1), 0, -1):
        if any(end.startswith(text[-length:]) for end in _ENDS):
            return length
    return 0


def _plausible_header(header: str, after_start: bool) -> bool:
    """`header` (what was written since the message began) may still become a header."""
    if after_start:
        head = START + "assistant"
        if len(header) <= len(head):
            return head.startswith(header)
        header = header[len(head) :]
    for lead in (CHANNEL, " to="):
        if len(header) <= len(lead):
            if lead.startswith(header):
                return True
        elif header.startswith(lead):
            return len(header) <= MAX_HEADER_CHARS and START not in header
    return False


def _message(channel: str, recipient: str | None, names: frozenset[str]) -> bool:
    """A header of this channel and recipient opens a message read as harmony: not a call the
    request does not allow, nor one to a built-in tool, nor a channel harmony does not have."""
    if recipient is not None:
        return recipient.startswith(FUNCTIONS) and recipient.removeprefix(FUNCTIONS) in names
    return channel in ("analysis", "final", "commentary")


def _read_header(header: str) -> tuple[str, str | None] | None:
    """The channel and recipient of a whole header (up to `<|message|>`), else None."""
    header = header.removeprefix(START + "assistant")
    before, sep, after = header.partition(CHANNEL)
    if not sep:
        return None
    recipient = before.strip().removeprefix("to=") or None
    channel, _, rest = after.partition(" ")
    rest = rest.replace(CONSTRAIN, " ").strip()
    for word in rest.split():
        if word.startswith("to="):
            recipient = word.removeprefix("to=")
    if not channel or (before.strip() and not before.strip().startswith("to=")):
        return None
    return channel, recipient


class HarmonyParser:
    """Chunks from what gpt-oss writes after `<|start|>assistant` (module docstring).

    Linear in what is fed, however it is split: a piece is read from an offset, message after
    message (a loop, not recursion), a header is looked for in at most its longest span, an end
    token by one search that stops at the first, and a held call keeps its pieces, joined once
    at its end."""

    def __init__(
        self, tool_names: Collection[str], *, max_calls: int | None = None, forced: bool = False
    ) -> None:
        self._names = frozenset(tool_names) if max_calls != 0 else frozenset()
        self._forced = forced
        #: "header" (a message's header being written), "content", "text" (not harmony: all
        #: of it is text), "done" (the turn ended), "over" (a forced call ended early: what
        #: follows is not said, its tokens are counted)
        self._phase = "header"
        self._after_start = False  # the header follows `<|end|>`: it begins `<|start|>`
        #: the header so far; in content, its last characters, where an end token may begin
        #: (a streamed message's are not handed on yet, a held call's are in `_call` too)
        self._held = ""
        self._head = ""  # the message's header as written: a held call released shows it
        self._call: list[str] = []  # a held call's content, in its pieces
        self._braces = Braces(depth=0)  # a streamed call's nesting
        self._tokens = 0  # tokens fed and not yet carried by a chunk
        self._kind = "text"  # the content's chunks: "reasoning", "text", "call", "held_call"
        self._name = ""
        self.calls = 0
        self.cut = False  # `CallParser.cut`

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str, tokens: int = 1) -> list[Chunk]:
        self._tokens += tokens
        chunks: list[Chunk] = []
        at = 0
        while True:
            phase = self._phase
            if phase == "over":
                return chunks
            if phase in ("text", "done"):
                return chunks + self._chunk(TextDelta, text[at:])
            read = self._header if phase == "header" else self._content
            at = read(text, at, chunks)
            if at >= len(text) and self._phase == phase:
                return chunks

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        if self._phase == "header" and self._held:
            chunks += self._release(self._held)
        elif self._phase == "content":
            self.cut = self._kind == "call"  # streamed: its end (`<|call|>`) never came
            if self._kind == "held_call":
                content = "".join(self._call)
                chunks += self._end_message(content) or self._release(self._head + content)
            else:
                chunks += self._end_message(self._held) or []
        tokens, self._tokens = self._tokens, 0
        return chunks, tokens

    def _header(self, text: str, at: int, chunks: list[Chunk]) -> int:
        """Read the header on from `at`; where the reading got to in `text`."""
        window = self._held + text[at : at + _HEADER_SPAN]
        end = window.find(MESSAGE)
        if end < 0:
            if _plausible_header(window, self._after_start):
                self._held = window
                return len(text)
            chunks += self._release(self._held + text[at:])
            return len(text)
        read = _read_header(window[:end])
        if read is None:
            chunks += self._release(self._held + text[at:])
            return len(text)
        channel, recipient = read
        if not _message(channel, recipient, self._names):
            chunks += self._release(self._held + text[at:])
            return len(text)
        past = at + end + len(MESSAGE) - len(self._held)
        self._head, self._held, self._call = window[: end + len(MESSAGE)], "", []
        self._phase = "content"
        if recipient is not None:
            self._name = recipient.removeprefix(FUNCTIONS)
            if self._forced:  # counted at its end: its arguments are still to come
                self._kind = "call"
                self._braces = Braces(depth=0)
                chunks.append(ToolCallBegin(self._name, self._tokens))
                self._tokens = 0
                return past
            self._kind = "held_call"
        elif channel == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "text"
        return past

    def _content(self, text: str, at: int, chunks: list[Chunk]) -> int:
        """Read the content on from `at`, up to its end token; where the reading got to."""
        found = self._find_end(text, at)
        held_call = self._kind == "held_call"
        if found is None:
            if held_call:
                self._call.append(text[at:])
                self._held = (self._held + text[max(at, len(text) - _END_SPAN) :])[-_END_SPAN:]
                return len(text)
            rest = self._held + text[at:]
            keep = _held_end(rest)
            self._held = rest[len(rest) - keep :]
            chunks += self._stream(rest[: len(rest) - keep])
            return len(text)
        start, past, end = found
        before = "".join(self._call) if held_call else self._held
        content = before + text[at : at + start] if start >= 0 else before[: len(before) + start]
        ended = self._end_message(content)
        if ended is None:  # released: the message as written and all after it
            chunks += self._release(self._head + "".join(self._call) + text[at:])
            return len(text)
        chunks += ended
        if self._phase == "over":
            return len(text)
        if end != END:
            self._phase = "done"
        else:
            self._phase, self._after_start, self._held = "header", True, ""
        return past

    def _find_end(self, text: str, at: int) -> tuple[int, int, str] | None:
        """The first end token in the held characters and `text[at:]`: where it starts from
        `at` (negative: in the held characters), where it ends in `text`, and which it is."""
        tail = self._held[-_END_SPAN:]
        edge = _END.search(tail + text[at : at + _END_SPAN])
        if edge is not None and edge.start() < len(tail):
            return edge.start() - len(tail), at + edge.end() - len(tail), edge.group()
        found = _END.search(text, at)
        return None if found is None else (found.start() - at, found.end(), found.group())

    def _stream(self, text: str) -> list[Chunk]:
        if self._kind == "reasoning":
            return self._chunk(ReasoningDelta, text)
        if self._kind == "call":
            return self._arguments(text)
        return self._chunk(TextDelta, text)

    def _arguments(self, text: str) -> list[Chunk]:
        """A streamed call's arguments; past `MAX_ARGUMENTS_DEPTH` the call ends there, and
        what follows is not said (as a framed call the model leaves)."""
        at, braces = 0, self._braces
        while not braces.deep and (end := braces.close(text, at)) is not None:
            at = end
        if not braces.deep:
            return self._chunk(ToolCallArgumentsDelta, text)
        self._phase = "over"
        self.calls += 1
        return [*self._chunk(ToolCallArgumentsDelta, text), ToolCallEnd()]

    def _end_message(self, text: str) -> list[Chunk] | None:
        """The message's last content (`text`) and its end; None: a held call that is no call
        (it is released)."""
        self._held = ""
        if self._kind == "held_call":
            if not json_object(text):
                return None
            self.calls += 1
            self._call = []
            tokens, self._tokens = self._tokens, 0
            arguments = ToolCallArgumentsDelta(text, tokens)
            return [ToolCallBegin(self._name, 0), arguments, ToolCallEnd()]
        chunks = self._stream(text) if text else []
        if self._kind == "call" and self._phase != "over":
            self.calls += 1
            if self._tokens and chunks == []:
                chunks = self._chunk(ToolCallArgumentsDelta, "")
            chunks.append(ToolCallEnd())
        return chunks

    def _release(self, written: str) -> list[Chunk]:
        """The message as the model wrote it (`written`), and all that follows, is text."""
        self._held, self._head, self._call = "", "", []
        self._phase = "text"
        return self._chunk(TextDelta, written)

    def _chunk(
        self, kind: type[ReasoningDelta | TextDelta | ToolCallArgumentsDelta], text: str
    ) -> list[Chunk]:
        if not text and not (kind is ToolCallArgumentsDelta and self._tokens):
            return []
        tokens, self._tokens = self._tokens, 0
        return [kind(text, tokens)]


#: A forced call as the grammar writes it after `<|start|>assistant`: the recipient in the
#: header, as harmony renders an earlier call; the turn ends with `<|call|>`, a stop token.
FRAME = CallFrame(
    open="",
    name_prefix=" to=functions.",
    name_suffix=f"{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}",
    args_suffix="",
    separator=None,
    close="",
    bare=True,
)


class Harmony(ToolSyntax):
    name = "harmony"
    frame = FRAME
    #: The answer is a `final` message, as harmony renders it back on the next turn.
    answer_head = f"{CHANNEL}final{MESSAGE}"
    own_parser = HarmonyParser
    rendering = Rendering.HARMONY

    def stop_ids(self, tokenizer: Any, configured: int | Sequence[int] | None) -> frozenset[int]:
        """Harmony's ends of an assistant's turn (`<|return|>`, `<|call|>`), as the
        tokenizer numbers them; `<|end|>` ends a message, and the turn goes on."""
        vocabulary = tokenizer.get_vocab()
        return frozenset(vocabulary[token] for token in (RETURN, CALL) if token in vocabulary)


HARMONY = Harmony()
