"""Lanes (`stream_id`): FIFO per lane, lanes concurrent on one socket, events echo their lane
and are numbered per lane, forks across lanes, the limits; in both dialects."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.testing import WireClient

from ..support.clients import BETA, END, Checked, connect, until_lane
from ..support.frames import THREE_SEGMENTS, answers, create, launched_create
from ..support.servers import FAST, StartServer
from ..support.stores import CheckpointStore

SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=200)
TWO_WORDS = {"segments": [{"text": "one two"}]}


def lanes(events: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    by_lane: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_lane[event.get("stream_id")].append(event)
    return by_lane


async def until_each(client: WireClient, *names: str | None) -> dict[str | None, dict[str, Any]]:
    """The next end (terminal or error) of each lane in `names`, in whatever order they come."""
    ends: dict[str | None, dict[str, Any]] = {}
    while len(ends) < len(names):
        event = await client.receive()
        lane = event.get("stream_id")
        if lane in names and lane not in ends and event["type"] in (*END, "response.cancelled"):
            ends[lane] = event
    return ends


async def test_two_lanes_stream_concurrently_each_numbered_from_zero(
    start_server: StartServer,
) -> None:
    # about a second of decoding per Response: a lane's create is served long before it ends
    running = await start_server({"segments": [{"text": "word " * 200}]}, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(stream_id="a"))
            await client.send(launched_create(stream_id="b"))
            await client.send(launched_create())  # the default lane
            events: list[dict[str, Any]] = []
            for lane in ("a", "b", None):  # whichever ends first: wait for each lane's end
                if not any(e["type"] in END and e.get("stream_id") == lane for e in events):
                    events += await client.until_lane(lane, *END)
            client.checker.finish()
    by_lane = lanes(events)
    assert set(by_lane) == {"a", "b", None}
    for lane, own in by_lane.items():
        assert [e["sequence_number"] for e in own] == list(range(len(own))), lane
        assert own[0]["type"] == "response.created"
        assert own[-1]["type"] == "response.completed"
    # concurrent: lane b's Response began before lane a's ended
    order = [(e.get("stream_id"), e["type"]) for e in events]
    assert order.index(("b", "response.created")) < order.index(("a", "response.completed"))
    ids = {lane: own[0]["response"]["id"] for lane, own in by_lane.items()}
    assert len(set(ids.values())) == 3


async def test_creates_on_one_lane_queue_in_order_and_say_so(start_server: StartServer) -> None:
    running = await start_server({"segments": [{"text": "word " * 100}]}, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(tools=[], stream_id="x"))
            await client.send(launched_create(tools=[], input="second", stream_id="x"))
            events = await client.until_lane("x", "response.queued")
            queued = events[-1]["response"]
            assert queued["status"] == "queued"
            events += await client.until_lane("x", "response.completed")
            events += await client.until_lane("x", "response.completed")
            client.checker.finish()
    kinds = [
        (e["type"], e["response"]["id"])
        for e in events
        if e["type"] not in ("response.in_progress", "response.queued") and "response" in e
    ]
    first = kinds[0][1]
    assert kinds == [
        ("response.created", first),
        ("response.completed", first),
        ("response.created", queued["id"]),  # the id the queued event announced
        ("response.completed", queued["id"]),
    ]
    # it was queued (at once, when it arrived) before the one ahead of it ended
    order = [e["type"] for e in events]
    assert order.index("response.queued") < order.index("response.completed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_fork_starts_from_another_lanes_response_which_stays_warm(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as raw:
            client = Checked(raw)
            await client.send(launched_create(stream_id="main"))
            first = await client.until_lane("main", *END)
            parent = first[-1]["response"]["id"]
            outputs = answers(first)
            # the fork: a new lane, lineage from the main lane's Response (store off: not the store)
            await client.send(
                launched_create(stream_id="fork", previous_response_id=parent, input=outputs)
            )
            forked = await client.until_lane("fork", *END)
            # the main lane goes on from the same parent, still warm
            await client.send(
                launched_create(stream_id="main", previous_response_id=parent, input=outputs)
            )
            main = await client.until_lane("main", *END)
            client.checker.finish()
    for events in (forked, main):
        response = events[-1]["response"]
        assert events[-1]["type"] == "response.completed", events[-1]
        assert response["previous_response_id"] == parent
        assert [i["type"] for i in response["output"]] == ["function_call", "function_call"]
    assert [t.source for t in running.server.responses.turns] == ["fresh", "fork", "cache"]
    assert running.server.responses.turns[-1].cached_tokens > 0


async def test_a_failed_fork_keeps_the_parent_warm_on_its_lane(start_server: StartServer) -> None:
    # one tool segment, nothing after it: any continuation fails with script_error
    running = await start_server({"segments": [THREE_SEGMENTS["segments"][0]]})
    async with connect(running.address.ws_url) as client:
        await client.send(launched_create(stream_id="main"))
        first = await until_lane(client, "main", *END)
        parent = first[-1]["response"]["id"]
        outputs = answers(first)
        await client.send(
            launched_create(stream_id="fork", previous_response_id=parent, input=outputs)
        )
        forked = await until_lane(client, "fork", *END)
        assert forked[-1]["type"] == "response.failed"
        assert forked[-1]["stream_id"] == "fork"
        await client.send(
            launched_create(stream_id="main", previous_response_id=parent, input=outputs)
        )
        await until_lane(client, "main", *END)
        # a missing parent is refused on the lane that named it
        await client.send(launched_create(stream_id="fork", previous_response_id="resp_nowhere"))
        refused = await until_lane(client, "fork", *END)
        assert refused[-1]["error"]["code"] == "previous_response_not_found"
    # the failed fork left the parent on its lane: the main lane's turn was served warm
    assert [t.source for t in running.server.responses.turns] == ["fresh", "fork", "cache"]


async def test_lane_limits_and_names_are_typed_errors_on_their_lane(
    start_server: StartServer,
) -> None:
    running = await start_server(TWO_WORDS, timing=SLOW, max_lanes=1, max_queued_requests=1)
    async with connect(running.address.ws_url) as client:
        await client.send(launched_create(tools=[], stream_id="bad lane!"))
        bad = await client.receive()
        assert (bad["type"], bad["error"]["code"], bad["error"]["param"]) == (
            "error", "invalid_stream_id", "stream_id"
        )  # fmt: skip
        assert "stream_id" not in bad  # not a valid lane: the default lane says so
        await client.send(launched_create(tools=[], stream_id="one"))
        await client.send(
            launched_create(tools=[], stream_id="two")
        )  # a second named lane: too many
        refused = await until_lane(client, "two", "error")
        assert refused[-1]["error"]["code"] == "websocket_stream_limit_reached"
        assert "--max-lanes" in refused[-1]["error"]["message"]
        await client.send(launched_create(tools=[], stream_id="one", input="2nd"))  # waits: queued
        await client.send(launched_create(tools=[], stream_id="one", input="3rd"))  # past the queue
        full = await until_lane(client, "one", "error")
        assert full[-1]["error"]["code"] == "concurrent_request"
        await client.send(launched_create(tools=[]))  # the default lane is not counted, nor queued
        default = await until_lane(client, None, "response.completed")
        assert default[-1]["type"] == "response.completed"
        seen = refused + full + default
        while sum(e.get("stream_id") == "one" and e["type"] in END for e in seen) < 2:
            seen += await until_lane(client, "one", "response.completed")
    assert sum(e["type"] == "response.queued" for e in seen) == 1


async def test_prototype_lanes_each_hold_a_suspended_response(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.prototype_url) as raw:
            client = Checked(raw, "prototype")
            await client.send(create(stream_id="a"))
            await client.send(create(stream_id="b"))
            a = await client.until_lane("a", "response.done")
            b = (
                []
                if any(e.get("stream_id") == "b" and e["type"] == "response.done" for e in a)
                else (await client.until_lane("b", "response.done"))
            )
            # a second create on a lane whose Response is open is refused, on that lane
            await client.send(create(stream_id="a"))
            refused = await client.until_lane("a", "error")
            assert refused[-1]["error"]["code"] == "concurrent_request"
            everything = a + b + refused
            for lane in ("a", "b"):
                calls = answers(lanes(everything)[lane])
                while True:
                    await client.send(
                        {"type": "response.append", "stream_id": lane, "input": calls}
                    )
                    more = await client.until_lane(lane, "response.done", *END)
                    everything += more
                    if more[-1]["type"] != "response.done":
                        break
                    calls = answers(more)
                assert more[-1]["type"] == "response.completed"
            client.checker.finish()
    by_lane = lanes(everything)
    for lane in ("a", "b"):
        own = by_lane[lane]
        assert [e["sequence_number"] for e in own] == list(range(len(own)))
        ids = {e["response"]["id"] for e in own if "response" in e}
        assert len(ids) == 1  # ONE Response per lane's rollout


async def test_each_lanes_warm_cache_is_charged_and_the_idlest_let_go_under_pressure(
    start_server: StartServer,
) -> None:
    script = {"segments": [{"text": "one two"}, {"text": "three"}]}
    running = await start_server(script, max_connection_memory_bytes=1024 * 1024)
    big = "lorem ipsum " * 12_000  # ~140 KB of text, ~240 KB held once rendered
    async with connect(running.address.ws_url, max_message_size=4 * 1024 * 1024) as client:
        ids = {}
        for lane in ("a", "b"):
            await client.send(launched_create(tools=[], stream_id=lane, input=big))
            ended = await until_lane(client, lane, *END)
            assert ended[-1]["type"] == "response.completed", ended[-1]
            ids[lane] = ended[-1]["response"]["id"]
        held = running.server.responses.memory.used
        assert held > 2 * len(big)  # both lanes' rollouts are kept warm, and counted
        # a third lane needs three times that: the idlest lane's cache (a's) is let go, b's stays
        await client.send(launched_create(tools=[], stream_id="c", input=big * 3))
        third = await until_lane(client, "c", *END)
        assert third[-1]["type"] == "response.completed", third[-1]
        for lane in ("a", "b"):
            frame = launched_create(
                tools=[], stream_id=lane, previous_response_id=ids[lane], input="more"
            )
            await client.send(frame)
        ends = await until_each(client, "a", "b")
    assert ends["a"]["error"]["code"] == "previous_response_not_found"  # evicted; store: false
    assert ends["b"]["type"] == "response.completed"
    assert running.server.responses.turns[-1].source == "cache"


def inject(response_id: str, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "response.inject", "response_id": response_id, "input": outputs}


async def test_prototype_inject_resumes_the_response_it_names_on_its_lane(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.prototype_url, **BETA) as raw:
            client = Checked(raw, "prototype")
            await client.send(create(stream_id="p"))
            first = await client.until_lane("p", "response.done")
            rid = first[0]["response"]["id"]
            wrong = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
            await client.send(inject(rid, wrong))
            refused = await client.until_lane("p", "error")
            assert refused[-1]["error"]["code"] == "unknown_call_id"
            events = first
            while events[-1]["type"] == "response.done":
                await client.send(inject(rid, answers(events)))
                events = await client.until_lane("p", "response.done", *END)
                assert events[0]["type"] == "response.inject.created"
                assert events[1]["type"] == "response.in_progress"
            assert events[-1]["type"] == "response.completed"
            assert events[-1]["response"]["id"] == rid
            client.checker.finish()


async def to_the_second_segments_first_call(
    client: Checked,
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """A multi-agent THREE_SEGMENTS rollout up to segment 2's first call, which still
    streams: segment 1's one call was injected at once. Its id, segment 1's events and
    segment 2's so far."""
    await client.send(launched_create(multi_agent={"enabled": True}))
    events = await client.until_lane(None, "response.output_item.done")
    events += await client.until_lane(None, "response.output_item.done")
    rid = events[0]["response"]["id"]
    await client.send(inject(rid, answers(events)))
    events += await client.until_lane(None, "response.inject.created")
    more = await client.until_lane(None, "response.output_item.done")
    while more[-1]["item"]["type"] != "function_call":
        more += await client.until_lane(None, "response.output_item.done")
    return rid, events, more


