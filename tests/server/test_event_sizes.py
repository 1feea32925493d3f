"""The largest frame of a long rollout, on every transport, against `--max-event-bytes`.

A 50-turn rollout whose model writes what an agent's does each turn (a 20 KB patch, 3 KB of
reasoning, 1 KB of text) and whose tools answer with 8 KB of log: the prototype dialect's
snapshots carry every turn's output, so its last ones pass 1 MiB, where Python `websockets`
stops reading by default; the launched dialect's and SSE's carry one turn's. Real clients read
it: `websockets` 15 with its default `max_size`, and openai-python.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import trio
from openai import OpenAI
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from proto_server.testing.checker import LaneChecker

from ..support.clients import in_thread, parse_sse
from ..support.frames import USER
from ..support.metrics import scrape, value
from ..support.servers import StartServer

pytestmark = pytest.mark.deadline(240)

TURNS = 50
#: What Python `websockets` reads by default (its `max_size`), and the server's default bound.
DEFAULT_MAX_SIZE = 2**20

APPLY_PATCH = {
    "type": "function",
    "name": "apply_patch",
    "description": "Apply a patch to the repository.",
    "parameters": {
        "type": "object",
        "properties": {"patch": {"type": "string"}},
        "required": ["patch"],
    },
    "strict": False,
}


def patch(turn: int) -> str:
    """About 20 KB of a unified patch, quotes and newlines that JSON escapes included."""
    lines = [f"*** Begin Patch\n*** Update File: src/module_{turn}.py\n@@ def compute\n"]
    line = 0
    while sum(map(len, lines)) < 20_000:
        lines.append(
            f'-    total += weigh("item_{turn}_{line}", values[{line}])\n'
            f'+    total += weigh("item_{turn}_{line}", values[{line}], strict=True)\n'
        )
        line += 1
    return "".join([*lines, "*** End Patch\n"])


def long_script(turns: int = TURNS) -> dict[str, Any]:
    segments: list[dict[str, Any]] = [
        {
            "reasoning": f"Turn {turn}: the failing test points at module {turn}. " * 50,
            "text": f"Patching module {turn} so that weigh() is strict. " * 20,
            "tool_calls": [{"name": "apply_patch", "arguments": {"patch": patch(turn)}}],
        }
        for turn in range(turns - 1)
    ]
    return {"segments": [*segments, {"text": "Every module is patched; the tests pass."}]}


def tool_log(call_id: str) -> str:
    """8 KB of what a test run prints."""
    return "".join(f"tests/test_{call_id[-6:]}.py::case_{n} PASSED\n" for n in range(200))[:8192]


def outputs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": e["item"]["call_id"],
         "output": tool_log(e["item"]["call_id"])}
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]  # fmt: skip


def create(**fields: Any) -> dict[str, Any]:
    return {"model": "test-model", "instructions": "You fix bugs.", "input": [USER],
            "tools": [APPLY_PATCH], **fields}  # fmt: skip


class Recorded:
    """A `websockets` client's rollout: every frame it sent and every event it read, in order,
    and the size of the largest event in bytes."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.largest = 0

    def send(self, frame: dict[str, Any]) -> None:
        self.log.append(("sent", frame))
        self.ws.send(orjson.dumps(frame).decode())

    def until(self, *kinds: str) -> list[dict[str, Any]]:
        events = []
        while True:
            message = self.ws.recv()
            size = len(message.encode() if isinstance(message, str) else message)
            self.largest = max(self.largest, size)
            event = orjson.loads(message)
            self.log.append(("received", event))
            events.append(event)
            if event["type"] in (*kinds, "error", "response.failed"):
                return events

    def events(self) -> Iterator[dict[str, Any]]:
        return (event for kind, event in self.log if kind == "received")

    def check(self, dialect: str) -> None:
        checker = LaneChecker(dialect=dialect)  # type: ignore[arg-type]
        for kind, message in self.log:
            checker.sent(message) if kind == "sent" else checker.received(message)
        checker.finish()


