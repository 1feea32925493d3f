"""One WebSocket client: a reader, a writer, and the nursery its Responses live in.

    connection nursery
     ├─ writer: drains the bounded client channel into the socket (writer.py), stamping each
    │  event with its lane's `stream_id` and the lane's next sequence number
     ├─ reader (this task): frames -> decode -> the dialect; a bad frame becomes an `error` event,
    │  and so does a store that fails a lookup the frame needs (`store_unavailable`)
     └─ what the dialect starts: rollout nurseries (sampling.py), the launched dialect's turns

When the peer goes away the nursery is cancelled, and every rollout under it with it. When the
connection reaches its lifetime limit, it stops reading, lets what is streaming finish, says
`websocket_connection_limit_reached`, and closes cleanly. When its client takes no bytes for
`--send-timeout`, it stops reading, ends every open Response `incomplete` (`slow_reader`: stored
so, counted so, sent to no one) and closes with 1008.
"""

from __future__ import annotations

import itertools
from typing import ClassVar, Protocol

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.process.memory import MemoryBudget, preparing_bytes
from proto_server.server.process.observe import ServerObserver
from proto_server.server.process.offload import Offload
from proto_server.server.store import StoreUnavailable
from proto_server.server.transport.outbox import LaneSink, Outbox, Outgoing
from proto_server.server.transport.sendtimeout import SLOW_READER, SendTimeout
from proto_server.server.transport.writer import EventBound, discard_events, write_events
from proto_server.server.transport.wsframes import FrameWriter, close_stalled
from proto_server.wire.converter import decode_client_event
from proto_server.wire.errors import ErrorDetail, ProtocolError, on_lane
from proto_server.wire.events import (
    ClientEvent,
    ErrorEvent,
    ResponseInject,
    ResponseSteer,
    ServerEvent,
)

_ids = itertools.count(1)

#: `incomplete_details.reason` of the Responses a stopping server ends.
SERVER_SHUTDOWN = "server_shutdown"
SHUTDOWN_CLOSE_REASON = "server shutting down; reconnect and resend the conversation"
#: How long a stopping server waits for a client to take its last events and the close frame.
CLOSE_WAIT_S = 2.0
#: The close code of a client cut for `--send-timeout` (its Responses end `SLOW_READER`):
#: policy violation (RFC 6455 7.4.1), the client broke the server's rule; not 1013 (try again
#: later), which would tell it that the server was the one too busy.
SLOW_READER_CODE = 1008


class Dialect(Protocol):
    """Turns client events into effects; raises `ProtocolError` (or `StoreUnavailable`, a store
    lookup failed) and changes nothing if it can't.

    `handle` may await the event's preparation (rendering a large input off the event loop):
    meanwhile this connection reads no further frame, and every other connection goes on."""

    async def handle(self, event: ClientEvent, frame_bytes: int) -> None: ...

    async def drain(self) -> None:
        """Accept nothing new; return once nothing is streaming."""
        ...

    async def expire(self, reason: str) -> None:
        """End every open Response with `response.incomplete` (`reason`), cutting what still
        streams; return once their terminal events are handed to the connection."""
        ...

    async def aclose(self) -> None:
        """The connection ended: let go of what outlives a Response (warm rollouts)."""
        ...


class ClientLanes(Protocol):
    """What a dialect uses of its connection: where each lane's events go, and the budget its
    Responses and waiting requests are charged to. A `Connection`, or, in a test, a channel
    with no socket behind it."""

    budget: MemoryBudget

    def lane(self, stream_id: str | None) -> LaneSink: ...


