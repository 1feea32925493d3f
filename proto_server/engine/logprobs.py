"""Logprobs as the API lists them, from what a generator knows of each token it sampled.

A generator asked for them (`GenerationLimits.top_logprobs`) says each sampled token's logprob,
in the order it sampled the tokens, into a `Trail`. The family's parser turns the text into
chunks that each carry a count of the tokens they hold (every token is carried by exactly one
chunk, or by the segment's end: `CallParser`), so the trail gives each chunk the logprobs of
its own tokens, in order: a `TextDelta` keeps them (they go out with its text); the others drop
theirs (the API lists logprobs of output text only, none of reasoning or of a call's arguments).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from proto_server.engine.chunks import Chunk, TextDelta
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


class Trail:
    """The logprobs of the tokens sampled and not yet handed to a chunk, in order."""

    def __init__(self) -> None:
        self._waiting: deque[Logprob] = deque()

    def add(self, entries: Iterable[Logprob]) -> None:
        self._waiting.extend(entries)

    def attach(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """`chunks`, each text delta with the logprobs of the tokens it carries."""
        attached = []
        for chunk in chunks:
            tokens = getattr(chunk, "tokens", 0)
            taken = tuple(self._take(tokens))
            if isinstance(chunk, TextDelta) and taken:
                chunk = attrs.evolve(chunk, logprobs=taken)
            attached.append(chunk)
        return attached

    def _take(self, count: int) -> Iterable[Logprob]:
        waiting = self._waiting
        for _ in range(min(count, len(waiting))):
            yield waiting.popleft()
