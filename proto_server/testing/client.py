"""A WebSocket client that runs every frame and event through a `StreamChecker` (or, for a
connection with lanes, a `LaneChecker`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import orjson
from trio_websocket import WebSocketConnection, open_websocket_url

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


class CheckedClient:
    def __init__(self, ws: WebSocketConnection, checker: StreamChecker | LaneChecker) -> None:
        self.ws = ws
        self.checker = checker
        self.received: list[dict[str, Any]] = []

    async def send(self, frame: Mapping[str, Any] | str | bytes) -> None:
        """Send a JSON object as a text frame (or raw text or bytes, as they are)."""
        self.checker.sent(frame)  # before it leaves: the server cannot answer any earlier
        data = frame if isinstance(frame, str | bytes) else orjson.dumps(frame).decode()
        await self.ws.send_message(data)

    async def receive(self) -> dict[str, Any]:
        event: dict[str, Any] = orjson.loads(await self.ws.get_message())
        self.received.append(event)
        self.checker.received(event)
        return event

    async def until(self, *types: str) -> list[dict[str, Any]]:
        """Events up to and including the first whose type is one of `types`."""
        events = []
        while True:
            event = await self.receive()
            events.append(event)
            if event["type"] in types:
                return events

    async def segment(self) -> list[dict[str, Any]]:
        """Events up to the end of a segment: a suspension, an end, or an error."""
        return await self.until(*SEGMENT_END)


@asynccontextmanager
async def connect_checked(
    url: str,
    *,
    dialect: Dialect = "prototype",
    count_tokens: Callable[[str], int] | None = o200k_count,
    headers: Sequence[tuple[str, str]] = (),
    schema: WireSchema | None = None,
    lanes: bool = False,
    **options: Any,
) -> AsyncIterator[CheckedClient]:
    """Connect to `url`; on a clean exit the checker's `finish()` runs (every frame answered,
    unless the server closed the connection).

    `count_tokens=None` skips the exact `output_tokens` check (for servers with another
    tokenizer); `schema` (`wire_schema()`) checks every event against the published schema;
    `lanes`: check each `stream_id` on its own (`LaneChecker`); `options` go to
    trio-websocket's `open_websocket_url`.
    """
    checker: StreamChecker | LaneChecker
    if lanes:
        checker = LaneChecker(dialect=dialect, count_tokens=count_tokens, schema=schema)
    else:
        checker = StreamChecker(dialect=dialect, count_tokens=count_tokens, schema=schema)
    encoded = [(name.encode(), value.encode()) for name, value in headers]
    async with open_websocket_url(url, extra_headers=encoded, **options) as ws:
        client = CheckedClient(ws, checker)
        yield client
        # a connection the server closed may have left frames unread: that is no violation
        checker.finish(closed=ws.closed is not None)
