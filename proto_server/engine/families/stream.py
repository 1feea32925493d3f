"""What every family's streaming parser shares: text outside a block, token marks inside one.

Text streams as it is fed, but for what could start the block's opening and whitespace before
anything was said (dropped if a call follows, so a call opens no empty message). Inside a
block each fed piece is marked (its offset, its tokens), so a streamed call's argument pieces
carry the tokens of the pieces they start (`call_chunks`' cuts), and every token is carried
by exactly one chunk.

The work is linear in what is fed, however it is split: a scan resumes where the last piece
left it (whitespace, strings and arguments are read once), a held block grows in place
(`_grow`), and text that ends a block or proves not to be one is read again by a loop
(`_drive`), not by recursion, so a piece holding a thousand openings is a thousand steps.
"""

from __future__ import annotations

from collections.abc import Collection

from proto_server.engine.chunks import Chunk, TextDelta, ToolCallArgumentsDelta, ToolCallEnd
from proto_server.engine.families.base import WHITESPACE


def opening_prefix(text: str, opening: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `opening`."""
    for length in range(min(len(text), len(opening) - 1), 0, -1):
        if opening.startswith(text[-length:]):
            return length
    return 0


class BlockStream:
    """The state and helpers of a parser (`CallParser`) of one family's blocks."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None) -> None:
        self._names = frozenset(tool_names) if max_calls != 0 else frozenset()
        self._longest = max(map(len, self._names), default=0)
        self._text = ""  # held text: a possible start of the opening, and the piece just fed
        self._tokens = 0  # tokens fed and not yet carried by a chunk
        self._block: str | None = None  # the text after the opening, while inside a block
        self._marks: list[tuple[int, int]] = []  # (offset in the block, tokens) per piece
        #: whitespace held before anything was said, or before the block, in its pieces
        self._lead: list[str] = []
        self._spoke = False
        self._queued = False  # `_text` or `_block` holds text handed on and not yet read
        self.calls = 0
        self.cut = False  # `CallParser.cut`

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str, tokens: int = 1) -> list[Chunk]:
        if self._block is not None:
            self._marks.append((len(self._block), tokens))
            self._grow(text)
        else:
            self._tokens += tokens
            self._text += text  # short: what it held is a possible start of the opening
        self._queued = True
        return self._drive()

    def _drive(self) -> list[Chunk]:
        """Read what is queued, the block's text or the text outside one, until all of it waits
        for more: each step ends a block or opens one, and queues what follows it."""
        chunks: list[Chunk] = []
        while self._queued:
            self._queued = False
            chunks += self._scan_block() if self._block is not None else self._scan_text()
        return chunks

    def _scan_text(self) -> list[Chunk]:
        raise NotImplementedError

    def _scan_block(self) -> list[Chunk]:
        raise NotImplementedError

    def _grow(self, text: str) -> None:
        """`text` added to the block. The block is taken out of the parser while it grows, so
        that the string has no other reference and CPython extends it in place: amortised
        O(len(text)), where `self._block += text` would copy the whole block each piece."""
        block, self._block = self._block, None
        assert block is not None
        block += text
        self._block = block

    def _open(self, before: str, rest: str) -> list[Chunk]:
        """A block opens after `before` (held text) with `rest`, its text so far, queued."""
        chunks: list[Chunk] = []
        if self._spoke or before.strip(WHITESPACE):
            chunks = self._emit_text(before)
        else:  # leading whitespace: dropped if a call follows, its tokens going to the call
            self._lead.append(before)
        self._text = ""
        self._block = rest
        self._marks = [(0, self._tokens)]
        self._tokens = 0
        self._queued = True
        return chunks

    def _rescan(self, text: str) -> None:
        """`text` (what follows a block, or a block's text once it proved not to be one) is
        read as text, by `_drive`."""
        self._end_block()
        self._text = text
        self._queued = bool(text)

    def _end_block(self) -> None:
        self._block = None

    def _take_text(self, length: int) -> str:
        """The first `length` held characters, unless they are only leading whitespace (held
        in `_lead`, so it is looked at once: what is said next carries it)."""
        head, self._text = self._text[:length], self._text[length:]
        if not self._spoke and not head.strip(WHITESPACE):
            self._lead.append(head)
            return ""
        return head

    def _emit_text(self, text: str) -> list[Chunk]:
        """`text` as the model's text, after the whitespace held before it; none once its calls
        are read: a segment's calls come last (the model's turn ends on them), so what it
        writes after them is not said, and its tokens are what `finish` returns (counted as
        output, shown nowhere)."""
        if text and self._lead and not self._spoke:
            text = self._take_lead() + text
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
        self._lead = []
        tokens, self._tokens = self._tokens, 0
        return chunks, tokens

    def _take_lead(self) -> str:
        lead, self._lead = "".join(self._lead), []
        return lead

    def _pieces(self, sent: int, limit: int) -> list[tuple[str, int]]:
        """The block's text from `sent` up to `limit`, cut where the model's pieces start, each
        with the tokens of the pieces starting there (`call_chunks`' cuts)."""
        block = self._block
        assert block is not None
        pieces: list[tuple[str, int]] = []
        left, tokens, used = sent, 0, 0
        for offset, count in self._marks:
            if offset >= limit:
                break
            used += 1
            if offset > left:
                pieces.append((block[left:offset], tokens))
                left, tokens = offset, 0
            tokens += count
        del self._marks[:used]
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