async def test_an_inject_while_the_segment_streams_is_held_until_it_ends(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, timing=TimingModel(decode_tokens_per_s=50))
    with trio.fail_after(30):
        async with connect(running.address.ws_url, **BETA) as raw:
            client = Checked(raw)
            rid, events, more = await to_the_second_segments_first_call(client)
            # segment 2 calls two tools; answer the first while the second still streams
            await client.send(inject(rid, answers(more)))
            more += await client.until_lane(None, "response.inject.created")
            assert not any(e["type"] == "response.in_progress" for e in more[1:])
            done = [e for e in more if e["type"] == "response.output_item.done"]
            assert len(done) == 1  # committed while the segment's second call was yet to end
            rest = await client.until_lane(None, "response.output_item.done")
            last = [e for e in rest if e["type"] == "response.output_item.done"]
            await client.send(inject(rid, answers(last)))
            rest += await client.until_lane(None, *END)
            client.checker.finish()
    assert rest[-1]["type"] == "response.completed"
    assert [i["type"] for i in rest[-1]["response"]["output"]] == [
        "message", "function_call", "function_call", "function_call", "message"
    ]  # fmt: skip
    assert "response.done" not in [e["type"] for e in events + more + rest]


async def test_outputs_held_for_a_streaming_segment_count_against_the_memory_budget(
    start_server: StartServer,
) -> None:
    """An inject while the segment that made the call streams is held until it ends; what it
    holds is charged from the moment it is committed, once (not again when it joins)."""
    running = await start_server(THREE_SEGMENTS, timing=TimingModel(decode_tokens_per_s=50))
    big = "lorem ipsum " * 10_000  # ~120 KB of output, more once rendered
    memory = running.server.responses.memory
    with trio.fail_after(30):
        async with connect(running.address.ws_url, **BETA) as raw:
            client = Checked(raw)
            rid, _, more = await to_the_second_segments_first_call(client)
            before = memory.used
            (first,) = answers(more)
            await client.send(inject(rid, [{**first, "output": big}]))
            more += await client.until_lane(None, "response.inject.created")
            held = memory.used - before
            assert not any(e["type"] == "response.in_progress" for e in more[1:])  # still held
            assert held >= len(big), (held, len(big))
            rest = await client.until_lane(None, "response.output_item.done")
            last = [e for e in rest if e["type"] == "response.output_item.done"]
            await client.send(inject(rid, answers(last)))
            rest += await client.until_lane(None, *END)
            joined = memory.used - before
            client.checker.finish()
    assert rest[-1]["type"] == "response.completed"
    assert len(big) <= joined < 2 * held  # in the conversation now, and counted once


