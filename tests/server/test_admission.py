"""Admission by KV capacity on a live server (server/rollouts/admission.py over
core/scheduler.py): a key's many rollouts do not starve another key's one; a suspended
rollout keeps its place for the TTL and resumes at once, then yields it; a waiter can be
cancelled, gives up its place when its client goes, and is bounded by --admission-timeout;
the engine is told resumed rollouts first. On the autojump clock, so the waits cost no real time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import pytest
import trio
import trio.testing

from proto_server.cli import key_weights
from proto_server.core.admission_queue import State
from proto_server.core.conversation import Conversation
from proto_server.core.scheduler import Scheduler
from proto_server.engine.base import GeneratorSession
from proto_server.engine.chunks import Chunk
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.script import ScriptedCall, Segment, parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.engine.vllm import completion_request, parse_kv_capacity
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.rollouts.admission import Admission
from proto_server.server.store import SQLiteStore, owner_id

from ..support.clients import connect, turn
from ..support.frames import (
    THREE_SEGMENTS,
    USER,
    answers,
    body,
    create,
    launched_create,
    prefix_tokens,
)
from ..support.frames import tokens as tokens_of
from ..support.servers import FAST, StartServer
from ..support.stores import CheckpointStore


def sample(name: str) -> float:
    """A metric of this process, read in place: a scrape renders on a worker thread, which the
    autojump clock takes for idle."""
    return prometheus_client.REGISTRY.get_sample_value(name) or 0.0


K1 = {"Authorization": "Bearer k1"}
K2 = {"Authorization": "Bearer k2"}
TEXT = {"segments": [{"text": "word " * 400}]}  # 8 s at 50 tokens/s
SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50)


async def test_another_keys_rollout_goes_before_most_of_a_busy_keys_waiting_ones(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    # a capacity of one token: every rollout is larger than the cache, so one runs at a time
    running = await start_server(
        TEXT, timing=SLOW, store=CheckpointStore(), api_keys=("k1", "k2"), kv_capacity_tokens=1
    )
    url = f"{running.address.http_url}/responses"
    scheduler = running.server.responses.admission.scheduler  # type: ignore[union-attr]
    done: list[str] = []

    async def post(headers: dict[str, str], name: str) -> None:
        answer = await http.post(url, json=body(tools=[], store=False), headers=headers)
        assert answer.status_code == 200 and answer.json()["status"] == "completed"
        done.append(name)

    with trio.fail_after(120):
        async with httpx.AsyncClient(timeout=None) as http, trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(post, K1, f"k1-{i}")
            for _ in range(1000):  # until k1's six are in: one streams, five wait
                if scheduler.waiting == 5:
                    break
                await trio.sleep(0.01)
            assert sample("proto_server_waiting_rollouts") == 5
            assert sample("proto_server_admitted_rollouts") == 1
            nursery.start_soon(post, K2, "k2")
    # k2 holds nothing, nor does k1 once its first ends, but k1 was served last: k2 is next
    assert done.index("k2") == 1, done


class Loops:
    """Key a's rollouts call a tool at every segment, for ever; b's (instructions "b") call
    one twice, then answer."""

    CALL = Segment(tool_calls=(ScriptedCall(name="exec_command", arguments='{"cmd": "ls"}'),))

    def plan(self, conversation: Conversation, limits: GenerationLimits) -> Segment:
        if conversation.instructions == "b" and conversation.model_segments >= 2:
            return Segment(text="done")
        return self.CALL


@pytest.mark.parametrize("loops", [1, 4])
async def test_a_key_whose_tools_always_come_back_in_time_does_not_starve_another_key(
    start_server: StartServer, autojump_clock: trio.testing.MockClock, loops: int
) -> None:
    """Key k1's loops fill the cache (one loop on a one-token cache, or four on a cache that
    holds four and a half of them as they start, which they outgrow as they loop) and their
    tools always come back within --admission-ttl, so no place ever lapses. Key k2's rollout
    is admitted within one suspension of each of k1's and completes, while k1's loops go on;
    it used to wait out --admission-timeout."""
    size = prefix_tokens() + tokens_of([USER])
    capacity = 1 if loops == 1 else loops * size + size // 2
    running = await start_server(
        planner=Loops(),
        store=CheckpointStore(),
        api_keys=("k1", "k2"),
        kv_capacity_tokens=capacity,
        kv_target_fill=1.0,
        admission_ttl_s=10,
        admission_timeout_s=20,
    )
    scheduler = running.server.responses.admission.scheduler  # type: ignore[union-attr]
    turns = [0]  # k1's segments done, all loops together

    async def loop() -> None:
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            await client.send(create())
            while True:
                events = await client.segment()
                assert events[-1]["type"] == "response.done", events[-1]
                turns[0] += 1
                await trio.sleep(0.5)  # the tool: well within the TTL
                await client.send({"type": "response.append", "input": answers(events)})

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for _ in range(loops):
                nursery.start_soon(loop)
            await trio.sleep(2)
            assert (scheduler.admitted, scheduler.waiting) == (1 if loops == 1 else loops, 0)
            async with connect(
                running.prototype_url, event_timeout_s=60, Authorization="Bearer k2"
            ) as client:
                await client.send(create(instructions="b"))
                await client.until("response.in_progress")
                asked = turns[0]
                events = await client.segment()
                assert events[-1]["type"] == "response.done", events[-1]  # admitted, in time
                waited = turns[0] - asked
                for _ in range(2):
                    await trio.sleep(0.5)
                    await client.send({"type": "response.append", "input": answers(events)})
                    events = await client.until("response.done", "response.completed")
                assert events[-1]["type"] == "response.completed", events[-1]
            done = turns[0]
            await trio.sleep(5)
            assert turns[0] > done  # k1 goes on
            nursery.cancel_scope.cancel()
    assert waited <= loops, waited  # one suspension of each of k1's rollouts at most
    assert sample("proto_server_admission_reclaims_total") >= 1


async def test_a_suspended_rollout_keeps_its_place_for_the_ttl_then_yields_it(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        THREE_SEGMENTS, store=CheckpointStore(), kv_capacity_tokens=1, admission_ttl_s=5
    )
    with trio.fail_after(60):
        async with connect(running.prototype_url) as first, connect(running.prototype_url) as other:
            await first.send(create())
            one = await first.segment()  # admitted, now suspended on its tool
            await other.send(create())
            head = [await other.receive(), await other.receive()]
            assert [e["type"] for e in head] == ["response.created", "response.in_progress"]
            with trio.move_on_after(2):  # it waits: the first keeps its place
                event = await other.receive()
                raise AssertionError(f"a waiting rollout streamed: {event}")
            resumed_at = trio.current_time()
            await first.send({"type": "response.append", "input": answers(one)})
            two = await first.segment()  # resident: at once, though another waits
            assert trio.current_time() - resumed_at < 1
            before = sample("proto_server_admission_demotions_total")
            started = await other.segment()  # once the first's place lapses
            assert trio.current_time() - resumed_at >= 5
            assert sample("proto_server_admission_demotions_total") == before + 1
            assert started[-1]["type"] == "response.done"
            # the first, demoted, comes back: it waits like a new one, for the other's TTL
            back_at = trio.current_time()
            await first.send({"type": "response.append", "input": answers(two)})
            three = await first.until("response.completed")
            assert trio.current_time() - back_at >= 5
            assert three[-1]["response"]["status"] == "completed"


async def test_a_place_can_be_kept_a_multiple_of_the_median_time_away(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """--admission-ttl-median 2: once 16 rollouts came back from tools of about a second, a
    suspended rollout keeps its place 2 s (the gauge says so), not --admission-ttl's 30."""
    running = await start_server(
        THREE_SEGMENTS,
        store=CheckpointStore(),
        kv_capacity_tokens=1,
        admission_ttl_s=30,
        admission_ttl_median=2,
    )
    with trio.fail_after(600):
        assert sample("proto_server_admission_ttl_seconds") == 30
        for _ in range(8):  # two tool waits of 1 s each: 16 times away
            async with connect(running.prototype_url) as client:
                await client.send(create())
                events = await client.segment()
                for _ in range(2):
                    await trio.sleep(1)
                    await client.send({"type": "response.append", "input": answers(events)})
                    events = await client.until("response.done", "response.completed")
        assert sample("proto_server_admission_ttl_seconds") == 2
        async with connect(running.prototype_url) as first, connect(running.prototype_url) as other:
            await first.send(create())
            await first.segment()  # admitted, now suspended on its tool
            suspended_at = trio.current_time()
            await other.send(create())
            started = await other.segment()  # once the first's place lapses: 2 s, not 30
            assert 2 <= trio.current_time() - suspended_at < 5
            assert started[-1]["type"] == "response.done"


