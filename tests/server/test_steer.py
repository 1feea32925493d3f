"""Steering (`response.steer`) against a real server on 127.0.0.1: the steered Response ends at
a safe point and its successor starts by itself on the same lane (launched dialect), or the one
Response goes on with the steer (prototype dialect); pending while calls await output; every
refusal is `response.steer.failed` with the input back. Every stream passes the `LaneChecker`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from proto_server.engine.simulated import TimingModel
from proto_server.server.process.memory import MemoryBudget, MiB
from proto_server.server.store import (
    SQLiteStore,
    StoredResponse,
    StoreUnavailable,
    SuspendedResponse,
    SuspensionLost,
)

from ..support.clients import BETA, END, Checked, connect
from ..support.frames import THREE_SEGMENTS, answers, create, launched_create
from ..support.servers import StartServer
from ..support.stores import CheckpointStore

SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=200)
#: A long first answer (about 1 s at SLOW), then what the model says once steered.
LONG_THEN_SHORT = {"segments": [{"text": "word " * 200}, {"text": "Tabs it is."}]}


def steer(response_id: str, text: Any = "Use tabs, not spaces.", **extra: Any) -> dict[str, Any]:
    return {"type": "response.steer", "previous_response_id": response_id, "input": text, **extra}


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


async def test_a_steer_ends_the_response_steered_and_its_successor_starts_on_its_lane(
    start_server: StartServer,
) -> None:
    running = await start_server(LONG_THEN_SHORT, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(stream_id="s", temperature=0.5, metadata={"k": "v"}))
            events = await client.until_lane("s", "response.output_text.delta")
            first = events[0]["response"]
            await client.send(steer(first["id"]))
            events += await client.until_lane("s", "response.incomplete")
            accepted = next(e for e in events if e["type"] == "response.steer.accepted")
            steered = events[-1]["response"]
            events += await client.until_lane("s", *END)
            client.checker.finish()
    assert accepted["stream_id"] == "s"
    assert accepted["steer"]["previous_response_id"] == first["id"]
    assert accepted["steer"]["id"].startswith("steer_")
    assert steered["id"] == first["id"]
    assert steered["incomplete_details"] == {"reason": "steered"}
    assert steered["output"][0]["status"] == "incomplete"  # the open message was closed
    created = [e["response"] for e in events if e["type"] == "response.created"]
    assert len(created) == 2  # the successor came by itself: no create was sent for it
    follower = created[1]
    assert follower["previous_response_id"] == first["id"]
    for inherited in ("model", "instructions", "tools", "temperature", "metadata"):
        assert follower[inherited] == first[inherited], inherited
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Tabs it is."
    assert all(e.get("stream_id") == "s" for e in events)


async def test_a_steer_after_a_call_is_pending_and_follows_the_outputs_create(
    start_server: StartServer,
) -> None:
    store = CheckpointStore()
    running = await start_server(THREE_SEGMENTS, store=store)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(store=True))
            events = await client.until_lane(None, "response.completed")
            rid = events[0]["response"]["id"]
            # it completed with a call awaiting output: the steer waits for the outputs
            await client.send(steer(rid))
            events += await client.until_lane(None, "response.steer.pending")
            assert kinds(events)[-2] == "response.steer.accepted"
            pending = events[-1]
            calls = answers(events)
            assert [r["call_id"] for r in pending["required_input"]] == [calls[0]["call_id"]]
            assert pending["required_input"][0]["name"] == "exec_command"
            assert pending["reason"] == "waiting_for_required_input"
            await client.send(launched_create(store=True, previous_response_id=rid, input=calls))
            more = await client.until_lane(None, *END)
            client.checker.finish()
    follower = more[-1]["response"]["id"]
    items = store.responses[follower].items
    # the outputs answer the calls first, then the steer's message follows
    assert [i.type for i in items[:2]] == ["function_call_output", "message"]
    assert items[1].content == "Use tabs, not spaces."  # type: ignore[union-attr]


async def test_a_steer_cuts_a_call_whose_arguments_still_stream(
    start_server: StartServer,
) -> None:
    # the call's arguments stream slowly: no one can be running it yet, so the steer cuts it
    script = {
        "segments": [{"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "x" * 80}}]}]
    }
    running = await start_server(script, timing=TimingModel(decode_tokens_per_s=100))
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create())
            events = await client.until_lane(None, "response.function_call_arguments.delta")
            rid = events[0]["response"]["id"]
            await client.send(steer(rid))
            events += await client.until_lane(None, "response.incomplete", "response.completed")
            steered = events[-1]["response"]
            events += await client.until_lane(None, *END)
            client.checker.finish()
    # the open call was cut between tokens: closed as incomplete, and a successor follows
    assert steered["incomplete_details"] == {"reason": "steered"}
    assert steered["output"][0]["status"] == "incomplete"
    assert events[-1]["response"]["previous_response_id"] == rid


async def test_every_refused_steer_comes_back_with_its_input(start_server: StartServer) -> None:
    running = await start_server(LONG_THEN_SHORT, timing=SLOW, max_pending_steers=1)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)

            async def refused(frame: dict[str, Any], lane: str | None) -> dict[str, Any]:
                await client.send(frame)
                (*_, failed) = await client.until_lane(lane, "response.steer.failed")
                assert failed["steer"]["input"] == frame["input"]
                assert "id" not in failed["steer"]  # never accepted: no id was given
                return failed["error"]

            error = await refused(steer("resp_nope"), None)
            assert error["code"] == "response_not_found"
            await client.send(launched_create(stream_id="x"))
            events = await client.until_lane("x", "response.output_text.delta")
            rid = events[0]["response"]["id"]
            tool_output = [{"type": "function_call_output", "call_id": "c", "output": "x"}]
            assert (await refused(steer(rid, tool_output), "x"))["code"] == "invalid_input"
            assert (await refused(steer(rid, []), "x"))["code"] == "invalid_input"
            assert (await refused(steer(rid, stream_id="x"), "x"))["code"] == "invalid_input"
            await client.send(steer(rid, "first"))
            assert (await refused(steer(rid, "second"), "x"))["code"] == "too_many_pending_steers"
            events = await client.until_lane("x", "response.incomplete")
            assert (await refused(steer(rid, "late"), "x"))["code"] == "response_already_completed"
            await client.until_lane("x", *END)
            client.checker.finish()
    assert events[-1]["response"]["incomplete_details"] == {"reason": "steered"}  # "first"


async def test_a_multi_agent_response_is_not_steered(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.address.ws_url, **BETA) as raw:
            client = Checked(raw)
            await client.send(launched_create(multi_agent={"enabled": True}))
            events = await client.until_lane(None, "response.output_text.delta")
            await client.send(steer(events[0]["response"]["id"]))
            (*_, failed) = await client.until_lane(None, "response.steer.failed")
            assert failed["error"]["code"] == "steering_not_supported"


async def test_prototype_a_steer_resumes_the_same_response_with_the_message(
    start_server: StartServer,
) -> None:
    running = await start_server(LONG_THEN_SHORT, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.prototype_url) as raw:
            client = Checked(raw, "prototype")
            await client.send(create(tools=[]))
            events = await client.until_lane(None, "response.output_text.delta")
            rid = events[0]["response"]["id"]
            await client.send(steer(rid))
            events += await client.until_lane(None, *END)
            client.checker.finish()
    names = kinds(events)
    assert "response.incomplete" not in names
    assert names.count("response.created") == 1  # one Response for the whole rollout
    cut = names.index("response.steer.accepted")
    assert names[cut:].count("response.in_progress") == 1  # the commit point
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["id"] == rid
    assert [m["status"] for m in final["output"]] == ["incomplete", "completed"]
    assert final["output"][1]["content"][0]["text"] == "Tabs it is."


async def test_prototype_a_steer_while_suspended_waits_for_the_append(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.prototype_url) as raw:
            client = Checked(raw, "prototype")
            await client.send(create())
            events = await client.until_lane(None, "response.done")
            rid = events[0]["response"]["id"]
            await client.send(steer(rid, [{"role": "user", "content": "Check b.py too."}]))
            steered = await client.until_lane(None, "response.steer.pending")
            assert kinds(steered)[-2:] == ["response.steer.accepted", "response.steer.pending"]
            required = steered[-1]["required_input"]
            assert [r["call_id"] for r in required] == [a["call_id"] for a in answers(events)]
            await client.send({"type": "response.append", "input": answers(events)})
            resumed = await client.until_lane(None, "response.done")
            client.checker.finish()
    assert resumed[0]["type"] == "response.in_progress"


#: A call, then a second whose arguments stream for about a second: a steer sent once the
#: first is done is queued (a call awaits output, so it is not due) until the segment ends.
CALL_THEN_SLOW_CALL = {
    "segments": [
        {
            "tool_calls": [
                {"name": "exec_command", "arguments": {"cmd": "ls"}},
                {"name": "exec_command", "arguments": {"cmd": "grep -rn word " * 40}},
            ]
        },
        {"text": "Done."},
    ]
}


class UnwritableStore(CheckpointStore):
    """A store that reads but cannot write, as a full disk would."""

    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        raise StoreUnavailable("The response store failed (disk full), so it was lost.")


async def test_a_response_the_store_cannot_take_fails_with_its_queued_steer_returned(
    start_server: StartServer,
) -> None:
    """It completes with a steer waiting for the call's output, then cannot be stored: the
    client hears `response.failed` and the steer back, and the connection goes on."""
    slow = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=100)
    running = await start_server(CALL_THEN_SLOW_CALL, timing=slow, store=UnwritableStore())
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(store=True))
            events = await client.until_lane(None, "response.function_call_arguments.done")
            await client.send(steer(events[0]["response"]["id"]))
            events += await client.until_lane(None, "response.steer.failed")
            await client.send(launched_create(store=False))
            after = await client.until_lane(None, *END)
            client.checker.finish()
    names = kinds(events)
    assert "response.completed" not in names
    assert names[-2:] == ["response.failed", "response.steer.failed"]
    assert names.index("response.steer.accepted") < names.index("response.failed")
    assert events[-2]["response"]["error"]["code"] == "store_unavailable"
    assert events[-1]["error"]["code"] == "successor_creation_failed"
    assert events[-1]["steer"]["input"] == "Use tabs, not spaces."
    assert after[0]["type"] == "response.created"  # nothing more came of the failed one
    assert after[-1]["type"] == "response.completed"
    assert running.server.crashed_connections == 0


class FencingStore(SQLiteStore):
    """A store in which every suspension is found already resumed elsewhere."""

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        raise SuspensionLost(suspended.response.id)


async def test_prototype_a_lost_suspension_fails_the_response_and_its_pending_steer(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Suspended with a steer queued, its suspension is fenced off by another resumer: the
    Response fails, the steer comes back, and nobody hears of a pending steer or a wait."""
    slow = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=100)
    store = FencingStore(tmp_path / "responses.sqlite3")
    running = await start_server(CALL_THEN_SLOW_CALL, timing=slow, store=store)
    with trio.fail_after(20):
        async with connect(running.prototype_url) as raw:
            client = Checked(raw, "prototype")
            await client.send(create(store=True))
            events = await client.until_lane(None, "response.function_call_arguments.done")
            await client.send(steer(events[0]["response"]["id"]))
            events += await client.until_lane(None, "response.steer.failed")
            await client.send(create(store=False))
            after = await client.until_lane(None, "response.done")
            client.checker.finish()
    names = kinds(events)
    assert "response.done" not in names and "response.steer.pending" not in names
    assert names[-2:] == ["response.failed", "response.steer.failed"]
    assert events[-2]["response"]["error"]["code"] == "response_resumed_elsewhere"
    assert events[-1]["steer"]["input"] == "Use tabs, not spaces."
    assert after[-1]["type"] == "response.done"  # the next rollout suspends as usual
    assert running.server.crashed_connections == 0


