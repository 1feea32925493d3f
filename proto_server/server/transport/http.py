"""HTTP/1.1 with h11 on the WebSocket port: reading a request, answering it, closing politely.

The plumbing every route stands on (routes.py): a request's head and body read within the
handshake deadline and the body limit, JSON and error answers, and a lingering close so a client
still sending reads its answer rather than a reset. `Shutdown` is how a stopping server tells
keep-alive connections to finish.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11
import orjson
import trio

from proto_server.server.process import metrics
from proto_server.server.store import (
    StoreUnavailable,
)
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError, ServerFault

if TYPE_CHECKING:
    pass

JSON = ("content-type", "application/json")
#: After answering a request whose body it will not read, the server drops at most this much of
#: what the client still sends, for at most this long, before it closes the connection.
LINGER_BYTES = 64 * 1024
LINGER_S = 1.0


def error_body(error: ProtocolError | ServerFault) -> bytes:
    """The body of an HTTP error (every one goes out through here, so it is counted here)."""
    metrics.ERRORS.labels(error.detail.code).inc()
    return orjson.dumps({"error": converter.unstructure(error.detail)})


def _body_is_read(conn: h11.Connection) -> bool:
    """Skip what of the request's body h11 already holds; whether that was all of it."""
    while conn.their_state is h11.SEND_BODY:
        if conn.next_event() is h11.NEED_DATA:
            return False
    return conn.their_state is h11.DONE


#: What a refusal with this status also says: the WebSocket version spoken, when to retry.
STATUS_HEADERS = {426: [("sec-websocket-version", "13")], 503: [("retry-after", "1")]}


async def send_error(
    stream: trio.abc.Stream,
    error: ProtocolError | StoreUnavailable,
    conn: h11.Connection | None = None,
) -> None:
    """Every HTTP refusal goes out here: a request's, on its exchange's h11 connection, and a
    handshake's (`conn` None: the head was never h11's, so a fresh one answers it)."""
    conn = h11.Connection(h11.SERVER) if conn is None else conn
    extra = STATUS_HEADERS.get(error.status, [])
    await send_json(stream, conn, error.status, error_body(error), extra=extra)


async def send_json(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    status: int,
    body: bytes,
    content_type: tuple[str, str] = JSON,
    *,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    """Answer with `body`; a request whose body is not read (refused before it, or too large)
    is answered `Connection: close` and its body is never read: that could be 100 GB."""
    headers = [content_type, ("content-length", str(len(body))), *(extra or [])]
    if not _body_is_read(conn):
        headers.append(("connection", "close"))
    reason = HTTPStatus(status).phrase.encode()
    response = h11.Response(status_code=status, headers=headers, reason=reason)
    await stream.send_all(conn.send(response) or b"")
    await stream.send_all(conn.send(h11.Data(data=body)) or b"")
    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")


async def linger(stream: trio.abc.Stream) -> None:
    """End our side, then drop a bounded amount of what the client still sends: closing a
    socket with unread bytes resets it, and a reset can destroy the answer on its way."""
    if isinstance(stream, trio.abc.HalfCloseableStream):
        await stream.send_eof()
    dropped = 0
    with trio.move_on_after(LINGER_S):
        while dropped < LINGER_BYTES:
            data = await stream.receive_some(LINGER_BYTES)
            if not data:
                return
            dropped += len(data)


async def _receive(stream: trio.abc.Stream, conn: h11.Connection, timeout_s: float) -> None:
    """Feed h11 the next bytes; a client that stalls longer than `timeout_s` is refused."""
    with trio.move_on_after(timeout_s):
        conn.receive_data(bytes(await stream.receive_some()))
        return
    raise ProtocolError(
        "request_timeout",
        f"The request stalled for {timeout_s:g} s; send it without pausing.",
        status=408,
    )


def _too_large(limit: int) -> ProtocolError:
    return ProtocolError(
        "message_too_large",
        f"The request body is over the limit of {limit} bytes (--max-message-bytes); "
        "send less, or continue a stored chain with previous_response_id.",
        status=413,
    )


async def read_body(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    limit: int,
    timeout_s: float,
    declared: int | None = None,
) -> bytes:
    """The body, up to `limit`; one `declared` (Content-Length) over it is refused unread."""
    if declared is not None and declared > limit:
        raise _too_large(limit)
    if conn.they_are_waiting_for_100_continue:  # only now: a refused request gets no 100
        go_on = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        await stream.send_all(conn.send(go_on) or b"")
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            await _receive(stream, conn, timeout_s)
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > limit:
                raise _too_large(limit)
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)
        else:
            raise ProtocolError("bad_request", "The request ended before its body did.")


async def next_request(stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
    """The next request on a kept-alive connection, or None when the client is done."""
    if not _body_is_read(conn):  # never read on: the answer said `Connection: close`
        return None
    try:
        conn.start_next_cycle()
    except h11.LocalProtocolError:
        return None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some()
            if not data:
                return None
            conn.receive_data(bytes(data))
        elif isinstance(event, h11.Request):
            return event
        else:
            return None


class Shutdown:
    """A server's stopping, as its HTTP connections see it: while it drains, `/readyz` answers
    503 and requests are still served; once it stops, a kept-alive connection ends after its
    answer, and one that waits idle for its next request ends at once."""

    def __init__(self) -> None:
        self.draining = False
        #: Set by `stop()`: when streaming segments must have finished (trio time).
        self.deadline: float | None = None
        self._idle: set[trio.CancelScope] = set()

    @property
    def stopped(self) -> bool:
        return self.deadline is not None

    def stop(self, deadline: float) -> None:
        self.deadline = deadline
        for idle in list(self._idle):
            idle.cancel()

    @contextmanager
    def idle(self, timeout_s: float) -> Iterator[None]:
        """Wait for a kept-alive connection's next request: at most `timeout_s`, and not past
        `stop()` (a stopping server does not wait for idle clients)."""
        with trio.move_on_after(timeout_s) as idle:
            self._idle.add(idle)
            try:
                yield
            finally:
                self._idle.discard(idle)
