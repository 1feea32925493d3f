"""A WebSocket client for tests: JSON in, JSON out, every wait bounded.

`connect_checked` runs every frame and event through a `StreamChecker` (or, for a connection
with lanes, a `LaneChecker`); `connect` gives the same client without one, for tests that send
what a checker would refuse. The client owns its TCP stream, so it can also play a client that
vanishes (`vanish()`) or that sends bytes no WebSocket library would (`send_raw()`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import orjson
import trio
from trio_websocket import WebSocketConnection, wrap_client_stream

from proto_server.testing.checker import (
    TERMINAL_EVENTS,
    Dialect,
    LaneChecker,
    StreamChecker,
    o200k_count,
)
from proto_server.testing.schema import WireSchema

#: What ends a segment from the client's side: a suspension, the Response's end, or an error.
SEGMENT_END = frozenset({"response.done", "error", *TERMINAL_EVENTS})
#: How long `receive` waits for one event before it says what it was waiting for.
EVENT_TIMEOUT_S = 10.0
#: How long a clean exit waits for the server's half of the close handshake.
CLOSE_TIMEOUT_S = 5.0
#: trio-websocket's own default; tests that send or echo more pass `max_message_size`.
MAX_MESSAGE_BYTES = 1024 * 1024


class EventTimeout(AssertionError):
    """No event came in time: the message says what the client waited for and what it had."""


class WireClient:
    def __init__(
        self,
        ws: WebSocketConnection,
        stream: trio.SocketStream,
        checker: StreamChecker | LaneChecker | None,
        event_timeout_s: float,
    ) -> None:
        self.ws = ws
        self.checker = checker
        self.event_timeout_s = event_timeout_s
        self.received: list[dict[str, Any]] = []
        self.vanished = False
        self._stream = stream

    async def send(self, frame: Mapping[str, Any] | str | bytes) -> None:
        """Send a JSON object as a text frame (or raw text or bytes, as they are)."""
        if self.checker is not None:
            self.checker.sent(frame)  # before it leaves: the server cannot answer any earlier
        data = frame if isinstance(frame, str | bytes) else orjson.dumps(frame).decode()
        await self.ws.send_message(data)

    async def send_raw(self, data: bytes) -> None:
        """Bytes straight onto the TCP stream, past the WebSocket layer (frames by hand)."""
        await self._stream.send_all(data)

    async def receive(self, *, waiting_for: str = "an event") -> dict[str, Any]:
        with trio.move_on_after(self.event_timeout_s) as waited:
            message = await self.ws.get_message()
        if waited.cancelled_caught:
            last = self.received[-1]["type"] if self.received else "none"
            raise EventTimeout(
                f"waited {self.event_timeout_s:g} s for {waiting_for}; had {len(self.received)} "
                f"events, the last {last}"
            )
        event: dict[str, Any] = orjson.loads(message)
        self.received.append(event)
        if self.checker is not None:
            self.checker.received(event)
        return event

    async def until(self, *types: str) -> list[dict[str, Any]]:
        """Events up to and including the first whose type is one of `types`."""
        waiting_for = " or ".join(types)
        events = []
        while True:
            event = await self.receive(waiting_for=waiting_for)
            events.append(event)
            if event["type"] in types:
                return events

    async def segment(self) -> list[dict[str, Any]]:
        """Events up to the end of a segment: a suspension, an end, or an error."""
        return await self.until(*sorted(SEGMENT_END))

    async def vanish(self) -> None:
        """Drop the TCP connection with no close frame, as a client that crashes would."""
        self.vanished = True
        await self._stream.aclose()


@asynccontextmanager
async def connect(
    url: str,
    *,
    headers: Sequence[tuple[str, str]] = (),
    event_timeout_s: float = EVENT_TIMEOUT_S,
    max_message_size: int = MAX_MESSAGE_BYTES,
    message_queue_size: int = 1,
    checker: StreamChecker | LaneChecker | None = None,
) -> AsyncIterator[WireClient]:
    """A `WireClient` on `url` (`ws://` only: tests run on loopback). `event_timeout_s` bounds each
    wait for an event."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or parts.hostname is None:
        raise ValueError(f"{url!r}: a test client connects to ws://host:port/... only")
    port = parts.port or 80
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    encoded = [(name.encode(), value.encode()) for name, value in headers]
    stream = await trio.open_tcp_stream(parts.hostname, port)
    try:
        async with stream, trio.open_nursery() as nursery:
            ws = await wrap_client_stream(
                nursery,
                stream,
                f"{parts.hostname}:{port}",
                resource,
                extra_headers=encoded,
                max_message_size=max_message_size,
                message_queue_size=message_queue_size,
            )
            client = WireClient(ws, stream, checker, event_timeout_s)
            try:
                yield client
            finally:
                if not client.vanished:
                    with trio.move_on_after(CLOSE_TIMEOUT_S):
                        await ws.aclose()
                nursery.cancel_scope.cancel()  # the reader, parked or not
    except BaseExceptionGroup as group:
        # the nursery wraps what the test or the handshake raised: hand back that one error
        leaves = [leaf for leaf in _leaves(group) if not isinstance(leaf, trio.Cancelled)]
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exception in group.exceptions:
        if isinstance(exception, BaseExceptionGroup):
            found.extend(_leaves(exception))
        else:
            found.append(exception)
    return found


@asynccontextmanager
async def connect_checked(
    url: str,
    *,
    dialect: Dialect = "prototype",
    count_tokens: Callable[[str], int] | None = o200k_count,
    headers: Sequence[tuple[str, str]] = (),
    schema: WireSchema | None = None,
    lanes: bool = False,
    event_timeout_s: float = EVENT_TIMEOUT_S,
    max_message_size: int = MAX_MESSAGE_BYTES,
) -> AsyncIterator[WireClient]:
    """Connect to `url`; on a clean exit the checker's `finish()` runs (every frame answered,
    unless the server closed the connection or the client vanished).

    `count_tokens=None` skips the exact `output_tokens` check (for servers with another
    tokenizer); `schema` (`wire_schema()`) checks every event against the published schema;
    `lanes`: check each `stream_id` on its own (`LaneChecker`).
    """
    checker: StreamChecker | LaneChecker
    if lanes:
        checker = LaneChecker(dialect=dialect, count_tokens=count_tokens, schema=schema)
    else:
        checker = StreamChecker(dialect=dialect, count_tokens=count_tokens, schema=schema)
    async with connect(
        url,
        headers=headers,
        event_timeout_s=event_timeout_s,
        max_message_size=max_message_size,
        checker=checker,
    ) as client:
        yield client
        # a connection the server closed may have left frames unread: that is no violation
        checker.finish(closed=client.vanished or client.ws.closed is not None)


__all__ = ["EventTimeout", "WireClient", "connect", "connect_checked"]
