"""Framed events are written as pieces: a large payload is never copied into a joined write."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from proto_server.server.transport.pieces import WHOLE_PIECE_BYTES, send_pieces
from proto_server.server.transport.sendtimeout import SendTimeout

LARGE = b"x" * WHOLE_PIECE_BYTES


class Writes(trio.abc.SendStream):
    """Records each write; the `stall_at`th (from 1) raises `SendTimeout` having sent 3 bytes."""

    def __init__(self, stall_at: int = 0) -> None:
        self.writes: list[bytes] = []
        self.stall_at = stall_at

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        if len(self.writes) + 1 == self.stall_at:
            raise SendTimeout(1.0, bytes(data[3:]))
        self.writes.append(data if isinstance(data, bytes) else bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_short_pieces_are_joined_and_a_long_one_is_written_as_it_is() -> None:
    stream = Writes()
    await send_pieces(stream, [b"a", b"b", LARGE, b"c", b"d"])
    assert stream.writes == [b"ab", LARGE, b"cd"]
    assert stream.writes[1] is LARGE  # not a copy


async def test_a_stalled_write_carries_everything_left_unsent() -> None:
    """The writer finishes the frame it cut and closes: nothing after the stall is lost."""
    stream = Writes(stall_at=2)
    with pytest.raises(SendTimeout) as stalled:
        await send_pieces(stream, [b"head", LARGE, b"tail", b"next"])
    assert stream.writes == [b"head"]
    assert stalled.value.unsent == LARGE[3:] + b"tailnext"
