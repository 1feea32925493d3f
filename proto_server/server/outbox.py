"""A client channel as its writer drains it: merged deltas when the writer falls behind.

What travels in the channel is an `Outgoing`: an event and the WebSocket lane it belongs to
(None: the default lane, and every HTTP response). A `LaneSink` is how one lane's producers
(a sampling loop, a dialect answering a frame) put their events in it.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio

from proto_server.core.merge import MERGEABLE, merge_deltas
from proto_server.wire.events import ServerEvent


@attrs.frozen
class Outgoing:
    event: ServerEvent
    stream_id: str | None = None


class EventSink(Protocol):
    """Where a Response's events go, in order; awaiting is backpressure."""

    async def send(self, event: ServerEvent) -> None: ...


@attrs.frozen
class LaneSink:
    """The events of one lane, into the one channel its connection's writer drains."""

    channel: trio.MemorySendChannel[Outgoing]
    stream_id: str | None = None

    async def send(self, event: ServerEvent) -> None:
        await self.channel.send(Outgoing(event, self.stream_id))

    def send_nowait(self, event: ServerEvent) -> None:
        self.channel.send_nowait(Outgoing(event, self.stream_id))


class Outbox:
    """`async for outgoing, merged in Outbox(receive, merge=True)`: each event to write (with
    its lane), and how many pending events it stands for.

    Events wait in the channel only while the writer is busy writing earlier ones, so with
    `merge` a writer that keeps up sends every delta as it is, and one that falls behind sends
    the consecutive deltas of an item that piled up as one frame. Lanes interleave, so only
    deltas of the same lane that follow each other in the channel are merged.
    """

    def __init__(self, receive: trio.MemoryReceiveChannel[Outgoing], *, merge: bool) -> None:
        self._receive = receive
        self._merge = merge
        self._held: Outgoing | None = None

    def __aiter__(self) -> Outbox:
        return self

    async def __anext__(self) -> tuple[Outgoing, int]:
        outgoing, self._held = self._held, None
        if outgoing is None:
            try:
                outgoing = await self._receive.receive()
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
        merged = 1
        if self._merge and isinstance(outgoing.event, MERGEABLE):
            while True:
                try:
                    pending = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                combined = (
                    merge_deltas(outgoing.event, pending.event)
                    if pending.stream_id == outgoing.stream_id
                    else None
                )
                if combined is None:
                    self._held = pending
                    break
                outgoing, merged = Outgoing(combined, outgoing.stream_id), merged + 1
        return outgoing, merged