class Connection:
    def __init__(
        self,
        ws: WebSocketConnection,
        *,
        budget: MemoryBudget,
        offload: Offload,
        queue_events: int,
        merge_deltas: bool = True,
        observer: ServerObserver | None = None,
        dialect: str = "launched",
        compressed: bool = False,
        bound: EventBound | None = None,
    ) -> None:
        self.id = next(_ids)
        #: How the metrics name this connection's Responses.
        self.dialect = dialect
        self.ws = ws
        #: permessage-deflate was negotiated: the writer lets wsproto frame (and compress).
        self._compressed = compressed
        #: `--max-event-bytes`, as this connection's dialect allows it to be kept.
        self._bound = bound
        #: What the server keeps for this connection (its rollouts, its queued requests).
        self.budget = budget
        self._offload = offload
        self._merge_deltas = merge_deltas
        self._observer = observer
        self._channel, self._outbox = trio.open_memory_channel[Outgoing](queue_events)
        #: The default lane: connection-level errors and the Responses of creates without one.
        self.events = LaneSink(self._channel, connection=self.id)
        self._written = trio.Event()
        self._reading = trio.CancelScope()
        self._shutdown_deadline: float | None = None
        #: Set when a write made no progress for `--send-timeout`: nothing more is written.
        self._stalled: SendTimeout | None = None

    def lane(self, stream_id: str | None) -> LaneSink:
        """Where the events of lane `stream_id` go: one writer, numbered per lane.

        Per lane, not per connection: the SDK's session helper hands each lane's consumer only
        that lane's events, so only a per-lane count lets it see that none is missing; a
        connection with only the default lane numbers exactly as before lanes existed."""
        if stream_id is None:
            return self.events
        return LaneSink(self._channel, stream_id, connection=self.id)

    async def run(self, nursery: trio.Nursery, dialect: Dialect, *, lifetime_s: float) -> None:
        """Serve until the peer goes away or the lifetime ends; then cancel all it started."""
        nursery.start_soon(self._write)
        try:
            with trio.move_on_after(lifetime_s), self._reading:
                await self._read(dialect)
                return  # the peer went away
            if self._stalled is not None:
                await self._cut(dialect, self._stalled)
            elif self._shutdown_deadline is not None:
                await self._shut_down(dialect, self._shutdown_deadline)
            else:
                await self._retire(dialect, lifetime_s)
        finally:
            nursery.cancel_scope.cancel()
            self.budget.close()  # what is still counted goes with the connection

    def shut_down(self, deadline: float) -> None:
        """The server is stopping: read no more frames, let what streams finish until
        `deadline`, end the rest with `response.incomplete`, then close with 1001."""
        self._shutdown_deadline = deadline
        self._reading.cancel()

    async def _shut_down(self, dialect: Dialect, deadline: float) -> None:
        log.info("connection.shutting_down", extra={"connection": self.id})
        with trio.move_on_at(deadline):
            await dialect.drain()
        await dialect.expire(SERVER_SHUTDOWN)
        self._channel.close()
        # a client that stopped reading cannot hold the server's exit hostage
        with trio.move_on_after(CLOSE_WAIT_S):
            await self._written.wait()
            await self._close(1001, SHUTDOWN_CLOSE_REASON)

    async def _cut(self, dialect: Dialect, stall: SendTimeout) -> None:
        """The client took no bytes for `--send-timeout`: its Responses end `incomplete`
        (`slow_reader`) and release their rollouts, and the connection closes with 1008."""
        log.warning(
            "connection.slow_reader",
            extra={"connection": self.id, "timeout_s": stall.timeout_s,
                   "unsent_bytes": len(stall.unsent)},
        )  # fmt: skip
        metrics.SEND_TIMEOUTS.labels("websocket").inc()
        await dialect.expire(SLOW_READER)
        self._channel.close()
        await self._written.wait()
        await self._close(SLOW_READER_CODE, "")

    async def _close(self, code: int, reason: str) -> None:
        """Close with `code`; after a stalled write, the way `close_stalled` does."""
        stall = self._stalled
        if stall is None:
            await self.ws.aclose(code=code, reason=reason)
            return
        why = f"send timeout: the client took no bytes for {stall.timeout_s:g} s (--send-timeout)"
        await close_stalled(
            self.ws, stall.unsent, code=SLOW_READER_CODE, reason=why, wait_s=CLOSE_WAIT_S
        )

    async def _read(self, dialect: Dialect) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            if self._observer is not None:
                self._observer.received()
            try:
                if isinstance(message, bytes):
                    raise ProtocolError(
                        "invalid_frame",
                        "Binary frames are not accepted; send each event as JSON in a text frame.",
                    )
                await self._dispatch(dialect, message)
            except ProtocolError as exc:
                await self.lane(exc.stream_id).refuse(exc)
            finally:
                del message  # waiting for the next frame, an idle connection keeps no old one

    async def _dispatch(self, dialect: Dialect, message: str) -> None:
        """Decode one frame and hand it to the dialect. While it is decoded, the process budget
        holds the peak memory a frame of this size may take; what it becomes is charged after
        (its rollout, its place in a queue)."""
        size = len(message)
        process = self.budget.parent or self.budget
        with process.reserve(preparing_bytes(message), "This frame"):
            event = await self._offload.run(decode_client_event, message, size=size)
        if self._observer is not None:
            self._observer.decoded()
        log.debug("client.event", extra={"connection": self.id, "type": event.type})
        # refused on the lane the frame named (an inject or a steer names the lane of the
        # Response it targets itself)
        lane = None if isinstance(event, ResponseInject | ResponseSteer) else event.stream_id
        try:
            with on_lane(lane):
                await dialect.handle(event, size)
        except StoreUnavailable as exc:
            # a lookup the frame needed (the suspension it resumes, an item it references):
            # the server's fault, refused as the launched dialect's lanes refuse it, and the
            # connection, its other lanes and their Responses live on
            await self.lane(lane).refuse(exc)

    async def _retire(self, dialect: Dialect, lifetime_s: float) -> None:
        log.info("connection.lifetime_reached", extra={"connection": self.id})
        await dialect.drain()
        message = (
            f"This connection reached its lifetime limit of {lifetime_s:g} s. Open a new "
            "connection and continue there (resend the history, or chain with "
            "previous_response_id from a store: true response)."
        )
        detail = ErrorDetail(
            type="invalid_request_error", code="websocket_connection_limit_reached", message=message
        )
        await self.events.send(ErrorEvent(status=400, error=detail))
        self._channel.close()
        await self._written.wait()
        await self._close(1000, "connection lifetime limit reached")

    async def _write(self) -> None:
        """The one writer (`writer.py`), each event a text frame and each batch one socket write."""
        outbox = Outbox(self._outbox, merge=self._merge_deltas)
        frames = WebSocketTransport(FrameWriter(self.ws, compressed=self._compressed))
        try:
            async with self._outbox:
                try:
                    await write_events(
                        outbox,
                        frames,
                        dialect=self.dialect,
                        observer=self._observer,
                        offload=self._offload,
                        bound=self._bound,
                    )
                except SendTimeout as stall:
                    self._stalled = stall
                    self._reading.cancel()  # `run` goes on to `_cut`
                    await discard_events(outbox, dialect=self.dialect)
        except ConnectionClosed:
            # Nothing more can reach this client: end the connection and all it started.
            await self.ws.aclose()
        finally:
            self._written.set()


@attrs.define
class WebSocketTransport:
    """Events as WebSocket text frames, framed together (`wsframes`); `/metrics` counts each
    event's JSON."""

    frames: FrameWriter
    name: ClassVar[str] = "websocket"

    def add(self, event: ServerEvent, payload: bytes) -> int:
        self.frames.add(payload)
        return len(payload)

    async def flush(self) -> None:
        await self.frames.flush()
