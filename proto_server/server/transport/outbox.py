"""A client channel as its writer drains it: merged deltas when the writer falls behind.

What travels in the channel is an `Outgoing`: an event and the WebSocket lane it belongs to
(None: the default lane, and every HTTP response). A `LaneSink` is how one lane's producers
(a sampling loop, a dialect answering a frame) put their events in it, and where a refusal
becomes the lane's `error` event (`LaneSink.refuse`).
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio

from proto_server.core.merge import MERGEABLE, continues, merge_run
from proto_server.server.process.logs import log
from proto_server.server.store.errors import StoreUnavailable
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ErrorEvent, ServerEvent


class Keeper(Protocol):
    """What keeps a Response's events, numbered, for a client that reattaches
    (server/rollouts/kept.py): told of each as its writer numbers it."""

    def keep(self, number: int, event: ServerEvent, nbytes: int, merged: int = 1) -> None:
        """`event` (standing for `merged` sent, merged) went out as `number`, `nbytes` long."""
        ...


@attrs.frozen
class Outgoing:
    event: ServerEvent
    stream_id: str | None = None
    #: Its number, already given (a kept event replayed); None: the lane's next.
    number: int | None = None
    #: Told of the event once numbered: its Response's events are kept for a reattach.
    kept: Keeper | None = None


class EventSink(Protocol):
    """Where a Response's events go, in order; awaiting is backpressure."""

    async def send(self, event: ServerEvent) -> None: ...

    def send_nowait(self, event: ServerEvent) -> None:
        """Without waiting, or `trio.WouldBlock` when the channel is full."""
        ...


class LaneAnswers(Protocol):
    """Where what answers a client's frame about a Response goes (a steer's acceptance, an
    inject's): its lane, numbered among the Response's own events."""

    @property
    def stream_id(self) -> str | None: ...

    async def send(self, event: ServerEvent) -> None: ...


@attrs.frozen
class LaneSink:
    """The events of one lane, into the one channel its connection's writer drains."""

    channel: trio.MemorySendChannel[Outgoing]
    stream_id: str | None = None
    #: The connection's number, for the log.
    connection: int | None = None
    #: Where the lane's events are kept for a reattach (None: nowhere).
    kept: Keeper | None = None

    async def send(self, event: ServerEvent) -> None:
        await self.channel.send(Outgoing(event, self.stream_id, kept=self.kept))

    async def refuse(self, exc: ProtocolError | StoreUnavailable) -> None:
        """The one place a WebSocket refusal becomes an `error` event (a frame's, from the
        connection's reader; a queued create's, from its lane's task): logged, then sent on
        this lane. Nothing it refused has happened, and the connection lives on."""
        log.info(
            "client.refused",
            extra={"connection": self.connection, "stream_id": self.stream_id,
                   "code": exc.detail.code, "param": exc.detail.param},
        )  # fmt: skip
        await self.send(ErrorEvent(status=exc.status, error=exc.detail))

    def send_nowait(self, event: ServerEvent) -> None:
        self.channel.send_nowait(Outgoing(event, self.stream_id, kept=self.kept))


class Outbox:
    """`await Outbox(receive, merge=True).batch(limit)`: the events to write next (each with
    its lane), and how many pending events each stands for.

    Events wait in the channel only while the writer is busy writing earlier ones, so with
    `merge` a writer that keeps up sends every delta as it is, and one that falls behind sends
    the consecutive deltas of an item that piled up as one frame. Lanes interleave, so only
    deltas of the same lane that follow each other in the channel are merged.
    """

    def __init__(self, receive: trio.MemoryReceiveChannel[Outgoing], *, merge: bool) -> None:
        self._receive = receive
        self._merge = merge
        self._held: Outgoing | None = None

    async def batch(self, limit: int) -> list[tuple[Outgoing, int]]:
        """As many events as are ready now (at least one, at most `limit`), to be written at
        once: one write and one scheduling round for them all instead of one each. Empty at
        the end of the channel.

        Merged (with `merge`) only if the writer fell behind: if events were waiting when it
        came back for more, they piled up while it wrote, and that pile is merged. A writer
        that had to wait for an event is keeping up: the events that came with it (a generator
        hands over every token due at once) go out as they are, each in its own frame, as a
        writer taking them one at a time would have sent them."""
        behind = self._held is not None or self._receive.statistics().current_buffer_used > 0
        merge = self._merge and behind
        first = await self._next()
        if first is None:
            return []
        batch = [self._merged(first, merge)]
        while len(batch) < limit:
            outgoing, self._held = self._held, None
            if outgoing is None:
                try:
                    outgoing = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break  # the end comes again, and is said, on the next call
            batch.append(self._merged(outgoing, merge))
        return batch

    async def _next(self) -> Outgoing | None:
        """The held event or the next one in the channel (waiting for it); None at the end."""
        outgoing, self._held = self._held, None
        if outgoing is not None:
            return outgoing
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            return None

    def _merged(self, outgoing: Outgoing, merge: bool) -> tuple[Outgoing, int]:
        """`outgoing`, merged (if `merge`) with the deltas that continue it and are waiting."""
        if not merge or outgoing.number is not None or not isinstance(outgoing.event, MERGEABLE):
            return outgoing, 1  # a replayed event keeps its number: never merged
        first = outgoing.event
        run: list[ServerEvent] = []
        while True:
            try:
                pending = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if (
                pending.stream_id != outgoing.stream_id
                or pending.number is not None
                or not continues(first, pending.event)
            ):
                self._held = pending
                break
            run.append(pending.event)
        if not run:
            return outgoing, 1
        return attrs.evolve(outgoing, event=merge_run(first, run)), len(run) + 1