async def test_a_launched_chain_keeps_its_place_between_turns(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """Launched: the rollout a connection keeps for its next turn holds its place for the TTL
    as a suspended prototype Response does; its next turn goes at once, a newcomer waits."""
    running = await start_server(
        THREE_SEGMENTS, store=CheckpointStore(), kv_capacity_tokens=1, admission_ttl_s=5
    )
    url = running.address.ws_url
    with trio.fail_after(60):
        async with connect(url) as first, connect(url) as other:
            one = await turn(first, launched_create())
            assert one[-1]["type"] == "response.completed"
            await other.send(launched_create())
            await other.until("response.in_progress")
            await trio.sleep(1)
            chained_at = trio.current_time()
            follow_up = launched_create(
                previous_response_id=one[-1]["response"]["id"], input=answers(one)
            )
            two = await turn(first, follow_up)
            assert two[-1]["type"] == "response.completed"
            assert trio.current_time() - chained_at < 1  # from its cache, at once
            ended_at = trio.current_time()
            started = await other.until("response.completed")
            assert trio.current_time() - ended_at >= 5  # once the first's place lapsed
            assert started[-1]["response"]["status"] == "completed"


async def test_a_rollout_that_waits_behind_a_streaming_one_is_let_in_once_its_place_lapses(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """The waiter saw no suspended place to wait out (the other was streaming): it is told
    when one appears, so it waits the TTL, not its whole --admission-timeout."""
    running = await start_server(
        THREE_SEGMENTS,
        timing=SLOW,
        store=CheckpointStore(),
        kv_capacity_tokens=1,
        admission_ttl_s=5,
        admission_timeout_s=100,
    )
    with trio.fail_after(200):
        async with connect(running.prototype_url) as first, connect(running.prototype_url) as other:
            await first.send(create())
            await first.until("response.output_text.delta")  # streaming
            await other.send(create())
            await other.until("response.in_progress")
            await first.until("response.done")
            suspended_at = trio.current_time()
            started = await other.segment()
            assert started[-1]["type"] == "response.done"
            assert 5 <= trio.current_time() - suspended_at < 6


# the waiter whose client goes is kept for a reattach as long as --reattach-grace: with 0 it
# gives up its place at once, with 30 s once the grace lapses
@pytest.mark.parametrize("grace_s", [0.0, 30.0])
async def test_a_waiter_can_be_cancelled_and_one_whose_client_goes_gives_up_its_place(
    start_server: StartServer, autojump_clock: trio.testing.MockClock, grace_s: float
) -> None:
    running = await start_server(
        THREE_SEGMENTS,
        store=CheckpointStore(),
        kv_capacity_tokens=1,
        admission_ttl_s=1000,
        reattach_grace_s=grace_s,
    )
    scheduler = running.server.responses.admission.scheduler  # type: ignore[union-attr]
    with trio.fail_after(60):
        async with connect(running.prototype_url) as holder:
            await holder.send(create())
            await holder.segment()
            async with connect(running.prototype_url) as gone:
                await gone.send(create())
                await gone.until("response.in_progress")
                async with connect(running.prototype_url) as cancelled:
                    await cancelled.send(create())
                    await cancelled.until("response.in_progress")
                    await trio.sleep(0.1)
                    assert scheduler.waiting == 2
                    await cancelled.send({"type": "response.cancel"})
                    (end,) = await cancelled.until("response.cancelled")
                    assert end["response"]["status"] == "cancelled"
                    assert scheduler.waiting == 1
            await trio.sleep(0.1)  # `gone` closed its socket while it waited
            if grace_s:
                assert (scheduler.waiting, scheduler.admitted) == (1, 1)  # kept for a reattach
                await trio.sleep(grace_s)
            assert (scheduler.waiting, scheduler.admitted) == (0, 1)
        await trio.sleep(0.1)
        assert (scheduler.waiting, scheduler.admitted, scheduler.reserved) == (0, 0, 0)


async def test_a_rollout_that_waits_too_long_ends_incomplete(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        THREE_SEGMENTS,
        store=CheckpointStore(),
        kv_capacity_tokens=1,
        admission_ttl_s=1000,
        admission_timeout_s=3,
    )
    with trio.fail_after(60):
        async with connect(running.prototype_url) as holder, connect(running.prototype_url) as late:
            await holder.send(create())
            await holder.segment()
            await late.send(create())
            waited_from = trio.current_time()
            events = await late.until("response.incomplete")
            assert trio.current_time() - waited_from >= 3
            response = events[-1]["response"]
            assert response["incomplete_details"]["reason"] == "admission_timeout"
            # the one it waited behind is untouched
            assert running.server.responses.admission.scheduler.admitted == 1  # type: ignore[union-attr]


class Priorities:
    """A simulated generator whose sessions record the priority of each segment."""

    forces_tool_calls = True
    renderer = None

    def __init__(self) -> None:
        self.inner = SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST)
        self.seen: list[int | None] = []

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> Any:
        return Recorded(self.inner.open_session(conversation, cache_salt=cache_salt), self.seen)


class Recorded:
    def __init__(self, inner: GeneratorSession, seen: list[int | None]) -> None:
        self.inner, self.seen = inner, seen

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        self.seen.append(limits.priority)
        await self.inner.generate(send, limits)

    async def prefill(self) -> Any:
        return await self.inner.prefill()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_resumed_rollouts_are_sent_to_the_engine_first() -> None:
    for capacity in (0, 10_000):  # with admission off, and on without pressure
        generator = Priorities()
        config = ServerConfig(port=0, engine_priority=True, kv_capacity_tokens=capacity)
        server = ProtoServer(generator, config)  # type: ignore[arg-type]
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(server.serve)
                async with connect(f"{address.ws_url}?dialect=prototype") as client:
                    await client.send(create())
                    one = await client.segment()
                    await client.send({"type": "response.append", "input": answers(one)})
                    two = await client.segment()
                    await client.send({"type": "response.append", "input": answers(two)})
                    await client.until("response.completed")
                nursery.cancel_scope.cancel()
        assert generator.seen == [1, 0, 0], capacity


def test_the_engine_is_sent_the_priority_only_when_there_is_one() -> None:
    request = {"model": "m", "prompt": [1], "max_tokens": 1, "stop_token_ids": ()}
    sent = completion_request(**request, limits=GenerationLimits(priority=0))
    assert sent["priority"] == 0
    assert "priority" not in completion_request(**request, limits=GenerationLimits())


def test_key_weights_name_owner_ids() -> None:
    owner = owner_id("k1")
    assert key_weights([f"{owner}=3"]) == ((owner, 3.0),)
    for bad in ("k1=3", f"{owner}", f"{owner}=0", f"{owner}=x", f"{owner}=inf"):
        try:
            key_weights([bad])
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


async def test_without_a_capacity_there_is_no_admission() -> None:
    server = ProtoServer(SimulatedGenerator(DefaultModel(), FAST), ServerConfig(port=0))
    assert server.responses.admission is None


async def test_the_configured_capacity_fill_and_weights_are_what_is_scheduled() -> None:
    heavy = owner_id("k1")
    config = ServerConfig(
        port=0, api_keys=("k1", "k2"), kv_capacity_tokens=1000, key_weights=((heavy, 4.0),)
    )
    server = ProtoServer(SimulatedGenerator(DefaultModel(), FAST), config)
    scheduler = server.responses.admission.scheduler  # type: ignore[union-attr]
    assert scheduler.capacity == 900  # x --kv-target-fill 0.9
    scheduler.request("a", heavy, 400, now=0)
    scheduler.request("b", owner_id("k2"), 100, now=0)
    assert scheduler.share(heavy) == 100 == scheduler.share(owner_id("k2"))


async def test_the_configured_growth_is_what_a_rollout_is_admitted_for() -> None:
    config = ServerConfig(port=0, kv_capacity_tokens=1000, admission_growth=1.5)
    server = ProtoServer(SimulatedGenerator(DefaultModel(), FAST), config)
    scheduler = server.responses.admission.scheduler  # type: ignore[union-attr]
    assert scheduler.request("a", "", 400, now=0).admitted
    assert scheduler.reserved == 600
    assert not scheduler.request("b", "", 250, now=0).admitted  # 600 + 375 > 900


ENGINE_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",kv_cache_size_tokens="None",num_gpu_blocks="160"} 1
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1.0
"""


def test_the_engines_kv_capacity_is_read_from_its_metrics() -> None:
    assert parse_kv_capacity(ENGINE_METRICS) == (160 + 100) * 32  # summed over its engines
    assert parse_kv_capacity(ENGINE_METRICS.replace('"160"', '"None"')) == 100 * 32
    assert parse_kv_capacity("# nothing here\n") is None
    said = ENGINE_METRICS.replace('kv_cache_size_tokens="None"', 'kv_cache_size_tokens="5000"')
    assert parse_kv_capacity(said) == 5000 + 100 * 32  # what the engine says, where it does


async def test_a_waiter_is_let_in_when_a_learned_place_lapses_sooner_than_it_slept_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A waiter sleeps until the next place lapses; when a rollout's time away shortens the
    places kept (--admission-ttl-median), it looks again, and goes in when the shorter one
    lapses, not when the longer one would have."""
    scheduler = Scheduler(100, ttl_s=30, ttl_median=2)
    for i in range(15):  # 15 rollouts came back after 1 s: one short of going by them
        scheduler.request(i, "k", 1, now=i)
        scheduler.suspend(i, now=i)
        scheduler.request(i, "k", 1, now=i + 1)
        scheduler.release(i)
    await trio.sleep(20)
    admission = Admission(scheduler, timeout_s=300)
    for key, tokens in (("a", 60), ("b", 30)):
        assert admission.request(key, "k", tokens).admitted
        admission.suspended(key)
    suspended_at = trio.current_time()
    assert not admission.request("w", "k", 60).admitted
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admission.wait, "w")
            await trio.sleep(1)
            assert admission.request("b", "k", 30).resident  # back after 1 s: the 16th
            assert scheduler.ttl == 2
    assert scheduler.state("w") is State.STREAMING
    assert 2 <= trio.current_time() - suspended_at < 3  # a's place lapsed at 2 s, not 30


