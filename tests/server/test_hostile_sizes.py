"""Large requests are prepared off the event loop: while one client's multi-megabyte frame is
decoded and tokenized, every other client is still served.

What is asserted is what the event loop's thread itself spent: a trio instrument reads the
thread's CPU clock around every step of the server's tasks, so a busy neighbour (which delays
the loop but spends none of its CPU) cannot turn a test red. Before the fix one step held the
loop for 1.5-4 s; a tiny request's longest step is a few milliseconds.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proto_server.core import conversation as conversation_module
from proto_server.core.conversation import Conversation
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.script import Segment
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.dialects import routes as routes_module
from proto_server.server.listener.app import BoundAddress, ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.offload import FREEZE_OBJECTS, INLINE_BYTES, Offload
from proto_server.server.rollouts import responses as responses_module
from proto_server.server.rollouts import storing as storing_module
from proto_server.server.transport import writer as writer_module
from proto_server.wire.json_text import YIELDING_PARSE_BYTES, load_yielding
from proto_server.wire.response import Response

from ..support.clients import connect, sse
from ..support.frames import json_values
from ..support.servers import StartServer, read_line
from ..support.stores import CheckpointStore

#: The most CPU one step of the server's tasks may spend on the event loop's thread while the
#: big requests are prepared, beyond `TINY_STEPS` times a tiny request's longest step (before
#: the fix: 1.5-4 s for these sizes).
STEP_CPU_BOUND_S = 0.25
TINY_STEPS = 10


def required_tower(levels: int) -> dict[str, Any]:
    """The 1 KB schema that froze the server: each level requires `a` ten times."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"] * 10}
    return schema


class BystanderOrDefault:
    """The bystander (no tools offered) gets one long text segment, streamed at 1,000
    tokens/s while the attack runs; an attacker offering tools gets the built-in default
    model, whose choice of tool and arguments is part of what the attack costs."""

    def __init__(self) -> None:
        self._default = DefaultModel()

    def plan(self, conversation: Conversation, limits: GenerationLimits) -> Segment:
        if conversation.tools:
            return self._default.plan(conversation, limits)
        return Segment(text="word " * 5000)


BIG_STRING = "a" * (4 * 1024 * 1024)  # tokenizing a run like this costs ~0.4 s per MiB here
MANY_ITEMS = [{"role": "user", "content": "hi"}] * 200_000  # ~7 MB: ~1 s to decode and render
MANY_TOOLS = [
    {"type": "function", "name": f"tool_{i}", "parameters": {"type": "object"}} for i in range(2000)
]


class LoopSteps(trio.abc.Instrument):
    """The event loop thread's CPU time (`time.thread_time`, not the wall clock) of the longest
    step of any task under `root`: what the loop spent on it, whatever else the machine runs."""

    def __init__(self, root: trio.lowlevel.Task) -> None:
        self.root = root
        self.longest = 0.0
        self.longest_task = ""
        self._began: float | None = None
        self._under_root: dict[trio.lowlevel.Task, bool] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began is None or not self._serves(task):
            return
        spent = time.thread_time() - self._began
        if spent > self.longest:
            self.longest, self.longest_task = spent, task.name

    def _serves(self, task: trio.lowlevel.Task) -> bool:
        if task not in self._under_root:
            nursery = task.parent_nursery
            parent = None if nursery is None else nursery.parent_task
            self._under_root[task] = task is self.root or (
                parent is not None and self._serves(parent)
            )
        return self._under_root[task]


async def probe_health(address: BoundAddress, answered: trio.Event) -> None:
    """GET /healthz on a fresh connection, again and again; `answered` once one is."""
    while True:
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            while await stream.receive_some():
                pass
        answered.set()
        await trio.sleep(0.02)


