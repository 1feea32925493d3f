"""A model's thinking, split from its answer as it streams: `<think> ... </think>` first.

Qwen3, QwQ and DeepSeek R1 think in a block of their own before they answer or call:

    <think>
    The loop stops one short; check range().
    </think>

    Let me look.<tool_call>...</tool_call>

`ThinkingParser` sits in front of the call parser (a family's, families/): what is inside the block
becomes `ReasoningDelta` chunks, what follows goes to the call parser as the model wrote it. It
keeps that parser's guarantees: text streams at once (only a possible start of a tag is held),
and every token fed is carried by exactly one chunk or returned by `finish`. A block is looked
for only at the start of the turn; a template whose generation prompt opens the block itself
(DeepSeek R1's ends in `<think>\n`) starts the parser inside it (`thinking=True`). The blank
lines around the thoughts are the template's, not the model's: they are carried by the chunks
(their tokens counted) but not shown: the block's tokens, its tags included, are reasoning
tokens; the blank lines after it are the answer's.
"""

from __future__ import annotations

from proto_server.engine.chunks import Chunk, ReasoningDelta
from proto_server.engine.families.base import WHITESPACE, CallParser
from proto_server.engine.families.stream import opening_prefix

OPEN = "<think>"
CLOSE = "</think>"
#: A block's tags: `<think>` and `</think>`, or a family's own (Magistral's `[THINK]`).
TAGS = (OPEN, CLOSE)


def split_thinking(
    answer: CallParser, *, thinks: bool, opened: bool, tags: tuple[str, str] = TAGS
) -> CallParser:
    """`answer` behind a `ThinkingParser` when the model thinks (`opened`: its turn begins
    inside the block), else `answer` itself."""
    return ThinkingParser(answer, thinking=opened, tags=tags) if thinks else answer


class ThinkingParser:
    def __init__(
        self, answer: CallParser, *, thinking: bool = False, tags: tuple[str, str] = TAGS
    ) -> None:
        self._answer = answer
        self._open, self._close = tags
        #: "start" (a block may open), "thinking" (inside it), "after" (the blank lines after
        #: it), "answer" (past those, or no block came)
        self._phase = "thinking" if thinking else "start"
        self._held = ""  # text not yet handed on: a possible tag, after `_space`
        #: whitespace not yet handed on, before `_held`: at the start, or at the thoughts' edge
        #: (kept in its pieces and looked at once, however long the run)
        self._space: list[str] = []
        self._tokens = 0  # tokens fed and not yet carried by a chunk
        self._thought = False  # a reasoning chunk went out (leading whitespace is shown after)

    @property
    def called(self) -> bool:
        return self._answer.called

    @property
    def calls(self) -> int:
        return self._answer.calls

    @property
    def cut(self) -> bool:
        return self._answer.cut

    def feed(self, text: str, tokens: int = 1) -> list[Chunk]:
        if self._phase == "answer":
            return self._answer.feed(text, tokens)
        self._tokens += tokens
        if self._phase == "after":
            return self._after(text)
        if self._phase == "start":
            return self._start(text)
        return self._think(text)

    def finish(self) -> tuple[list[Chunk], int]:
        """The chunks still held when decoding stopped, and the tokens no chunk carries."""
        chunks: list[Chunk] = []
        if self._phase == "thinking":
            chunks += self._reason((self._take_space() + self._held).rstrip(WHITESPACE))
        elif self._phase == "start" and self._held:
            chunks += self._to_answer(self._take_space() + self._held)
        self._held, self._space = "", []
        more, tokens = self._answer.finish()
        tokens += self._tokens
        self._tokens = 0
        return chunks + more, tokens

    def _start(self, text: str) -> list[Chunk]:
        if not self._held:  # whitespace before the block
            head = text.lstrip(WHITESPACE)
            self._space.append(text[: len(text) - len(head)])
            text = head
        self._held += text
        if self._open.startswith(self._held) and len(self._held) < len(self._open):
            return []  # the block may still open
        if not self._held.startswith(self._open):
            return self._to_answer(self._take_space() + self._held)
        self._phase, self._space = "thinking", []
        rest, self._held = self._held[len(self._open) :], ""
        return self._think(rest)

    def _think(self, text: str) -> list[Chunk]:
        held = self._held + text
        if not self._thought:
            held = held.lstrip(WHITESPACE)
        end = held.find(self._close)
        if end >= 0:
            thought, rest = held[:end], held[end + len(self._close) :]
            chunks = self._reason((self._take_space() + thought).rstrip(WHITESPACE))
            if not chunks and self._tokens and self._thought:
                # the close tag (and the blank before it) is the thinking's: its tokens too
                chunks = [ReasoningDelta("", self._tokens)]
                self._tokens = 0
            self._phase, self._held = "after", ""
            return chunks + self._after(rest)
        # hold a possible start of the close tag, and whitespace that may be the block's end
        keep = opening_prefix(held, self._close)
        body, self._held = held[: len(held) - keep], held[len(held) - keep :]
        out = body.rstrip(WHITESPACE)
        if not out:
            self._space.append(body)
            return []
        chunks = self._reason(self._take_space() + out)
        self._space.append(body[len(out) :])
        return chunks

    def _after(self, text: str) -> list[Chunk]:
        """The blank lines after the block are the template's: dropped as they come."""
        answer = text.lstrip(WHITESPACE)
        return self._to_answer(answer) if answer else []

    def _take_space(self) -> str:
        space, self._space = "".join(self._space), []
        return space

    def _reason(self, text: str) -> list[Chunk]:
        if not text:
            return []
        self._thought = True
        tokens, self._tokens = self._tokens, 0
        return [ReasoningDelta(text, tokens)]

    def _to_answer(self, text: str) -> list[Chunk]:
        self._phase = "answer"
        self._held = ""
        tokens, self._tokens = self._tokens, 0
        if not text and not tokens:
            return []
        return self._answer.feed(text, tokens)
