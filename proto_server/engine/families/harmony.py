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
JSON object, streamed under a grammar). The headers are not shown; their tokens go on the next
chunk. What does not read as harmony (no header where one must be, a call to a tool not
offered, arguments that are no object, a built-in tool such as `to=python`) is released as the
text the model wrote. Every token fed is carried by exactly one chunk or returned by `finish`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from proto_server.engine.chunks import (
    Chunk,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.families.base import CallFrame, CallParser, ToolSyntax

if TYPE_CHECKING:
    from proto_server.engine.harmony_renderer import HarmonyRenderer

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
#: What ends a message's content: `<|end|>` (another message follows), or the turn's end.
_ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."
#: A header longer than this is no header: what was held is released as text.
MAX_HEADER_CHARS = 256


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
    """Chunks from what gpt-oss writes after `<|start|>assistant` (module docstring)."""

    def __init__(
        self, tool_names: Collection[str], *, max_calls: int | None = None, forced: bool = False
    ) -> None:
        self._names = frozenset(tool_names) if max_calls != 0 else frozenset()
        self._forced = forced
        #: "header" (a message's header being written), "content", "text" (not harmony: all
        #: of it is text), "done" (the turn ended)
        self._phase = "header"
        self._after_start = False  # the header follows `<|end|>`: it begins `<|start|>`
        self._raw = ""  # the current message as written (released whole if it is no harmony)
        self._held = ""  # content not yet handed on
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
        if self._phase == "text":
            return self._chunk(TextDelta, text)
        if self._phase == "done":
            return self._chunk(TextDelta, text)
        self._raw += text
        if self._phase == "header":
            self._held += text
            return self._header()
        self._held += text
        return self._content()

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        if self._phase == "header" and self._held:
            chunks += self._release()
        elif self._phase == "content":
            self.cut = self._kind == "call"  # streamed: its end (`<|call|>`) never came
            chunks += self._end_message(self._held)
        tokens, self._tokens = self._tokens, 0
        return chunks, tokens

    def _header(self) -> list[Chunk]:
        header = self._held
        end = header.find(MESSAGE)
        if end < 0:
            return [] if _plausible_header(header, self._after_start) else self._release()
        read = _read_header(header[:end])
        if read is None:
            return self._release()
        channel, recipient = read
        self._held = header[end + len(MESSAGE) :]
        self._phase = "content"
        if recipient is not None:
            self._name = recipient.removeprefix(FUNCTIONS)
            if not recipient.startswith(FUNCTIONS) or self._name not in self._names:
                return self._release()  # a call the request does not allow, a built-in tool
            if self._forced:  # counted at its end: its arguments are still to come
                self._kind = "call"
                begin = ToolCallBegin(self._name, self._tokens)
                self._tokens = 0
                return [begin, *self._content()]
            self._kind = "held_call"
        elif channel == "analysis":
            self._kind = "reasoning"
        elif channel in ("final", "commentary"):
            self._kind = "text"
        else:
            return self._release()  # a channel harmony does not have
        return self._content()

    def _content(self) -> list[Chunk]:
        held = self._held
        ends = [(held.find(end), end) for end in _ENDS if end in held]
        if ends:
            at, end = min(ends)
            rest = held[at + len(end) :]
            chunks = self._end_message(held[:at])
            if self._phase == "text":
                return chunks  # released: the message as written and all after it
            if end != END:
                self._phase = "done"
                return chunks + (self._chunk(TextDelta, rest) if rest else [])
            self._phase, self._after_start, self._raw, self._held = "header", True, rest, rest
            return chunks + (self._header() if rest else [])
        if self._kind == "held_call":
            return []
        keep = _held_end(held)
        self._held = held[len(held) - keep :]
        return self._stream(held[: len(held) - keep])

    def _stream(self, text: str) -> list[Chunk]:
        if self._kind == "reasoning":
            return self._chunk(ReasoningDelta, text)
        if self._kind == "call":
            return self._chunk(ToolCallArgumentsDelta, text)
        return self._chunk(TextDelta, text)

    def _end_message(self, text: str) -> list[Chunk]:
        """The message's last content (`text`) and its end."""
        self._held = ""
        if self._kind == "held_call":
            try:
                valid = isinstance(json.loads(text), dict)
            except ValueError:
                valid = False
            if not valid:
                return self._release()
            self.calls += 1
            tokens, self._tokens = self._tokens, 0
            arguments = ToolCallArgumentsDelta(text, tokens)
            return [ToolCallBegin(self._name, 0), arguments, ToolCallEnd()]
        chunks = self._stream(text) if text else []
        if self._kind == "call":
            self.calls += 1
            if self._tokens and chunks == []:
                chunks = self._chunk(ToolCallArgumentsDelta, "")
            chunks.append(ToolCallEnd())
        return chunks

    def _release(self) -> list[Chunk]:
        """The message as the model wrote it, and all that follows, is text."""
        raw, self._raw, self._held = self._raw, "", ""
        self._phase = "text"
        return self._chunk(TextDelta, raw)

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

    def parser(
        self, tool_names: Collection[str], *, max_calls: int | None = None, forced: bool = False
    ) -> CallParser:
        return HarmonyParser(tool_names, max_calls=max_calls, forced=forced)

    def renderer(self, tokenizer: Any, *, cache_bytes: int) -> HarmonyRenderer:
        """openai-harmony's rendering: gpt-oss has no chat template."""
        from proto_server.engine.harmony_renderer import HarmonyRenderer

        return HarmonyRenderer(cache_bytes=cache_bytes)

    def stop_ids(self, tokenizer: Any, configured: int | Sequence[int] | None) -> frozenset[int]:
        """Harmony's ends of an assistant's turn (`<|return|>`, `<|call|>`), as the
        tokenizer numbers them; `<|end|>` ends a message, and the turn goes on."""
        vocabulary = tokenizer.get_vocab()
        return frozenset(vocabulary[token] for token in (RETURN, CALL) if token in vocabulary)


HARMONY = Harmony()