async def test_inject_is_refused_without_the_beta_and_after_the_end(
    start_server: StartServer,
) -> None:
    running = await start_server({"segments": [{"text": "done"}]})
    async with connect(running.address.ws_url) as client:
        await client.send(inject("resp_x", []))
        refused = await client.receive()
        assert refused["error"]["code"] == "unknown_event_type"
        assert "responses_multi_agent=v1" in refused["error"]["message"]
        await client.send(launched_create(tools=[], multi_agent={"enabled": True}))
        refused = await client.receive()
        assert (refused["error"]["code"], refused["error"]["param"]) == (
            "invalid_field", "multi_agent"
        )  # fmt: skip
    async with connect(running.address.ws_url, **BETA) as client:
        await client.send(launched_create(tools=[], stream_id="s", multi_agent={"enabled": True}))
        ended = await until_lane(client, "s", *END)
        rid = ended[-1]["response"]["id"]
        outputs = [{"type": "function_call_output", "call_id": "call_1", "output": "late"}]
        await client.send(inject(rid, outputs))
        late = await client.receive()
        assert (late["type"], late["error"]["code"], late["stream_id"]) == (
            "response.inject.failed", "response_already_completed", "s"
        )  # fmt: skip
        assert late["input"] == outputs
        await client.send(inject("resp_unknown", outputs))
        unknown = await client.receive()
        assert (unknown["type"], unknown["error"]["code"]) == (
            "response.inject.failed", "response_not_found"
        )  # fmt: skip
        assert "stream_id" not in unknown


