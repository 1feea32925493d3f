"""A client channel as its writer drains it: merged deltas when the writer falls behind."""

from __future__ import annotations

import trio

from proto_server.core.merge import MERGEABLE, merge_deltas
from proto_server.wire.events import ServerEvent


class Outbox:
    """`async for event, merged in Outbox(receive, merge=True)`: each event to write, and how
    many pending events it stands for.

    Events wait in the channel only while the writer is busy writing earlier ones, so with
    `merge` a writer that keeps up sends every delta as it is, and one that falls behind sends
    the consecutive deltas of an item that piled up as one frame.
    """

    def __init__(self, receive: trio.MemoryReceiveChannel[ServerEvent], *, merge: bool) -> None:
        self._receive = receive
        self._merge = merge
        self._held: ServerEvent | None = None

    def __aiter__(self) -> Outbox:
        return self

    async def __anext__(self) -> tuple[ServerEvent, int]:
        event, self._held = self._held, None
        if event is None:
            try:
                event = await self._receive.receive()
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
        merged = 1
        if self._merge and isinstance(event, MERGEABLE):
            while True:
                try:
                    pending = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                combined = merge_deltas(event, pending)
                if combined is None:
                    self._held = pending
                    break
                event, merged = combined, merged + 1
        return event, merged
