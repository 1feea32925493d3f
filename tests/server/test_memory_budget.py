"""What the server keeps for its clients is counted and bounded: per connection and per process.

Idle holders (a launched connection's cached rollout, a suspended Response) are let go first,
idlest first, each with its reason; only then is a request refused, with a typed error. The
estimates behind the counts are checked against what Python really allocates.
"""

from __future__ import annotations

import gc
import logging
import tracemalloc
from contextlib import AsyncExitStack
from typing import Any

import orjson
import pytest
import trio

from proto_server.core.conversation import Conversation, decoded_bytes
from proto_server.core.render import O200kRenderer
from proto_server.core.request import input_items
from proto_server.server.process.memory import MEMORY_LIMIT, PREPARING_FACTOR, MemoryBudget, MiB
from proto_server.wire.converter import decode_client_event, steer_items
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate, ResponseSteer

from ..support.clients import connect, turn
from ..support.frames import THREE_SEGMENTS, USER, create, launched_create
from ..support.servers import StartServer

# -- the estimate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "input",
    [
        pytest.param("word " * 200_000, id="one long string"),
        pytest.param([{"role": "user", "content": "hi"}] * 40_000, id="many tiny messages"),
        pytest.param(
            [{"type": "function_call_output", "call_id": f"c{i}", "output": "x y " * 2000}
             for i in range(100)],
            id="tool outputs",
        ),
        pytest.param(
            [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
             for i in range(20_000)],
            id="calls",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "input_text", "text": "hi"}] * 10}] * 5_000,
            id="content parts",
        ),
        pytest.param(
            [{"type": "mcp_list_tools", "tools": [{"a": 1, "b": [1, 2, 3]}]}] * 10_000,
            id="unknown items",
        ),
    ],
)  # fmt: skip
def test_the_estimate_of_a_conversation_is_close_to_what_it_really_holds(input: Any) -> None:
    frame = orjson.dumps({"type": "response.create", "input": input})
    renderer = O200kRenderer()  # its vocabulary is loaded once, outside the measurement
    gc.collect()
    tracemalloc.start()
    try:
        event = decode_client_event(frame)
        conversation = Conversation(renderer)
        conversation.extend(input_items(event))
        del event
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.7 * held < conversation.retained_bytes < 2.5 * held


# -- the budget itself -----------------------------------------------------------------------------


