"""What every family's streaming parser shares: text outside a block, token marks inside one.

Text streams as it is fed, but for what could start the block's opening and whitespace before
anything was said (dropped if a call follows, so a call opens no empty message). Inside a
block each fed piece is marked (its offset, its tokens), so a streamed call's argument pieces
carry the tokens of the pieces they start (`call_chunks`' cuts), and every token is carried
by exactly one chunk.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from proto_server.engine.chunks import Chunk, TextDelta, ToolCallArgumentsDelta, ToolCallEnd
from proto_server.engine.families.base import WHITESPACE


def opening_prefix(text: str, opening: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `opening`."""
    for length in range(min(len(text), len(opening) - 1), 0, -1):
        if opening.startswith(text[-length:]):
            return length
    return 0


@attrs.define
class Braces:
    """Where a scan of a JSON value's braces stands (outside strings), from just past its `{`."""

    depth: int = 1
    in_string: bool = False
    escaped: bool = False

    def close(self, text: str, start: int) -> int | None:
        """Where the value ends (past its closing brace), scanning from `start`; None: not in
        `text` yet (the scan goes on from its end)."""
        for at in range(start, len(text)):
            char = text[at]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        return None


class BlockStream:
    """The state and helpers of a parser (`CallParser`) of one family's blocks."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None) -> None:
        self._names = frozenset(tool_names) if max_calls != 0 else frozenset()
        self._text = ""  # held text: a possible start of the opening, or leading whitespace
        self._tokens = 0  # tokens fed and not yet carried by a chunk
        self._block: str | None = None  # the text after the opening, while inside a block
        self._marks: list[tuple[int, int]] = []  # (offset in the block, tokens) per piece
        self._lead = ""  # whitespace held before the current block
        self._spoke = False
        self.calls = 0
        self.cut = False  # `CallParser.cut`

    @property
    def called(self) -> bool:
        return self.calls > 0

    def _take_text(self, length: int) -> str:
        """The first `length` held characters, unless they are only leading whitespace."""
        head = self._text[:length]
        if not self._spoke and not head.strip(WHITESPACE):
            return ""
        self._text = self._text[length:]
        return head

    def _emit_text(self, text: str) -> list[Chunk]:
        """`text` as the model's text; none once its calls are read: a segment's calls come
        last (the model's turn ends on them), so what it writes after them is not said, and
        its tokens are what `finish` returns (counted as output, shown nowhere)."""
        if not text or self.calls:
            return []
        self._spoke = True
        tokens, self._tokens = self._tokens, 0
        return [TextDelta(text, tokens)]

    def _finish_text(self, chunks: list[Chunk]) -> tuple[list[Chunk], int]:
        """`chunks`, then the text still held, and the tokens no chunk carries."""
        if self._text.strip(WHITESPACE) or (self._spoke and self._text):
            chunks += self._emit_text(self._text)
        self._text = ""
        tokens, self._tokens = self._tokens, 0
        return chunks, tokens

    def _pieces(self, sent: int, limit: int) -> list[tuple[str, int]]:
        """The block's text from `sent` up to `limit`, cut where the model's pieces start, each
        with the tokens of the pieces starting there (`call_chunks`' cuts)."""
        block = self._block
        assert block is not None
        pieces: list[tuple[str, int]] = []
        left, tokens = sent, 0
        while self._marks and self._marks[0][0] < limit:
            offset, count = self._marks.pop(0)
            if offset > left:
                pieces.append((block[left:offset], tokens))
                left, tokens = offset, 0
            tokens += count
        if left < limit:
            pieces.append((block[left:limit], tokens))
        elif tokens:  # no text yet for those tokens: they wait for it
            self._marks.insert(0, (left, tokens))
        return pieces

    @staticmethod
    def _deltas(pieces: list[tuple[str, int]]) -> list[Chunk]:
        return [ToolCallArgumentsDelta(text, tokens) for text, tokens in pieces]

    def _last_piece(self, pending: tuple[str, int], *, everything: bool) -> list[Chunk]:
        """A call's last piece and its end; `everything`: the block's last call, which also
        carries every token still held (what came after its arguments)."""
        text, tokens = pending
        if everything:
            tokens += sum(count for _, count in self._marks)
            self._marks = []
        return [ToolCallArgumentsDelta(text, tokens), ToolCallEnd()]