class GatedSession:
    """A simulated session whose segment, once said, waits at `gate` before it returns: the
    Response has suspended, its sampling loop is not yet waiting."""

    def __init__(self, inner: Any, gate: trio.Event) -> None:
        self._inner = inner
        self._gate = gate

    async def generate(self, send: Any, limits: Any) -> None:
        await self._inner.generate(send, limits)
        await self._gate.wait()

    async def prefill(self) -> Any:
        return await self._inner.prefill()

    async def aclose(self) -> None:
        await self._inner.aclose()


class GatedGenerator:
    """The simulated GPU, its sessions gated (above)."""

    def __init__(self, inner: SimulatedGenerator, gate: trio.Event) -> None:
        self._inner = inner
        self._gate = gate
        self.renderer = inner.renderer
        self.forces_tool_calls = inner.forces_tool_calls

    def open_session(
        self, conversation: Any, *, cache_salt: str | None = None, affinity: str | None = None
    ) -> GatedSession:
        return GatedSession(
            self._inner.open_session(conversation, cache_salt=cache_salt), self._gate
        )


async def test_outputs_that_come_as_the_segment_ends_still_resume_it_announced(
    nursery: trio.Nursery,
) -> None:
    """The race of the beta (no response.done to wait for): the last call's output arrives
    after the Response suspended but before its loop waits. It must resume, saying so."""
    gate = trio.Event()
    generator = GatedGenerator(SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST), gate)
    server = ProtoServer(generator, ServerConfig(port=0))  # type: ignore[arg-type]
    address = await nursery.start(server.serve)
    with trio.fail_after(20):
        async with connect(address.ws_url, **BETA) as raw:
            client = Checked(raw)
            await client.send(launched_create(multi_agent={"enabled": True}))
            events = await client.until_lane(None, "response.output_item.done")
            events += await client.until_lane(None, "response.output_item.done")
            await trio.testing.wait_all_tasks_blocked()  # suspended; the loop waits at the gate
            await client.send(inject(events[0]["response"]["id"], answers(events)))
            events += await client.until_lane(None, "response.inject.created")
            gate.set()
            more = await client.until_lane(None, "response.output_item.added")
    assert more[0]["type"] == "response.in_progress"