async def test_a_flood_of_big_steers_is_refused_by_the_memory_budget_and_every_lane_lives(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pending steers count against the connection's budget from the moment they wait until
    they are taken: past it, each is `response.steer.failed` with the budget's own code, its
    input back, and its lane goes on. Before, 8 per lane waited uncharged (3.8 GB held under
    256 MiB)."""
    children: list[MemoryBudget] = []
    child = MemoryBudget.child

    def recorded(self: MemoryBudget, limit: int, *, flag: str, name: str) -> MemoryBudget:
        children.append(child(self, limit, flag=flag, name=name))
        return children[-1]

    monkeypatch.setattr(MemoryBudget, "child", recorded)
    running = await start_server(
        THREE_SEGMENTS, store=CheckpointStore(), max_connection_memory_bytes=2 * MiB
    )
    big = "word " * 60_000  # about 300 KB held each: 32 of them would be 9.6 MB
    lanes = [f"l{i}" for i in range(4)]
    with trio.fail_after(30):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            rids, calls = {}, {}
            for lane in lanes:
                await client.send(launched_create(stream_id=lane, store=True))
                events = await client.until_lane(lane, "response.completed")
                rids[lane], calls[lane] = events[0]["response"]["id"], answers(events)
            (budget,) = children
            codes: list[str] = []
            accepted = 0
            for lane in lanes:
                for _ in range(9):
                    await client.send(steer(rids[lane], big))
                    (*_, answer) = await client.until_lane(
                        lane, "response.steer.pending", "response.steer.failed"
                    )
                    if answer["type"] == "response.steer.failed":
                        assert answer["steer"]["input"] == big
                        codes.append(answer["error"]["code"])
                    else:
                        accepted += 1
            assert budget.used > MiB  # what waits is counted
            for lane in lanes:  # each lane lives: a steer that fits waits as any other
                await client.send(steer(rids[lane], "short"))
                await client.until_lane(lane, "response.steer.pending")
            # the last lane's outputs' create takes its steers (served from the store where
            # the budget let the lane's idle cache go to make room for the big ones)
            last = lanes[-1]
            await client.send(
                launched_create(stream_id=last, previous_response_id=rids[last],
                                input=calls[last], store=True)
            )  # fmt: skip
            done = await client.until_lane(last, "response.completed", "error")
            assert done[-1]["type"] == "response.completed", done[-1]
            assert budget.peak <= budget.limit
        await running.server.wait_idle()
    assert accepted >= 1
    assert codes and set(codes) == {"connection_memory_limit"}, codes
    assert budget.used == 0 and running.server.responses.memory.used == 0
