"""A bare WebSocket test client: JSON in, JSON out, nothing hidden.

To play a client that vanishes, tests close its TCP stream (`client.ws._stream.aclose()`) and
then cancel the `async with` around the connection: trio-websocket's reader may be parked on
its full message queue (size 1 by default) and never see the stream go, so a normal exit would
wait `disconnect_timeout` (60 s) for a close handshake that cannot happen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "response.cancelled"}


class Client:
    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.received: list[dict[str, Any]] = []

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_message(orjson.dumps(event).decode())

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(10):
            event: dict[str, Any] = orjson.loads(await self.ws.get_message())
        self.received.append(event)
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
        return await self.until("response.done", "error", *TERMINAL)


@asynccontextmanager
async def connect(
    url: str, *, max_message_size: int = 1024 * 1024, **headers: str
) -> AsyncIterator[Client]:
    async with open_websocket_url(
        url, extra_headers=list(headers.items()), max_message_size=max_message_size
    ) as ws:
        yield Client(ws)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"].removeprefix("response.") for event in events]