async def stream_beside(address: BoundAddress, deltas: list[int], started: trio.Event) -> None:
    """A bystander reading a long streamed segment, counting its deltas."""
    async with connect(f"{address.ws_url}?dialect=prototype") as client:
        await client.send({"type": "response.create", "store": False, "input": "go"})
        while True:
            event = await client.receive()
            if event["type"] == "response.output_text.delta":
                deltas.append(1)
                started.set()
            if event["type"] == "response.completed":
                return


async def send_big(address: BoundAddress, create: dict[str, Any]) -> None:
    url = f"{address.ws_url}?dialect=prototype"
    async with connect(url, max_message_size=16 * 1024 * 1024) as client:  # instructions echo
        await client.send(create)
        first = await client.receive()
        assert first["type"] == "response.created", first
        await client.send({"type": "response.cancel"})
        await client.until("response.cancelled")


@pytest.mark.parametrize(
    "create",
    [
        pytest.param({"input": BIG_STRING}, id="a 4 MiB string"),
        pytest.param({"input": MANY_ITEMS}, id="200,000 tiny items"),
        pytest.param({"input": "hi", "instructions": BIG_STRING}, id="4 MiB of instructions"),
        pytest.param(
            {"input": "use it " * 600_000, "tools": MANY_TOOLS}, id="2,000 tools and 4 MB of text"
        ),
        pytest.param(
            {
                "input": "go",
                "tools": [{"type": "function", "name": "tower", "parameters": required_tower(9)}],
            },
            id="the 1 KB schema that froze the server",
        ),
    ],
)
async def test_a_big_request_does_not_stall_anyone_else(create: dict[str, Any]) -> None:
    """No step of the server holds the event loop for work that grows with the request: the
    longest step while a big request is prepared, against a tiny request's in the same run."""
    tiny = min([(await attack_beside_bystanders({"input": "hi"})).longest for _ in range(2)])
    big = await attack_beside_bystanders(create)
    bound = STEP_CPU_BOUND_S + TINY_STEPS * tiny
    assert big.longest < bound, (big.longest_task, big.longest, tiny)


async def attack_beside_bystanders(create: dict[str, Any]) -> LoopSteps:
    """Send `create` while a bystander streams and health probes run; the server's steps."""
    server = ProtoServer(
        SimulatedGenerator(
            BystanderOrDefault(), TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1000)
        ),
        ServerConfig(port=0),
        store=CheckpointStore(),
    )
    deltas: list[int] = []
    answered = trio.Event()

    steps = LoopSteps(trio.lowlevel.current_task())
    # as `serve` does at start-up: what the suite loaded before (hundreds of thousands of
    # objects) is not re-scanned by a full collection that would land in one of these steps
    gc.collect()
    gc.freeze()
    try:
        await attack(server, create, steps, deltas, answered)
    finally:
        gc.unfreeze()
    assert server.crashed_connections == 0
    assert deltas
    return steps


async def attack(
    server: ProtoServer,
    create: dict[str, Any],
    steps: LoopSteps,
    deltas: list[int],
    answered: trio.Event,
) -> None:
    async def serve(*, task_status: trio.TaskStatus[BoundAddress]) -> None:
        steps.root = trio.lowlevel.current_task()
        await server.serve(task_status=task_status)

    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve)
        started = trio.Event()
        nursery.start_soon(stream_beside, address, deltas, started)
        with trio.fail_after(30):
            await started.wait()
            nursery.start_soon(probe_health, address, answered)
            trio.lowlevel.add_instrument(steps)
            try:
                await send_big(address, {"type": "response.create", "store": False, **create})
                await answered.wait()
            finally:
                trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()


async def test_small_work_stays_inline_and_large_work_goes_to_a_thread() -> None:
    offload = Offload(threads=1)
    here = trio.lowlevel.current_trio_token()

    def where() -> bool:
        try:
            return trio.lowlevel.current_trio_token() is here
        except RuntimeError:
            return False  # not in the trio thread

    assert await offload.run(where, size=INLINE_BYTES) is True
    assert await offload.run(where, size=INLINE_BYTES + 1) is False


