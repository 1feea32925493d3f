"""Talking to a server: the one test client with headers as keywords (and its patience for
a real model), a turn, a lane's events, a checked client, SSE, blocking clients on a thread,
and reading what came back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import httpx
import orjson
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from proto_server.testing.checker import LaneChecker
from proto_server.testing.client import EVENT_TIMEOUT_S, MAX_MESSAGE_BYTES, WireClient
from proto_server.testing.client import connect as client_connect

T = TypeVar("T")


END = ("response.completed", "response.failed", "response.incomplete", "error")


TERMINAL = {"response.completed", "response.failed", "response.incomplete", "response.cancelled"}


@asynccontextmanager
async def connect(
    url: str,
    *,
    max_message_size: int = MAX_MESSAGE_BYTES,
    event_timeout_s: float = EVENT_TIMEOUT_S,
    **headers: str,
) -> AsyncIterator[WireClient]:
    """The one test client (`proto_server.testing.client`), unchecked, headers as keywords."""
    async with client_connect(
        url,
        headers=list(headers.items()),
        max_message_size=max_message_size,
        event_timeout_s=event_timeout_s,
    ) as client:
        yield client


#: How long a test waits for one event from a real model (vLLM on CPU, the local model): a
#: first token may wait for a grammar's compile and a prefill on a machine shared with others
#: (10 s was met on a loaded 2-core machine). It guards against a hang; it measures nothing.
MODEL_EVENT_TIMEOUT_S = 60.0


#: `connect` for tests of a real model.
model_connect = partial(connect, event_timeout_s=MODEL_EVENT_TIMEOUT_S)


async def turn(client: WireClient, frame: dict[str, Any]) -> list[dict[str, Any]]:
    await client.send(frame)
    return await client.until(*END)


async def until_lane(client: WireClient, lane: str | None, *kinds: str) -> list[dict[str, Any]]:
    """Everything received up to the first event of one of `kinds` on `lane`."""
    events = []
    while True:
        event = await client.receive()
        events.append(event)
        if event.get("stream_id") == lane and event["type"] in kinds:
            return events


class Checked:
    """A client whose every frame and event goes through a `LaneChecker`."""

    def __init__(self, client: WireClient, dialect: str = "launched") -> None:
        self.client = client
        self.checker = LaneChecker(dialect=dialect)  # type: ignore[arg-type]

    async def send(self, frame: dict[str, Any]) -> None:
        self.checker.sent(frame)
        await self.client.send(frame)

    async def until_lane(self, lane: str | None, *kinds: str) -> list[dict[str, Any]]:
        events = await until_lane(self.client, lane, *kinds)
        for event in events:
            self.checker.received(event)
        return events


BETA = {"OpenAI-Beta": "responses_multi_agent=v1"}


async def read_all(client: WireClient) -> None:
    try:
        while True:
            await client.receive()
    except ConnectionClosed:
        pass


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (a blocking or asyncio client: the openai SDKs) on a worker thread that the
    test's deadline abandons: a client that never returns fails the test instead of hanging
    it (trio cannot cancel a thread, and would wait for it)."""
    return await trio.to_thread.run_sync(partial(fn, *args), abandon_on_cancel=True)


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = orjson.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        events.append(event)
    return events


async def sse(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", url, json={**payload, "stream": True}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        text = "".join([chunk async for chunk in answer.aiter_text()])
    assert "\r" not in text
    return parse_sse(text)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"].removeprefix("response.") for event in events]


def collapse(names: list[str]) -> list[str]:
    """Runs of the same delta type as one `name*`, so orders read like the protocol's grammar."""
    out: list[str] = []
    for name in names:
        starred = f"{name}*"
        if name.endswith(".delta"):
            if out and out[-1] == starred:
                continue
            out.append(starred)
        else:
            out.append(name)
    return out


async def resumed_elsewhere(
    running: Any, frame: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Create a prototype Response with `frame`, leave at its suspension without a word, then
    answer its calls from a new connection (a resume from the store): what each connection saw,
    the first up to `response.done`, the second up to `response.completed`."""
    from .frames import answers

    async with connect(running.prototype_url) as client:
        await client.send(frame)
        first = await client.until("response.done")
        await client.vanish()
    await running.server.wait_idle()
    response_id = first[-1]["response"]["id"]
    async with connect(running.prototype_url) as client:
        append = {"type": "response.append", "response_id": response_id, "input": answers(first)}
        await client.send(append)
        rest = await client.until("response.completed")
    return first, rest
