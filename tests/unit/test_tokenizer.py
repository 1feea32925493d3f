"""o200k_base comes from a vocabulary file that ships in a package: no network, real counts."""

from __future__ import annotations

import random
import socket

import pytest

from proto_server.core import tokenizer
from proto_server.core.tokenizer import ENCODE_CHUNK, encode_bounded, o200k_base


def test_o200k_base_loads_without_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer tried to use the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    tokenizer.o200k_base.cache_clear()
    encoding = tokenizer.o200k_base()
    assert encoding.name == "o200k_base"
    assert encoding.n_vocab == 200019
    # reference ids of o200k_base, as OpenAI's tokenizer assigns them
    assert encoding.encode("hello world") == [24912, 2375]
    assert encoding.decode(encoding.encode("naïve 🦀 code")) == "naïve 🦀 code"


def test_a_long_text_is_encoded_a_chunk_at_a_time_with_the_same_tokens() -> None:
    """`encode_bounded` cuts a long text before a space between two non-spaces, where o200k's
    pieces end anyway: prose of many chunks (punctuation, digits, newlines, runs of spaces,
    non-ASCII) encodes exactly as it does whole; a run with no space is cut too, and comes back
    close to its whole count."""
    encoding = o200k_base()
    rng = random.Random(22)
    words = ["the", "fix", "bug,", "tests.", "x=1;", "\n", "  ", "\tdef", "42", "é", "漢字",
             "don't", "path/to", "   \n"]  # fmt: skip
    prose = " ".join(rng.choice(words) for _ in range(60_000))
    assert len(prose) > 4 * ENCODE_CHUNK
    assert list(encode_bounded(encoding, prose)) == encoding.encode_ordinary(prose)
    run = "x" * (3 * ENCODE_CHUNK + 5)
    whole = len(encoding.encode_ordinary(run))
    assert abs(len(encode_bounded(encoding, run)) - whole) <= 4
    assert encode_bounded(encoding, "short text") == encoding.encode_ordinary("short text")