@attrs.define
class _Made:
    """A tracked object, as a decoded item is."""

    number: int


async def test_what_a_large_preparation_made_is_frozen_out_of_the_collector() -> None:
    """The collector's first pass over a 15 MB request's 400,000 items held the GIL for 50-130
    ms; frozen, they are never scanned, and still freed when let go."""
    offload = Offload(threads=1)
    frozen = gc.get_freeze_count()
    small = await offload.run(lambda: [_Made(n) for n in range(1_000)], size=INLINE_BYTES + 1)
    assert gc.get_freeze_count() <= frozen  # a few: scanned cheaply (frees may only lower it)

    made = await offload.run(
        lambda: [_Made(n) for n in range(2 * FREEZE_OBJECTS)], size=INLINE_BYTES + 1
    )
    after = gc.get_freeze_count()
    assert after >= frozen + 2 * FREEZE_OBJECTS
    assert gc.isenabled()
    last = weakref.ref(made[-1])
    del made
    await trio.lowlevel.checkpoint()  # trio's run loop lets go of the value it last sent
    assert last() is None  # freed by reference counting, frozen or not
    assert gc.get_freeze_count() <= after - 2 * FREEZE_OBJECTS
    del small


async def test_nothing_is_frozen_when_a_preparation_raised() -> None:
    """A refused request's traceback may hold a cycle (its frames, the parsed request): frozen,
    the collector could never free it, and a client could repeat it until memory ran out."""
    offload = Offload(threads=1)
    frozen = gc.get_freeze_count()

    def refused() -> None:
        made = [_Made(n) for n in range(2 * FREEZE_OBJECTS)]
        raise ValueError(f"refused after making {len(made)}")

    with pytest.raises(ValueError, match="refused"):
        await offload.run(refused, size=INLINE_BYTES + 1)
    assert gc.get_freeze_count() <= frozen  # freezing only adds; frees may lower it
    assert gc.isenabled()


async def test_a_cancelled_preparation_returns_at_once() -> None:
    """A stopping server does not wait for a thread still tokenizing a huge input."""
    offload = Offload(threads=1)
    release = threading.Event()
    with trio.fail_after(10):
        with trio.move_on_after(0.05) as waited:
            await offload.run(release.wait, size=INLINE_BYTES + 1)
        assert waited.cancelled_caught
        assert not release.is_set()  # it returned while the thread still works
    release.set()


