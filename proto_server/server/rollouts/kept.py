"""A streamed Response's events, kept so that a client that went away can reattach.

While a client streams a Response, its writer tells `KeptEvents` each event it numbers
(`Outgoing.kept`). When the client goes away mid-stream, `hold` takes the writer's place: the
Response runs on, each event numbered as the writer would have numbered it and kept, for
`--reattach-grace` (a reader attached stops the clock, its leaving restarts it). A reattach
(`tail`) replays every kept event after the one the client saw last, then follows the live
rest: no gap, nothing twice. Once the grace lapses with no reader, a Response that has not
ended is cut as a dropped client's always was (its task cancelled, its rollout released); once a
reader has its terminal event, nothing more is kept.

Over the prototype WebSocket dialect a `Relay` stands between the Response's sampling loop and
its lane: the loop outlives its connection (its task shielded from the connection's end), the
relay keeps what the lane's writer never numbered, and a `response.reattach` attaches it to a
lane of another connection, replayed first.

What is kept is bounded per Response (`--reattach-keep-bytes`) and charged to the process's
memory budget: past the bound (or when that budget is full) the oldest events go, and a
reattach from before them is refused (`reattach_events_lost`, saying from which number).
"""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import attrs
import trio

from proto_server.core.response.status import TERMINAL_EVENTS
from proto_server.server.process.logs import log
from proto_server.server.process.memory import MemoryBudget
from proto_server.server.process.offload import INLINE_BYTES
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.transport.outbox import LaneSink, Outbox, Outgoing
from proto_server.server.transport.writer import WRITE_BATCH, echoed_bytes
from proto_server.wire.converter import encode_server_event_bytes
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import ServerEvent

#: What one kept event costs beyond its JSON: the event object and its place in the queue.
KEPT_EVENT_BYTES = 256
#: The wire code of a reattach after events that were no longer kept.
EVENTS_LOST = "reattach_events_lost"


def kept_bytes(event: ServerEvent, number: int) -> int:
    """What keeping `event` is charged beyond `KEPT_EVENT_BYTES`: its JSON, where encoding it
    is cheap. An event whose encoding grows with what it echoes (many tools or items, which the
    writer encodes off the loop) is charged the least its JSON takes instead, so that sizing
    what is kept never holds the event loop."""
    least = echoed_bytes(event)
    return least if least > INLINE_BYTES else len(encode_server_event_bytes(event, number))


@attrs.frozen
class Kept:
    number: int
    event: ServerEvent
    nbytes: int


def events_lost(response_id: str, after: int, first: int) -> ProtocolError:
    return ProtocolError(
        EVENTS_LOST,
        f"Response {quoted(response_id)}: the events after sequence_number {after} are no longer "
        f"all kept; the first kept is {first} (--reattach-keep-bytes bounds them). Retrieve the "
        "Response once it ends, or start it over.",
        param="starting_after",
        status=410,
    )


