"""A connection past `--max-connections`: answered 503 `server_busy` and closed, unless it is
a health probe. A liveness probe that a full server refused would have an orchestrator restart
it for being busy, so up to `--probe-connections` such connections have their request head
read (`PROBE_WAIT_S`, `PROBE_HEAD_BYTES`) and a `GET /healthz` or `/readyz` is answered. One
more makes the longest-waiting of them give up its place (it is answered 503): a probe sends
its head at once, so a flood of connections that send nothing cannot hold every place."""

from __future__ import annotations

import collections
import contextlib

import trio

from proto_server.server.listener.keepalive import is_probe, serve_probe
from proto_server.server.process.logs import log
from proto_server.server.rollouts.responses import Responses
from proto_server.server.transport.handshake import BadRequestHead, read_request_head
from proto_server.server.transport.http import LINGER_S, Shutdown, linger, send_error
from proto_server.wire.errors import ProtocolError

#: What a connection past `--max-connections` may take to show it is a health probe.
PROBE_WAIT_S = 1.0
PROBE_HEAD_BYTES = 4096


class Overflow:
    """Turns away the connections a full server does not count as open."""

    def __init__(self, responses: Responses, shutdown: Shutdown) -> None:
        self._responses = responses
        self._shutdown = shutdown
        #: The head reads of the connections that may be probes, the longest-waiting first.
        self._reading: collections.deque[trio.CancelScope] = collections.deque()

    async def turn_away(self, stream: trio.SocketStream) -> None:
        """Answer the health probe it sends (`_answer_probe`), or 503; then close it (it is
        never counted as open)."""
        limit = self._responses.config.max_connections
        busy = ProtocolError(
            "server_busy",
            f"The server has reached its limit of {limit:,} open connections "
            "(--max-connections); retry later.",
            status=503,
            error_type="server_error",
        )
        probing = self._responses.config.probe_connections > 0
        log.info("connection.refused", extra={"limit": limit, "probe": probing})
        try:
            if probing and await self._answer_probe(stream):
                return
            with trio.move_on_after(2 * LINGER_S):  # a client that does not read cannot stay
                await send_error(stream, busy)
                await linger(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _answer_probe(self, stream: trio.SocketStream) -> bool:
        """Answer the connection's request if it is a health probe; whether it was one."""
        head = None
        if len(self._reading) >= self._responses.config.probe_connections:
            self._reading.popleft().cancel()  # the longest-waiting gives its place up
        reading = trio.CancelScope(deadline=trio.current_time() + PROBE_WAIT_S)
        self._reading.append(reading)
        try:
            with reading, contextlib.suppress(BadRequestHead):
                head = await read_request_head(stream, max_bytes=PROBE_HEAD_BYTES)
        finally:
            if reading in self._reading:
                self._reading.remove(reading)
        if head is None or not is_probe(head):
            return False
        with trio.move_on_after(2 * LINGER_S):
            await serve_probe(self._responses, self._shutdown, stream, head)
        return True