def prototype_rollout(url: str) -> Recorded:
    """One Response, a segment a turn, read with the default `max_size`: create, then an append
    answering each `response.done`."""
    with ws_connect(url) as ws:
        assert ws.protocol.max_size == DEFAULT_MAX_SIZE
        client = Recorded(ws)
        client.send({"type": "response.create", **create()})
        while True:
            events = client.until("response.done", "response.completed")
            if events[-1]["type"] != "response.done":
                return client
            client.send({"type": "response.append", "input": outputs(events)})


def launched_rollout(url: str) -> Recorded:
    """50 Responses chained by `previous_response_id` on one connection, default `max_size`."""
    with ws_connect(url) as ws:
        assert ws.protocol.max_size == DEFAULT_MAX_SIZE
        client = Recorded(ws)
        frame = {"type": "response.create", **create(store=False)}
        for _ in range(TURNS):
            client.send(frame)
            events = client.until("response.completed")
            previous = events[-1]["response"]["id"]
            chained = create(store=False, previous_response_id=previous, input=outputs(events))
            frame = {"type": "response.create", **chained}
        return client


def items_done(events: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e["type"] == "response.output_item.done"]


@pytest.mark.parametrize(
    ("turns", "bound"),
    [
        pytest.param(TURNS, DEFAULT_MAX_SIZE, marks=pytest.mark.slow, id="50 turns, default"),
        pytest.param(5, 64 * 1024, id="5 turns, 64 KiB"),
    ],
)
async def test_prototype_snapshots_stay_under_the_bound(
    start_server: StartServer, turns: int, bound: int
) -> None:
    running = await start_server(long_script(turns), max_event_bytes=bound)
    before = await large_events("prototype", "output_omitted", running.address.http_url)
    rollout = await in_thread(prototype_rollout, running.prototype_url)
    assert rollout.largest <= bound
    rollout.check("prototype")
    events = list(rollout.events())
    assert events[-1]["type"] == "response.completed"
    assert len(items_done(iter(events))) == 3 * (turns - 1) + 1
    # Each snapshot carries every item so far unless that would pass the bound; then none,
    # its items having all come one by one. Whole, the last passes what a client reads.
    snapshots = [(event, items_done(iter(events[:at])))
                 for at, event in enumerate(events) if "response" in event]  # fmt: skip
    whole = [len(orjson.dumps(with_output(event, done))) for event, done in snapshots]
    omitted = [bool(done) and not event["response"]["output"] for event, done in snapshots]
    assert omitted == [size > bound for size in whole]
    assert max(whole) > bound
    assert events[-1]["response"]["output"] == []
    assert events[-1]["response"]["usage"]["output_tokens"] > 0
    after = await large_events("prototype", "output_omitted", running.address.http_url)
    assert after - before == sum(omitted)


def with_output(event: dict[str, Any], output: list[dict[str, Any]]) -> dict[str, Any]:
    """`event` with its Response's output as the items done before it."""
    return {**event, "response": {**event["response"], "output": output}}


async def large_events(dialect: str, action: str, http_url: str) -> float:
    """`proto_server_large_events_total` of the WebSocket `dialect` for `action`."""
    async with httpx.AsyncClient() as http:
        samples = await scrape(http, http_url.removesuffix("/v1"))
    return value(samples, "proto_server_large_events_total", dialect=dialect,
                 transport="websocket", action=action)  # fmt: skip


@pytest.mark.slow
async def test_launched_turns_carry_one_turn_each(start_server: StartServer) -> None:
    running = await start_server(long_script())
    rollout = await in_thread(launched_rollout, running.address.ws_url)
    assert rollout.largest < 64 * 1024  # one turn's output, and the echoed tools
    rollout.check("launched")
    completed = [e for e in rollout.events() if e["type"] == "response.completed"]
    assert len(completed) == TURNS
    # the launched dialect never leaves output out: its clients read it there
    assert all(len(e["response"]["output"]) == 3 for e in completed[:-1])