async def test_sigterm_stops_a_real_server_while_it_prepares_huge_requests(
    nursery: trio.Nursery,
) -> None:
    """Before: a 1 KB schema held the event loop for 40 minutes and SIGTERM did nothing."""
    command = [
        *(sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:"),
        *("--shutdown-grace", "1"),
    ]
    with trio.fail_after(60):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        url = (await read_line(process.stdout)).split("WebSocket ")[1].split(";")[0]
        host, port = url.removeprefix("ws://").split("/")[0].split(":")
        address = BoundAddress(host, int(port))
        tool = {"type": "function", "name": "tower", "parameters": required_tower(12)}
        async with connect(f"{url}?dialect=prototype") as tower:
            await tower.send({"type": "response.create", "input": "go", "tools": [tool]})
            answered = await tower.segment()  # in bounded time, a call with bounded arguments
            assert answered[-1]["type"] == "response.done", answered[-1]
        async with connect(f"{url}?dialect=prototype") as big:
            await big.send({"type": "response.create", "input": "a" * (12 * 1024 * 1024)})
            answered = trio.Event()
            async with trio.open_nursery() as probing:  # answered while it tokenizes
                probing.start_soon(probe_health, address, answered)
                await answered.wait()
                probing.cancel_scope.cancel()
            process.send_signal(signal.SIGTERM)  # within the deadline: not after 12 MB of work
            assert await process.wait() == 0


@settings(max_examples=300, deadline=None)
@example("1e400")
@example('"\\ud800"')
@example('"\\ud83d\\ude00"')
@example("18446744073709551615")
@example("18446744073709551616")
@example("-9223372036854775809")
@example("NaN")
@example("[1,]")
@example('{"a": 1, "a": 2}')
@example(b'"\xed\xa0\x80"')  # a surrogate encoded in UTF-8
@example("\ufeff{}")
@given(st.one_of(json_values.map(orjson.dumps), st.binary(max_size=40), st.text(max_size=40)))
def test_a_large_frame_is_parsed_as_orjson_would(text: bytes | str) -> None:
    """The parser for large frames (which lets other threads run) accepts and refuses exactly
    what orjson does; padding puts every example over the size where it takes over."""
    padded = text + (b" " if isinstance(text, bytes) else " ") * YIELDING_PARSE_BYTES
    try:
        expected = orjson.loads(padded)
    except orjson.JSONDecodeError:
        with pytest.raises(ValueError):
            load_yielding(padded)
        return
    assert load_yielding(padded) == expected


#: More tools than the loop may echo or count inline (each a Python step: 36,000 in 4 MB).
ECHOED_TOOLS = [
    {"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(2000)
]


async def test_a_large_response_is_echoed_and_stored_off_the_event_loop(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ends a large stored Response grows with its request and runs on a worker thread,
    as its decoding and rendering do: its items given their ids to be stored, its tools echoed
    in the Response, counted for the memory budget, and encoded in each event that echoes
    them; and as the JSON body of a create not streamed, of its retrieval and of its input
    items (before: on the event loop, 0.9-3 s for the 4 MB shapes of `bench probes`, 176-217 ms
    for a body echoing the 134,000 tools of 15 MB)."""
    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    large_ones: set[str] = set()

    def watch(module: Any, name: str, large: Callable[..., bool]) -> None:
        original = getattr(module, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            if large(*args, **kwargs):
                large_ones.add(name)
                if threading.get_ident() == loop_thread:
                    on_loop.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, watched)

    many = len(ECHOED_TOOLS)
    watch(storing_module, "with_ids", lambda items: len(items) > many)
    watch(responses_module, "response_template", lambda create, **_: len(create.tools) > many)
    watch(conversation_module, "prefix_bytes", lambda _, tools: len(tools) > many)
    watch(writer_module, "encode_server_event_bytes", lambda event, *_: echoed(event) > many)
    watch(routes_module, "encode_json_bytes", lambda response: len(response.tools) > many)
    watch(routes_module, "input_listing", lambda _, chain, __: len(chain[0].items) > many)
    running = await start_server(planner=DefaultModel())
    url = f"{running.address.http_url}/responses"
    create = {
        "model": "m",
        "store": True,
        "tools": [*ECHOED_TOOLS, {"type": "function", "name": "last"}],
        "input": [{"role": "user", "content": "hi"}] * (2 * many),
    }
    async with httpx.AsyncClient(timeout=60) as http:
        events = await sse(http, url, create)
        assert events[-1]["type"] == "response.completed", events[-1]
        answered = await http.post(url, json={**create, "stream": False})
        assert answered.status_code == 200
        assert len(answered.json()["tools"]) == many + 1
        response_id = events[-1]["response"]["id"]
        retrieved = await http.get(f"{url}/{response_id}")
        assert retrieved.json()["tools"] == events[-1]["response"]["tools"]
        stored = await http.get(f"{url}/{response_id}/input_items")
    assert stored.status_code == 200
    assert stored.json()["data"][0]["id"].startswith("msg_")
    assert on_loop == [], on_loop
    assert {"encode_json_bytes", "input_listing", "encode_server_event_bytes"} <= large_ones


def echoed(event: Any) -> int:
    """How many tools the Response `event` carries echoes (0: none)."""
    response = getattr(event, "response", None)
    return len(response.tools) if isinstance(response, Response) else 0