async def test_a_client_that_vanishes_mid_lanes_leaves_nothing_behind(
    start_server: StartServer,
) -> None:
    running = await start_server({"segments": [{"text": "word " * 100}]}, timing=SLOW)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            for lane in ("a", "b", "c"):
                await client.send(launched_create(tools=[], stream_id=lane))
            await client.send(launched_create(tools=[], stream_id="a", input="queued"))
            await client.send(
                launched_create(tools=[], stream_id="d", input="short", max_output_tokens=1)
            )
            await until_lane(client, "d", *END)  # lane d's Response is cached, the rest stream
            await until_lane(client, "a", "response.output_text.delta")
            await client.vanish()  # no close frame: the TCP just drops
        await running.server.wait_idle()  # every lane's rollout, cached or streaming, released
    assert running.server.responses.memory.used == 0


async def test_a_stopping_server_ends_what_waits_on_a_lane_rather_than_drop_it(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        {"segments": [{"text": "word " * 1000}]},
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10),
        store=CheckpointStore(),
    )
    async with connect(running.address.ws_url) as raw, trio.open_nursery() as nursery:
        client = Checked(raw)
        await client.send(launched_create(tools=[], stream_id="a"))
        await client.send(launched_create(tools=[], stream_id="a", input="next"))
        events = await client.until_lane("a", "response.queued")
        queued = events[-1]["response"]["id"]
        nursery.start_soon(running.server.shutdown, 2)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                events += await client.until_lane("a", *END)
    assert closed.value.reason.code == 1001
    ends = [(e["type"], e["response"]["id"]) for e in events if e["type"] in END]
    first = events[0]["response"]["id"] if events[0]["type"] == "response.created" else None
    assert [kind for kind, _ in ends] == ["response.incomplete", "response.incomplete"]
    assert ends[1][1] == queued != first
    reasons = {e["response"]["incomplete_details"]["reason"] for e in events if e["type"] in END}
    assert reasons == {"server_shutdown"}
    client.checker.finish(closed=True)