async def test_a_waiter_is_let_in_when_a_resumed_rollouts_growth_makes_its_key_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The fair share looks at admitted tokens: when key a's resumed rollout has grown, key
    b's small waiter is next and fits, and is woken then, not at its timeout."""
    admission = Admission(Scheduler(100, ttl_s=30, bypass=0), timeout_s=300)
    assert admission.request("a1", "a", 10).admitted
    assert admission.request("b1", "b", 20).admitted
    assert not admission.request("a2", "a", 80).admitted
    assert not admission.request("b2", "b", 5).admitted  # behind a2: key a holds less
    admission.suspended("a1")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admission.wait, "b2")
            await trio.sleep(1)
            assert admission.request("a1", "a", 30).resident  # back, grown
            started = trio.current_time()
    assert admission.scheduler.state("b2") is State.STREAMING
    assert trio.current_time() == started  # woken at once


async def test_a_waiter_is_let_in_at_once_when_a_rollout_gives_up_its_place_to_an_outgrown_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With --admission-overflow: the admitted outgrew the room while one streamed; as it
    suspends on its tool it gives its place up, and the waiter that now fits goes at once."""
    admission = Admission(Scheduler(100, ttl_s=30, overflow=True), timeout_s=300)
    assert admission.request("a", "k", 60).admitted
    assert admission.request("b", "k", 30).admitted
    assert not admission.request("c", "k", 30).admitted
    assert admission.request("b", "k", 50).resident  # grown: 110, a still streams
    before = sample("proto_server_admission_overflows_total")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admission.wait, "c")
            await trio.sleep(1)
            started = trio.current_time()
            admission.suspended("a")
    assert admission.scheduler.state("a") is State.IDLE
    assert admission.scheduler.state("c") is State.STREAMING
    assert trio.current_time() == started  # woken at once, not at a TTL
    assert sample("proto_server_admission_overflows_total") == before + 1


async def test_overflow_is_off_unless_asked() -> None:
    for asked in (False, True):
        config = ServerConfig(port=0, kv_capacity_tokens=1000, admission_overflow=asked)
        server = ProtoServer(SimulatedGenerator(DefaultModel(), FAST), config)
        assert server.responses.admission.scheduler.overflow is asked  # type: ignore[union-attr]


async def test_two_processes_sharing_a_store_admit_against_one_cache(
    start_server: StartServer, tmp_path: Path
) -> None:
    """--admission-shared: two servers (as two processes would) on one SQLite file and one
    engine of 3,000 tokens. The first's rollout holds about 2,000 while it waits on its tool;
    a rollout of about 1,500 on the second waits, though it would fit either server's cache
    alone, and is let in once the first's rollout completes and its server says so. On the
    real clock: the stores' threads and child processes are real I/O."""
    shared = {
        "kv_capacity_tokens": 3_000,
        "kv_target_fill": 1.0,
        "admission_shared": True,
        "admission_sync_interval_s": 0.05,
    }
    path = tmp_path / "shared.sqlite3"
    call_then_text = {
        "segments": [
            {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
            {"text": "done"},
        ]
    }
    first = await start_server(call_then_text, store=SQLiteStore(path), **shared)
    second = await start_server({"segments": [{"text": "ok"}]}, store=SQLiteStore(path), **shared)
    seen_by_second = second.server.responses.admission.scheduler  # type: ignore[union-attr]

    def asking(words: int) -> dict[str, Any]:
        return create(input=[{"type": "message", "role": "user", "content": "word " * words}])

    with trio.fail_after(60):
        async with connect(first.prototype_url) as one, connect(second.prototype_url) as two:
            await one.send(asking(2_000))
            held = await one.segment()  # admitted; now it waits on its tool, keeping its place
            assert held[-1]["type"] == "response.done"
            for _ in range(6_000):  # until the second has read the first's load
                if seen_by_second.elsewhere >= 2_000:
                    break
                await trio.sleep(0.01)
            await two.send(asking(1_500))
            head = [await two.receive(), await two.receive()]
            assert [e["type"] for e in head] == ["response.created", "response.in_progress"]
            with trio.move_on_after(1):  # 20 intervals: it waits for the first's room
                event = await two.receive()
                raise AssertionError(f"a rollout past the shared cache streamed: {event}")
            assert seen_by_second.waiting == 1 and seen_by_second.admitted == 0
            await one.send({"type": "response.append", "input": answers(held)})
            assert (await one.until("response.completed"))[-1]["type"] == "response.completed"
            done = await two.until("response.completed")  # the first let go: room for it
            assert done[-1]["response"]["status"] == "completed"
            assert seen_by_second.elsewhere == 0
