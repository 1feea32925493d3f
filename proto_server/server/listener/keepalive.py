"""One HTTP connection's requests, served one after another (keep-alive): each an `Exchange`
(routes.py), a probe's alone past `--max-connections`, and a later request that asks for a
WebSocket handed back to the listener to upgrade."""

from __future__ import annotations

import h11
import trio

from proto_server.server.dialects.routes import Exchange
from proto_server.server.process.memory import MemoryBudget
from proto_server.server.rollouts.responses import Responses
from proto_server.server.store import StoreUnavailable
from proto_server.server.transport.handshake import RequestHead, later_head
from proto_server.server.transport.http import Shutdown, linger, next_request, send_error
from proto_server.wire.errors import ProtocolError


async def serve_http(
    responses: Responses, shutdown: Shutdown, stream: trio.abc.Stream, head: RequestHead
) -> RequestHead | None:
    """Serve requests on one keep-alive connection until the client is done, or idle for
    `handshake_timeout_s`; a malformed request is answered 400 and its connection closed.
    A later request that asks for a WebSocket is returned unanswered, for the caller to
    upgrade as it would a first one."""
    conn = head.connection
    request: h11.Request | None = head.request
    budget = responses.connection_budget()
    try:
        return await _serve_requests(responses, shutdown, stream, conn, request, budget)
    finally:
        budget.close()


#: The routes every connection may use, past `--max-connections` too: a liveness or readiness
#: probe answered 503 by a full server would have it restarted for being busy.
PROBES = frozenset({("GET", "/healthz"), ("GET", "/readyz")})


def is_probe(head: RequestHead) -> bool:
    route = (head.request.method.decode(), head.path.rstrip("/"))
    return not head.is_websocket and route in PROBES


async def serve_probe(
    responses: Responses, shutdown: Shutdown, stream: trio.abc.Stream, head: RequestHead
) -> None:
    """Answer one probe (`is_probe`) and nothing after it on this connection."""
    budget = responses.connection_budget()
    try:
        await Exchange(responses, shutdown, stream, head.connection, head.request, budget).serve()
    finally:
        budget.close()


async def _serve_requests(
    responses: Responses,
    shutdown: Shutdown,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    request: h11.Request | None,
    budget: MemoryBudget,
) -> RequestHead | None:
    while request is not None:
        if request.http_version not in (b"1.0", b"1.1"):  # h11 reads any `HTTP/d.d`
            version = request.http_version.decode()
            refusal = ProtocolError(
                "bad_request", f"HTTP/{version} is not spoken here; send HTTP/1.1."
            )
            await send_error(stream, refusal, conn)
            return None
        exchange = Exchange(responses, shutdown, stream, conn, request, budget)
        try:
            try:
                await exchange.serve()
            except (ProtocolError, StoreUnavailable) as exc:
                if conn.our_state is not h11.SEND_RESPONSE:
                    return None  # the answer had begun; nothing sensible can be said now
                await send_error(stream, exc, conn)
                if exc.status == 408:
                    return None  # it stalled; it will not send the rest
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                if conn.their_state is h11.SEND_BODY:
                    await linger(stream)  # so it reads the answer, not a reset
                return None
            if shutdown.stopped:
                return None
            request = None
            with shutdown.idle(responses.config.handshake_timeout_s):
                request = await next_request(stream, conn)
            if request is not None and (later := later_head(request, conn)).is_websocket:
                return later
        except h11.RemoteProtocolError as exc:
            if conn.our_state is h11.SEND_RESPONSE:
                refusal = ProtocolError("bad_request", f"Malformed HTTP request: {exc}.")
                await send_error(stream, refusal, conn)
            return None
    return None