@pytest.mark.slow
async def test_sse_events_of_a_long_rollout(start_server: StartServer) -> None:
    running = await start_server(long_script())
    url = f"{running.address.http_url}/responses"
    largest, previous, new = 0, None, [USER]
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(TURNS):
            payload = create(previous_response_id=previous, input=new, store=True, stream=True)
            async with http.stream("POST", url, json=payload) as answer:
                text = "".join([chunk async for chunk in answer.aiter_text()])
            blocks = [b for b in text.split("\n\n") if b]
            largest = max(largest, *(len(b.encode()) for b in blocks))
            events = parse_sse(text)
            assert events[-1]["type"] == "response.completed"
            previous, new = events[-1]["response"]["id"], outputs(events)
    assert largest < 64 * 1024


def openai_rollout(http_url: str) -> list[Any]:
    """openai-python over the launched WebSocket, capped at websockets' default max_size, then
    its streaming helper over HTTP for the last turn: each turn's final Response."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    finals: list[Any] = []
    previous: str | None = None
    new: list[Any] = [USER]
    options = {"max_size": DEFAULT_MAX_SIZE}
    with client.responses.connect(websocket_connection_options=options) as connection:  # type: ignore[arg-type]
        for _ in range(TURNS - 1):
            connection.response.create(**create(store=True, previous_response_id=previous,
                                                input=new))  # fmt: skip
            for event in connection:
                if event.type == "response.completed":
                    finals.append(event.response)
                    break
            previous = finals[-1].id
            new = [
                {"type": "function_call_output", "call_id": item.call_id,
                 "output": tool_log(item.call_id)}
                for item in finals[-1].output if item.type == "function_call"
            ]  # fmt: skip
    with client.responses.stream(**create(previous_response_id=previous, input=new)) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
        final = stream.get_final_response()
    assert [item.id for item in final.output] == [item.id for item in done]
    return [*finals, final]


@pytest.mark.slow
async def test_openai_python_reads_every_final_response(start_server: StartServer) -> None:
    running = await start_server(long_script())
    with trio.fail_after(180):
        finals = await in_thread(openai_rollout, running.address.http_url)
    assert len(finals) == TURNS
    for turn, response in enumerate(finals[:-1]):
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message", "function_call"]
        assert orjson.loads(response.output[2].arguments) == {"patch": patch(turn)}
    assert finals[-1].output_text == "Every module is patched; the tests pass."


async def test_an_event_over_the_bound_elsewhere_is_sent_whole(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    # the least bound there may be (64 KiB), and instructions over it, which every snapshot
    # echoes: the launched dialect's clients read output from the terminal event, so it is kept
    running = await start_server(long_script(), max_event_bytes=64 * 1024)
    big = "x" * (70 * 1024)
    before = await large_events("launched", "sent_whole", running.address.http_url)
    rollout = await in_thread(launched_rollout_with_instructions, running.address.ws_url, big)
    completed = next(e for e in rollout.events() if e["type"] == "response.completed")
    assert len(completed["response"]["output"]) == 3  # its clients read output there
    assert completed["response"]["instructions"] == big
    assert rollout.largest > 64 * 1024
    warned = [r for r in caplog.records if r.message == "event.over_limit"]
    assert warned and warned[0].flag == "--max-event-bytes"  # type: ignore[attr-defined]
    # response.created, .in_progress and .completed each echo the instructions
    assert await large_events("launched", "sent_whole", running.address.http_url) - before == 3


def launched_rollout_with_instructions(url: str, instructions: str) -> Recorded:
    """One launched turn whose Response echoes `instructions`, read with no `max_size`."""
    with ws_connect(url, max_size=None) as ws:
        client = Recorded(ws)
        client.send({"type": "response.create", **create(store=False, instructions=instructions)})
        client.until("response.completed")
        return client