async def test_a_cancel_names_the_lane_whose_response_it_ends(start_server: StartServer) -> None:
    running = await start_server({"segments": [{"text": "word " * 100}]}, timing=SLOW)
    for url in (running.address.ws_url, running.prototype_url):
        with trio.fail_after(20):
            async with connect(url) as client:
                await client.send(launched_create(tools=[], stream_id="keep"))
                await client.send(launched_create(tools=[], stream_id="stop"))
                await until_lane(client, "stop", "response.output_text.delta")
                await client.send({"type": "response.cancel", "stream_id": "stop"})
                await client.send({"type": "response.cancel", "stream_id": "idle"})
                ends = await until_each(client, "keep", "stop", "idle")
        assert ends["stop"]["type"] == "response.cancelled"
        assert ends["keep"]["type"] == "response.completed"
        assert ends["idle"]["error"]["code"] == "no_open_response"


async def test_a_lanes_new_last_response_replaces_the_one_it_kept(
    start_server: StartServer,
) -> None:
    """A fork onto a lane that kept a Response, or a turn rebuilt from the store, becomes the
    lane's last: the rollout it replaces is closed, not left open and uncounted."""
    script = {"segments": [{"text": "one"}, {"text": "two"}]}
    running = await start_server(script, store=CheckpointStore())
    server = running.server
    async with connect(running.address.ws_url) as client:
        for lane in ("a", "b"):
            await client.send(launched_create(tools=[], stream_id=lane))
            await until_lane(client, lane, *END)
        ends = [e for e in client.received if e["type"] == "response.completed"]
        b_id = ends[1]["response"]["id"]
        assert server.open_rollouts == 2  # each lane keeps its last
        await client.send(
            launched_create(tools=[], stream_id="a", previous_response_id=b_id, input="go")
        )
        forked = await until_lane(client, "a", *END)
        assert forked[-1]["type"] == "response.completed"
        assert server.responses.turns[-1].source == "fork"
        assert server.open_rollouts == 2  # a's new last replaced its old one; b's stays
        # the default lane: its last Response, then a turn rebuilt from the store
        await client.send(launched_create(tools=[], store=True))
        stored = (await until_lane(client, None, *END))[-1]["response"]["id"]
        await client.send(launched_create(tools=[], input="another"))
        await until_lane(client, None, *END)
        await client.send(
            launched_create(tools=[], store=True, previous_response_id=stored, input="go")
        )
        await until_lane(client, None, *END)
        assert server.responses.turns[-1].source == "store"
        assert server.open_rollouts == 3
    await server.wait_idle()