class KeptEvents:
    """One Response's events as its client was sent them, numbered, for a reattach by `owner`."""

    def __init__(self, owner: str, *, limit: int, budget: MemoryBudget) -> None:
        #: Named once its Response is begun (its sink, which holds this, comes first).
        self.response_id = ""
        self.owner = owner
        self._limit = limit
        self._budget = budget
        self._events: collections.deque[Kept] = collections.deque()
        self._bytes = 0
        #: The number the next event gets.
        self.next = 0
        #: Every event numbered below this is no longer kept.
        self.first = 0
        #: Its terminal event is kept.
        self.ended = False
        #: A reader wrote the terminal event: nothing more need be kept.
        self.delivered = False
        #: Readers attached now (a reattached client's stream).
        self.readers = 0
        self.released = False
        #: What streams it over a WebSocket (None: over HTTP).
        self.relay: Relay | None = None
        self._changed = trio.Event()

    def keep(self, number: int, event: ServerEvent, nbytes: int, merged: int = 1) -> None:
        if number < self.next or self.released:
            return  # kept already: a reader's writer numbers what `hold` numbered
        self.next = number + 1
        size = nbytes + KEPT_EVENT_BYTES
        self._events.append(Kept(number, event, size))
        self._bytes += size
        self._budget.charge(size)
        while len(self._events) > 1 and (
            self._bytes > self._limit or self._budget.used > self._budget.limit
        ):
            self._drop()
        self.ended = self.ended or isinstance(event, TERMINAL_EVENTS)
        self._changed_now()

    def _drop(self) -> None:
        oldest = self._events.popleft()
        self._bytes -= oldest.nbytes
        self._budget.charge(-oldest.nbytes)
        self.first = oldest.number + 1

    def after(self, number: int) -> list[Kept]:
        """The kept events numbered above `number`; `reattach_events_lost` if some are gone."""
        if number + 1 < self.first:
            raise events_lost(self.response_id, number, self.first)
        return [kept for kept in self._events if kept.number > number]

    async def changed(self) -> None:
        """Return at the next change: an event kept, a reader come or gone, the end delivered."""
        await self._changed.wait()

    def attach(self) -> None:
        self.readers += 1
        self._changed_now()

    def detach(self, *, delivered: bool) -> None:
        self.readers -= 1
        self.delivered = self.delivered or delivered
        self._changed_now()

    def release(self) -> None:
        """Nothing more is kept, and what was is no longer counted."""
        while self._events:
            self._drop()
        self.released = True
        self._changed_now()

    def touch(self) -> None:
        """Wake whoever waits for a change (a relay's lane came or went)."""
        self._changed_now()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class Detached:
    """The streamed Responses of this process, their events kept for a reattach, by id: from
    their first event (a client may come back before the server sees that it left)."""

    def __init__(self) -> None:
        self._held: dict[str, KeptEvents] = {}
        #: The server is stopping: a WebSocket Response whose connection goes is cut at once.
        self.stopping = False
        #: Connections whose client went away, open only for the Responses they keep for a
        #: reattach: no client's, so not counted toward --max-connections.
        self.holding = 0

    @contextmanager
    def held(self) -> Iterator[None]:
        """While this lasts, one connection is open only for what it keeps."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1

    def stop(self) -> None:
        """Cut every WebSocket Response that waits for a reattach, and every one that will."""
        self.stopping = True
        for kept in list(self._held.values()):
            if kept.relay is not None and kept.relay.target is None:
                kept.relay.cut()

    def find(self, response_id: str, owner: str) -> KeptEvents | None:
        """`owner`'s Response `response_id`, if kept; another key's is not found."""
        kept = self._held.get(response_id)
        return kept if kept is not None and kept.owner == owner else None

    @asynccontextmanager
    async def keeping(self, kept: KeptEvents) -> AsyncIterator[None]:
        """Findable while its first stream lasts (and its `hold`), then let go once no reader
        is attached (a reader has the terminal event to read)."""
        self._held[kept.response_id] = kept
        try:
            yield
            while kept.readers:
                await kept.changed()
        finally:
            del self._held[kept.response_id]
            kept.release()

    async def hold(
        self, kept: KeptEvents, outbox: Outbox, cut: Callable[[], None], *, grace_s: float
    ) -> None:
        """Be the writer of a Response whose client went away: keep its events until a
        reader has its end, or until no reader was attached for `grace_s`; then, if it has
        not ended, `cut` it as a dropped client's Response is cut."""
        log.info("response.detached", extra={"response": kept.response_id, "from": kept.next})
        with self.held():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, outbox, kept)
                await _lapsed(kept, grace_s)
                nursery.cancel_scope.cancel()
        if not kept.ended:
            log.info("response.reattach_lapsed", extra={"response": kept.response_id})
            cut()


