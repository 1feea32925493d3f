"""The dialects without a socket: a `Responses`, a connection's lanes as one channel, frames in;
out come the events the dialect sends, the same as over the wire (test_prototype_rollout.py,
test_launched.py), and the refusals it raises, which the connection would send as `error`."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
import trio
import trio.testing

from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.dialects.launched import LaunchedDialect
from proto_server.server.dialects.prototype import PrototypeDialect
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.memory import MemoryBudget, MiB
from proto_server.server.rollouts.responses import Responses
from proto_server.server.transport.connection import Dialect
from proto_server.server.transport.outbox import LaneSink, Outgoing
from proto_server.wire.converter import decode_client_event, encode_server_event_bytes
from proto_server.wire.errors import ProtocolError

from ..support.clients import collapse, types
from ..support.frames import THREE_SEGMENTS, answers, create, launched_create
from ..support.servers import FAST


class InMemoryLanes:
    """A connection's lanes with no socket behind them (`ClientLanes`): `deliver` hands a
    dialect a frame as the connection's reader does, `until` reads back what it sent, as the
    JSON the writer would send (numbered per lane)."""

    def __init__(self, budget_bytes: int = 64 * MiB) -> None:
        self.budget = MemoryBudget(budget_bytes, flag="--max-connection-memory", name="connection")
        self._send, self._receive = trio.open_memory_channel[Outgoing](math.inf)
        self._numbers: dict[str | None, int] = {}

    def lane(self, stream_id: str | None) -> LaneSink:
        return LaneSink(self._send, stream_id)

    async def deliver(self, dialect: Dialect, frame: dict[str, Any]) -> None:
        """`frame` decoded and handled; what the dialect refuses is raised, not sent."""
        text = orjson.dumps(frame).decode()
        await dialect.handle(decode_client_event(text), len(text))

    async def until(self, *kinds: str) -> list[dict[str, Any]]:
        """What was sent, up to and with the first event of one of `kinds`."""
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in kinds:
            outgoing = await self._receive.receive()
            number = self._numbers.get(outgoing.stream_id, 0)
            self._numbers[outgoing.stream_id] = number + 1
            payload = encode_server_event_bytes(outgoing.event, number, outgoing.stream_id)
            events.append(orjson.loads(payload))
        return events

    def pending(self) -> int:
        """How many events were sent and not read yet."""
        return self._receive.statistics().current_buffer_used


TEXT_ITEM = ["output_item.added", "content_part.added", "output_text.delta*"]
TEXT_ITEM_END = ["output_text.done", "content_part.done", "output_item.done"]
CALL = ["output_item.added", "function_call_arguments.delta*"]
CALL_END = ["function_call_arguments.done", "output_item.done"]


def served(opened: list[int]) -> tuple[Responses, InMemoryLanes]:
    """Responses on the simulated GPU serving `THREE_SEGMENTS`, `opened` hearing each rollout
    open (+1) and close (-1); and one connection's lanes."""
    generator = SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST)
    return Responses(generator, ServerConfig(), on_rollout=opened.append), InMemoryLanes()


async def test_a_prototype_rollout_runs_with_no_socket(nursery: trio.Nursery) -> None:
    opened: list[int] = []
    built, lanes = served(opened)
    dialect = PrototypeDialect(built, lanes, nursery)

    await lanes.deliver(dialect, create())
    first = await lanes.until("response.done")
    await lanes.deliver(dialect, {"type": "response.append", "input": answers(first)})
    second = await lanes.until("response.done")
    await lanes.deliver(dialect, {"type": "response.append", "input": answers(second)})
    third = await lanes.until("response.completed")

    assert collapse(types(first)) == [
        "created", "in_progress", *TEXT_ITEM, *TEXT_ITEM_END, *CALL, *CALL_END, "done",
    ]  # fmt: skip
    assert collapse(types(second)) == ["in_progress", *CALL, *CALL_END, *CALL, *CALL_END, "done"]
    assert collapse(types(third)) == ["in_progress", *TEXT_ITEM, *TEXT_ITEM_END, "completed"]
    events = first + second + third
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    final = third[-1]["response"]
    assert final["output"][-1]["content"][0]["text"] == "Fixed: the loop was off by one."

    await trio.testing.wait_all_tasks_blocked()
    assert dialect.current is None and lanes.pending() == 0  # nothing after the terminal event
    assert opened == [1, -1]  # its one rollout, closed with its Response
    assert [t.source for t in built.turns] == ["fresh"]
    assert lanes.budget.used == 0


async def test_a_prototype_create_while_one_is_open_is_refused(nursery: trio.Nursery) -> None:
    built, lanes = served([])
    dialect = PrototypeDialect(built, lanes, nursery)
    await lanes.deliver(dialect, create())
    await lanes.until("response.done")
    with pytest.raises(ProtocolError) as refused:
        await lanes.deliver(dialect, create())
    assert refused.value.detail.code == "concurrent_request"
    with pytest.raises(ProtocolError) as chained:
        await lanes.deliver(dialect, create(stream_id="b", previous_response_id="resp_1"))
    assert chained.value.detail.param == "previous_response_id"
    assert lanes.pending() == 0  # a refusal sends nothing: the connection says it


async def test_launched_turns_chain_warm_with_no_socket(nursery: trio.Nursery) -> None:
    opened: list[int] = []
    built, lanes = served(opened)
    dialect = LaunchedDialect(built, lanes, nursery)

    await lanes.deliver(dialect, launched_create())
    first = await lanes.until("response.completed")
    previous = first[-1]["response"]["id"]
    await lanes.deliver(
        dialect, launched_create(previous_response_id=previous, input=answers(first))
    )
    second = await lanes.until("response.completed")

    assert collapse(types(first)) == [
        "created", "in_progress", *TEXT_ITEM, *TEXT_ITEM_END, *CALL, *CALL_END, "completed",
    ]  # fmt: skip
    assert second[-1]["response"]["previous_response_id"] == previous
    assert [t.source for t in built.turns] == ["fresh", "cache"]
    with pytest.raises(ProtocolError) as refused:
        await lanes.deliver(dialect, {"type": "response.append", "input": []})
    assert refused.value.detail.code == "unknown_event_type"

    await trio.testing.wait_all_tasks_blocked()
    assert opened == [1]  # the last Response stays warm for the next turn
    await dialect.aclose()
    assert opened == [1, -1]
