"""One WebSocket client: a reader, a writer, and the nursery its Responses live in.

    connection nursery
     ├─ writer: drains the bounded client channel into the socket, stamping sequence numbers
     ├─ reader (this task): frames -> decode -> the dialect; a bad frame becomes an `error` event
     └─ rollout nurseries, started by the dialect (see rollout.py)

When the peer goes away the nursery is cancelled, and every rollout under it with it.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from proto_server.core.sequence import Sequencer
from proto_server.server.logs import log
from proto_server.wire.converter import decode_client_event, encode_server_event
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ClientEvent, ErrorEvent, ServerEvent

_ids = itertools.count(1)


class Dialect(Protocol):
    """Turns client events into effects; raises `ProtocolError` and changes nothing if it can't."""

    def handle(self, event: ClientEvent) -> None: ...


class Connection:
    def __init__(self, ws: WebSocketConnection, *, queue_events: int) -> None:
        self.id = next(_ids)
        self.ws = ws
        self.sequencer = Sequencer()
        self.events, self._outbox = trio.open_memory_channel[ServerEvent](queue_events)

    async def run(self, nursery: trio.Nursery, dialect: Dialect) -> None:
        """Serve until the peer goes away; then cancel everything this connection started."""
        nursery.start_soon(self._write)
        try:
            await self._read(dialect)
        finally:
            nursery.cancel_scope.cancel()

    async def _read(self, dialect: Dialect) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            try:
                if isinstance(message, bytes):
                    raise ProtocolError(
                        "invalid_frame",
                        "Binary frames are not accepted; send each event as JSON in a text frame.",
                    )
                event = decode_client_event(message)
                log.debug("client.event", extra={"connection": self.id, "type": event.type})
                dialect.handle(event)
            except ProtocolError as exc:
                log.info(
                    "client.refused",
                    extra={
                        "connection": self.id,
                        "code": exc.detail.code,
                        "param": exc.detail.param,
                    },
                )
                await self.events.send(ErrorEvent(status=exc.status, error=exc.detail))

    async def _write(self) -> None:
        try:
            async with self._outbox:
                async for event in self._outbox:
                    await self.ws.send_message(encode_server_event(event, self.sequencer.next()))
        except ConnectionClosed:
            pass
        # Nothing more can reach this client: end the connection and all it started.
        await self.ws.aclose()
