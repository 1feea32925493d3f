"""Logprobs and token ids as the API lists them, from what a generator knows of each token it
sampled.

A generator asked for them (`GenerationLimits.top_logprobs`, `.token_ids`) says each sampled
token (its id, its logprob, its API entry) in the order it sampled them, into a `Trail`. The
family's parser turns the text into chunks that each carry a count of the tokens they hold
(every token is carried by exactly one chunk, or by the segment's end: `CallParser`), so the
trail gives each chunk its own tokens, in order: a `TextDelta` keeps their API entries (they go
out with its text; the API lists logprobs of output text only, none of reasoning or of a call's
arguments), and every chunk their ids and logprobs (`Sampled`) where ids were asked; what no
chunk took is the segment end's (`Trail.rest`).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from proto_server.core.trace import Sampled
from proto_server.engine.chunks import (
    Chunk,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
)
from proto_server.wire.items import Logprob, TopLogprob

#: What a logprob of minus infinity (a token a grammar forbids) is said as: JSON has no
#: infinity, and vLLM says this.
FLOOR = -9999.0


def said(logprob: float) -> float:
    """`logprob` as JSON can carry it (minus infinity and NaN as `FLOOR`)."""
    return logprob if math.isfinite(logprob) else FLOOR


class TokenPieces:
    """Token ids to the text and UTF-8 bytes the API lists them with, each worked out once.

    `bytes_of(id)`: the token's bytes (a token may hold part of a character: its text then
    shows U+FFFD for what is missing, and its bytes say exactly what it holds)."""

    def __init__(self, bytes_of: Callable[[int], bytes]) -> None:
        self._bytes_of = bytes_of
        self._known: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        known = self._known.get(token)
        if known is None:
            raw = self._bytes_of(token)
            known = self._known[token] = (raw.decode("utf-8", "replace"), tuple(raw))
        return known

    def logprob(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> Logprob:
        """The API's entry for sampled `token`, with `top` (id, logprob), likeliest first."""
        text, raw = self(token)
        tops = []
        for other, value in top:
            other_text, other_raw = self(other)
            tops.append(TopLogprob(token=other_text, logprob=said(value), bytes=other_raw))
        return Logprob(token=text, logprob=said(logprob), bytes=raw, top_logprobs=tuple(tops))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet (`bytes_to_unicode`), from character back to byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def tokenizer_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """The bytes of a Hugging Face tokenizer's tokens: a byte-level BPE's (GPT-2's alphabet),
    a SentencePiece's (`▁` a space, `<0xNN>` one byte), an added token's as its text."""
    added = set(tokenizer.get_added_vocab().values())
    spaced = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
    table = _byte_level_table() if "\u0120" in "".join(spaced) else None

    def bytes_of(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if token in added:
            return piece.encode()
        if table is not None and all(char in table for char in piece):
            return bytes(table[char] for char in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    return bytes_of


#: The chunks that carry tokens of an item, and so their ids (`Sampled`).
SAMPLED = (TextDelta, ReasoningDelta, ToolCallBegin, ToolCallArgumentsDelta)


class Trail:
    """The tokens sampled and not yet handed to a chunk, in order. `ids`: each chunk gets its
    tokens' ids and logprobs (`Sampled`) too."""

    def __init__(self, *, ids: bool = False) -> None:
        self.ids = ids
        #: (id, logprob, API entry: None for a token with no text, or where none was asked).
        self._waiting: deque[tuple[int, float, Logprob | None]] = deque()

    def add(self, token: int, logprob: float, entry: Logprob | None = None) -> None:
        self._waiting.append((token, logprob, entry))

    def attach(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """`chunks`, each text delta with the logprobs of the tokens it carries, and each chunk
        with their ids (`Sampled`) where they were asked."""
        attached = []
        for chunk in chunks:
            taken = self._take(getattr(chunk, "tokens", 0))
            if isinstance(chunk, TextDelta):
                entries = tuple(entry for _, _, entry in taken if entry is not None)
                if entries:
                    chunk = attrs.evolve(chunk, logprobs=entries)
            if self.ids and isinstance(chunk, SAMPLED):
                chunk = attrs.evolve(chunk, sampled=_sampled(taken))
            attached.append(chunk)
        return attached

    def rest(self) -> Sampled | None:
        """What no chunk took (the end of the turn, what the parser held): the segment end's;
        None where ids were not asked."""
        taken = self._take(len(self._waiting))
        return _sampled(taken) if self.ids else None

    def _take(self, count: int) -> list[tuple[int, float, Logprob | None]]:
        waiting = self._waiting
        return [waiting.popleft() for _ in range(min(count, len(waiting)))]


def _sampled(taken: Sequence[tuple[int, float, Logprob | None]]) -> Sampled:
    return Sampled(
        ids=tuple(token for token, _, _ in taken),
        logprobs=tuple(said(logprob) for _, logprob, _ in taken),
    )
