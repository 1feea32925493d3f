"""o200k_base comes from a vocabulary file that ships in a package: no network, real counts."""

from __future__ import annotations

import socket

import pytest

from proto_server.core import tokenizer


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