class Holding:
    """A WebSocket connection's Responses kept after its client went: while any runs, the
    connection is open only for them (`Detached.holding`)."""

    def __init__(self, detached: Detached) -> None:
        self._detached = detached
        self._lost: set[Relay] = set()

    def lost(self, relay: Relay) -> None:
        """`relay`'s Response runs on here, its client gone."""
        if not self._lost:
            self._detached.holding += 1
        self._lost.add(relay)

    def over(self, relay: Relay) -> None:
        """`relay`'s Response no longer runs here."""
        if relay in self._lost:
            self._lost.remove(relay)
            if not self._lost:
                self._detached.holding -= 1


async def pump(outbox: Outbox, kept: KeptEvents) -> None:
    """Number and keep what the Response sends, as its writer would have, until its end."""
    while batch := await outbox.batch(WRITE_BATCH):
        for outgoing, _ in batch:
            number = kept.next if outgoing.number is None else outgoing.number
            kept.keep(number, outgoing.event, kept_bytes(outgoing.event, number))
            if kept.ended:
                return


async def _lapsed(kept: KeptEvents, grace_s: float) -> None:
    """Return once a reader has the end, or once no reader was attached for `grace_s`."""
    deadline = trio.current_time() + grace_s
    while not kept.delivered:
        if kept.readers:
            deadline = math.inf
        elif deadline == math.inf:
            deadline = trio.current_time() + grace_s
        if trio.current_time() >= deadline:
            return
        with trio.move_on_at(deadline):
            await kept.changed()


async def tail(kept: KeptEvents, after: int, send: trio.MemorySendChannel[Outgoing]) -> None:
    """Every kept event numbered above `after`, then each as it is kept, to the end: into
    `send`, numbered as first sent (`reattach_events_lost` if a slow reader fell behind)."""
    cursor = after
    while not kept.released:
        for event in kept.after(cursor):
            await send.send(Outgoing(event.event, number=event.number))
            cursor = event.number
            if isinstance(event.event, TERMINAL_EVENTS):
                return
        if kept.next - 1 <= cursor:
            await kept.changed()