class Holder:
    def __init__(self, budget: MemoryBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        self.evicted: str | None = None
        budget.charge(nbytes)
        budget.idle(self)

    def evict(self, reason: str) -> None:
        self.evicted = reason
        self.budget.charge(-self.nbytes)


def budgets() -> tuple[MemoryBudget, MemoryBudget, MemoryBudget]:
    process = MemoryBudget(10 * MiB, flag="--max-memory", name="process")
    one = process.child(4 * MiB, flag="--max-connection-memory", name="connection")
    two = process.child(4 * MiB, flag="--max-connection-memory", name="connection")
    return process, one, two


def test_room_is_made_by_letting_the_idlest_go_first() -> None:
    process, one, two = budgets()
    oldest, newer = Holder(one, 3 * MiB), Holder(two, 3 * MiB)
    busy = Holder(one, MiB)
    one.busy(busy)
    process.admit(4 * MiB, "This request")
    assert (oldest.evicted, newer.evicted, busy.evicted) == (MEMORY_LIMIT, None, None)
    assert process.used == 8 * MiB and process.evicted == 1


def test_a_connection_makes_room_only_from_what_it_holds() -> None:
    _, one, two = budgets()
    theirs = Holder(two, 3 * MiB)
    mine = Holder(one, 3 * MiB)
    one.admit(2 * MiB, "This request")
    assert (mine.evicted, theirs.evicted) == (MEMORY_LIMIT, None)


def test_with_nothing_idle_left_a_request_is_refused_and_nothing_is_charged() -> None:
    process, one, _ = budgets()
    one.charge(3 * MiB)
    with pytest.raises(ProtocolError) as refused:
        one.admit(2 * MiB, "This request")
    assert refused.value.detail.code == "connection_memory_limit"
    assert "--max-connection-memory" in refused.value.detail.message
    with pytest.raises(ProtocolError) as busy:
        process.admit(8 * MiB, "This frame")
    assert (busy.value.detail.code, busy.value.status) == ("server_busy", 503)
    assert "--max-memory" in busy.value.detail.message
    assert process.used == one.used == 3 * MiB


def test_a_closed_connection_no_longer_counts() -> None:
    process, one, _ = budgets()
    Holder(one, 3 * MiB)
    one.charge(MiB)
    one.close()
    one.charge(-MiB)  # a rollout released after its connection closed
    assert process.used == 0
    process.admit(10 * MiB, "This request")  # and nothing of it is left to let go


# -- live ------------------------------------------------------------------------------------------

BIG_INPUT = [{"role": "user", "content": "word " * 100_000}]  # about 0.9 MB held
INPUT = [{"role": "user", "content": "word " * 10_000}]


def budget_for(frame: dict[str, Any], rollouts: float) -> int:
    """A process budget with room to decode `frame` beside `rollouts` rollouts made of it."""
    create = decode_client_event(orjson.dumps(frame))
    assert isinstance(create, ResponseCreate)
    conversation = Conversation(O200kRenderer(), instructions=create.instructions)
    conversation.extend(input_items(create))
    frame_bytes = len(orjson.dumps(frame))
    return PREPARING_FACTOR * frame_bytes + int(rollouts * conversation.retained_bytes)


async def test_a_request_too_big_for_its_connection_is_refused_and_the_connection_lives(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, max_connection_memory_bytes=MiB)
    async with connect(running.address.ws_url) as client:
        refused = await turn(client, launched_create(input=[USER, *BIG_INPUT, *BIG_INPUT]))
        assert refused[-1]["type"] == "error", refused[-1]
        assert refused[-1]["error"]["code"] == "connection_memory_limit"
        assert "--max-connection-memory" in refused[-1]["error"]["message"]
        assert (await turn(client, launched_create()))[-1]["type"] == "response.completed"
    with trio.fail_after(5):
        await running.server.wait_idle()
    assert running.server.responses.memory.used == 0


async def test_the_idlest_cached_rollout_is_let_go_for_another_connection(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    frame = launched_create(input=[USER, *INPUT])
    running = await start_server(THREE_SEGMENTS, max_memory_bytes=budget_for(frame, 1.5))
    url = running.address.ws_url
    with trio.fail_after(20):
        async with connect(url) as first, connect(url) as second:
            one = (await turn(first, frame))[-1]["response"]
            two = (await turn(second, frame))[-1]["response"]
            async with connect(url) as third:
                with caplog.at_level(logging.WARNING, logger="proto_server"):
                    done = await turn(third, frame)
                assert done[-1]["type"] == "response.completed"
            assert any(r.message == "memory.evicted" for r in caplog.records)
            # the first cache went (the idlest): its chain is gone, the second one's is warm
            lost = await turn(first, launched_create(previous_response_id=one["id"], input=[USER]))
            assert lost[-1]["error"]["code"] == "previous_response_not_found"
            kept = await turn(second, launched_create(previous_response_id=two["id"], input=[USER]))
            assert kept[-1]["type"] == "response.completed"
        await running.server.wait_idle()
    assert running.server.responses.memory.used == 0


async def test_a_suspended_response_let_go_for_room_ends_incomplete(
    start_server: StartServer,
) -> None:
    frame = create(input=[USER, *INPUT])
    running = await start_server(THREE_SEGMENTS, max_memory_bytes=budget_for(frame, 0.5))
    url = f"{running.address.ws_url}?dialect=prototype"
    with trio.fail_after(20):
        async with connect(url) as sleeper, connect(url) as newcomer:
            await sleeper.send(frame)
            assert (await sleeper.segment())[-1]["type"] == "response.done"
            await newcomer.send(frame)
            assert (await newcomer.segment())[-1]["type"] == "response.done"
            ended = await sleeper.until("response.incomplete")
            assert ended[-1]["response"]["incomplete_details"] == {"reason": MEMORY_LIMIT}
        await running.server.wait_idle()
    assert running.server.responses.memory.used == 0


async def test_a_frame_the_process_has_no_room_for_is_refused_with_server_busy(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, max_memory_bytes=MiB)
    async with connect(f"{running.address.ws_url}?dialect=prototype") as client:
        await client.send(create(input=[USER, *BIG_INPUT]))  # 0.5 MB: 16 MiB to prepare
        refused = await client.receive()
        assert (refused["type"], refused["status"]) == ("error", 503)
        assert refused["error"]["code"] == "server_busy"
        await client.send(create())
        assert (await client.segment())[-1]["type"] == "response.done"


@pytest.mark.parametrize("dialect", ["launched", "prototype"])
async def test_what_a_budget_lets_go_is_really_freed(
    start_server: StartServer, dialect: str
) -> None:
    """Idle connections whose last Response ended (and whose caches were let go) hold nothing
    of it: not the frame, not the request, not the rollout. Before, each kept all three (9.9
    rollouts' worth for 6 connections here): memory grew with every connection whatever the
    budget."""
    big = {"role": "user", "content": "word " * 200_000}
    frame = launched_create(input=[USER, big]) if dialect == "launched" else create(input=[big])
    rollout = budget_for(frame, 1) - PREPARING_FACTOR * len(orjson.dumps(frame))
    running = await start_server(
        {"segments": [{"text": "Fixed."}]}, max_memory_bytes=budget_for(frame, 2.5)
    )
    url = running.address.ws_url + ("?dialect=prototype" if dialect == "prototype" else "")
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        with trio.fail_after(60):
            async with AsyncExitStack() as stack:
                for _ in range(6):
                    client = await stack.enter_async_context(connect(url))
                    assert (await turn(client, frame))[-1]["type"] == "response.completed"
                await trio.sleep(0.1)  # the evicted rollouts close
                gc.collect()
                held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - before < 4 * rollout, f"{(held - before) / rollout:.1f} rollouts still held"


@pytest.mark.parametrize(
    "input",
    [
        pytest.param("word " * 200_000, id="one long string"),
        pytest.param("w\U0001f600rd " * 200_000, id="a wide string"),
        pytest.param([{"role": "user", "content": "w\u00e9rd " * 200_000}], id="one message"),
        pytest.param([{"role": "user", "content": "hi"}] * 20_000, id="many tiny messages"),
        pytest.param(
            [{"role": "user", "content": [{"type": "input_text", "text": "hi"}] * 10}] * 2_000,
            id="content parts",
        ),
    ],
)  # fmt: skip
def test_what_a_waiting_steer_is_charged_covers_what_it_holds(input: Any) -> None:
    """A steer keeps its input as sent beside its items: the charge counts both, and a wide
    string at its width (`len` would count an emoji string at a quarter of its size)."""
    frame = orjson.dumps({"type": "response.steer", "previous_response_id": "r", "input": input})
    gc.collect()
    tracemalloc.start()
    try:
        event = decode_client_event(frame)
        assert isinstance(event, ResponseSteer)
        raw, items = event.input, steer_items(event.input)
        del event
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    charged = decoded_bytes(items, text=isinstance(raw, str))
    assert 0.95 * held < charged < 2 * held