class Relay:
    """A WebSocket Response's events on their way from its sampling loop (an `EventSink`) to
    the lane it is attached to, each kept as that lane's writer numbers it (`keep`). When its
    connection is lost, the events its writer never numbered and the rest are numbered here and
    kept; `attach` on another lane replays them with their numbers, then the lane goes on from
    there. With no lane for `--reattach-grace` (`run`), the Response is `cut`."""

    def __init__(self, kept: KeptEvents, *, grace_s: float) -> None:
        self.kept = kept
        kept.relay = self
        self.grace_s = grace_s
        #: The lane it streams to (its sink tells this relay of each event numbered).
        self.target: LaneSink | None = None
        #: Sent to the lane, not yet numbered by its writer, oldest first.
        self._unnumbered: collections.deque[ServerEvent] = collections.deque()
        self._lost_at = math.inf
        self._attaching = False
        #: The number the next event sent to a lane just attached takes: that lane's writer
        #: has numbered none of this Response's events when nothing was left to replay.
        self._resume_at: int | None = None
        #: The Response's sampling loop (set once it is begun).
        self.loop: SamplingLoop | None = None
        #: Cuts the Response short (set by whoever runs it).
        self.cut: Callable[[], None] = _nothing
        #: Set once the Response ended, or was cut.
        self.done = trio.Event()

    @property
    def stream_id(self) -> str | None:
        """The lane it streams to (None: the default lane, or none now)."""
        return self.target.stream_id if self.target is not None else None

    def let_go(self) -> None:
        """Its Response is over: hold nothing of it (its loop, its rollout)."""
        self.loop = None
        self.cut = _nothing

    # -- the sampling loop's sink ----------------------------------------------------------------

    async def send(self, event: ServerEvent) -> None:
        target = self.target
        if target is None:
            self._keep_here(event)
            return
        self._unnumbered.append(event)  # before: its writer may number it as it is handed over
        try:
            await target.channel.send(self._outgoing(target, event))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.lost(target)

    def send_nowait(self, event: ServerEvent) -> None:
        target = self.target
        if target is None:
            self._keep_here(event)
            return
        self._unnumbered.append(event)
        resume_at = self._resume_at
        try:
            target.channel.send_nowait(self._outgoing(target, event))
        except trio.WouldBlock:
            self._unnumbered.pop()
            self._resume_at = resume_at
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.lost(target)

    def _outgoing(self, target: LaneSink, event: ServerEvent) -> Outgoing:
        """`event` for `target`'s writer: numbered by it, but for the first after an attach
        (its lane goes on from the Response's numbers, not from its own)."""
        number, self._resume_at = self._resume_at, None
        return Outgoing(event, target.stream_id, number=number, kept=self)

    def keep(self, number: int, event: ServerEvent, nbytes: int, merged: int = 1) -> None:
        for _ in range(merged):
            if self._unnumbered:
                self._unnumbered.popleft()
        self.kept.keep(number, event, nbytes)

    def _keep_here(self, event: ServerEvent) -> None:
        number = self.kept.next
        self.kept.keep(number, event, kept_bytes(event, number))

    # -- lanes -----------------------------------------------------------------------------------

    def attach_now(self, sink: LaneSink) -> None:
        """Stream to `sink` from the first event (its Response's own lane)."""
        self.target = attrs.evolve(sink, kept=self)

    def lost(self, sink: LaneSink) -> None:
        """The connection of `sink` is gone (if this relay streams to it): keep what its
        writer never numbered, and start the grace."""
        if self.target is None or self.target.channel is not sink.channel:
            return
        self.target = None
        while self._unnumbered:
            self._keep_here(self._unnumbered.popleft())
        self._lost_at = trio.current_time()
        log.info("response.detached", extra={"response": self.kept.response_id})
        self.kept.touch()

    async def attach(self, sink: LaneSink, after: int) -> None:
        """Replay what is kept after `after` into `sink`, then stream the rest to it; refused
        if some of it is no longer kept, or the Response streams to a lane still."""
        if self.target is not None and not self._attaching:
            # a client that closed its connection and reattached at once may be ahead of the
            # server's noticing: its old connection's end is waited for, briefly
            with trio.move_on_after(HANDOVER_S):
                while self.target is not None:
                    await self.kept.changed()
        if self.target is not None or self._attaching:
            raise ProtocolError(
                "response_in_progress",
                f"Response {quoted(self.kept.response_id)} still streams to its connection "
                f"({HANDOVER_S:g} s after this reattach); reattach once that connection is "
                "closed.",
                param="response_id",
            )
        self.kept.after(after)
        self._attaching = True
        try:
            cursor = after
            while cursor < self.kept.next - 1:  # what comes meanwhile is kept, and replayed
                for kept in self.kept.after(cursor):
                    await sink.channel.send(
                        Outgoing(kept.event, sink.stream_id, number=kept.number)
                    )
                    cursor = kept.number
        finally:
            self._attaching = False
        # caught up, with no await since: the lane numbers the rest as its writer sends it, on
        # from the Response's numbers (said with the first when nothing was left to replay)
        self.target = attrs.evolve(sink, kept=self)
        self._resume_at = self.kept.next if cursor == after else None
        self._lost_at = math.inf
        self.kept.touch()
        log.info("response.reattached", extra={"response": self.kept.response_id, "after": after})

    async def run(self) -> None:
        """Cut the Response once no lane took it for the grace (one that ended: let go)."""
        while not (self.target is not None and self.kept.ended):
            deadline = self._lost_at + self.grace_s
            if trio.current_time() >= deadline:
                if not self.kept.ended:
                    log.info("response.reattach_lapsed", extra={"response": self.kept.response_id})
                    self.cut()
                return
            with trio.move_on_at(deadline):
                await self.kept.changed()


#: How long a reattach waits for the connection its Response still streams to to be seen gone
#: (the client's close and its reattach on a new connection may arrive in either order).
HANDOVER_S = 2.0


def _nothing() -> None:
    """A relay's `cut` before its Response runs, and after it ended."""
