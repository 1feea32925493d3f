"""Several engine replicas (engine/replicas.py): a rollout stays warm where it began, new ones
spread, a replica that goes away is taken out and its rollouts go on elsewhere, prefilled
again and saying so; `/readyz` and `/metrics` per replica.

The replicas here are simulated GPUs, each with its own prefix cache, behind a switch that
pulls one's cable (`Pullable`); tests/services/test_vllm_replicas.py does the same with two
real vLLM engines, one of them killed.
"""

from __future__ import annotations

import math

import httpx
import pytest
import trio
import trio.testing

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine.base import GrammarGenerator
from proto_server.engine.chunks import Chunk, Prefilled, Rerouted, SegmentEnd, TextDelta
from proto_server.engine.limits import ENGINE_UNAVAILABLE, GenerationLimits, GeneratorError
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.replicas import (
    Replica,
    ReplicaState,
    ReplicatedGenerator,
    ReplicatedSession,
    affinity_key,
)
from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, SimulatedSession
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process import metrics
from proto_server.server.process.config import ServerConfig
from proto_server.testing import connect_checked
from proto_server.wire.items import FunctionCallOutput

from ..support.frames import answers, body, create
from ..support.generators import conversation
from ..support.metrics import parse, value
from ..support.servers import FAST

SCRIPT = parse_script(
    {
        "segments": [
            {"text": "Let me look.", "tool_calls": [{"name": "exec_command", "arguments": {}}]},
            {"text": "Found it.", "tool_calls": [{"name": "exec_command", "arguments": {}}]},
            {"text": "done"},
        ]
    }
)


class Pullable:
    """A simulated engine whose cable can be pulled: while pulled, a segment fails before it
    sends anything (connection refused) and the probe says so; `cut_after` chunks: the next
    segment dies in the middle instead, after handing over that many."""

    forces_tool_calls = True

    def __init__(self) -> None:
        self.inner = SimulatedGenerator(SCRIPT, FAST, prefix_cache=PrefixCache(block_tokens=16))
        self.pulled = False
        self.cut_after: int | None = None
        self.segments = 0

    @property
    def renderer(self) -> None:
        return None

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> PullableSession:
        return PullableSession(self, self.inner.open_session(conversation, cache_salt=cache_salt))

    async def readiness(self) -> str | None:
        return "connection refused" if self.pulled else None


class PullableSession:
    def __init__(self, engine: Pullable, inner: SimulatedSession) -> None:
        self.engine = engine
        self.inner = inner

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        engine = self.engine
        if engine.pulled:
            raise GeneratorError(ENGINE_UNAVAILABLE, "connection refused", unsent=True)
        engine.segments += 1
        if engine.cut_after is None:
            await self.inner.generate(send, limits)
            return
        proxy_send, proxy_receive = trio.open_memory_channel[Chunk](math.inf)
        await self.inner.generate(proxy_send, limits)
        cut = engine.cut_after
        for _ in range(cut):
            await send.send(proxy_receive.receive_nowait())
        engine.pulled, engine.cut_after = True, None
        raise GeneratorError(ENGINE_UNAVAILABLE, f"went away after {cut} chunks")

    async def prefill(self) -> Prefilled:
        if self.engine.pulled:
            raise GeneratorError(ENGINE_UNAVAILABLE, "connection refused", unsent=True)
        return await self.inner.prefill()

    async def aclose(self) -> None:
        await self.inner.aclose()


class Seen:
    """The observer: every state reported, every move."""

    def __init__(self) -> None:
        self.states: list[ReplicaState] = []
        self.moves: list[tuple[str, str]] = []

    def replica_changed(self, state: ReplicaState) -> None:
        self.states.append(state)

    def rollout_moved(self, lost: str, engine: str) -> None:
        self.moves.append((lost, engine))


def two_replicas(observer: Seen | None = None) -> tuple[ReplicatedGenerator, list[Pullable]]:
    engines = [Pullable(), Pullable()]
    replicated = ReplicatedGenerator(
        [Replica(f"engine-{i}", engine) for i, engine in enumerate(engines)], observer=observer
    )
    return replicated, engines


async def segment(session: ReplicatedSession) -> list[Chunk]:
    """Every chunk of one segment."""
    chunks: list[Chunk] = []
    send, receive = trio.open_memory_channel[Chunk](math.inf)
    await session.generate(send, GenerationLimits())
    while True:
        chunk = receive.receive_nowait()
        chunks.append(chunk)
        if isinstance(chunk, SegmentEnd):
            return chunks


def prefilled(chunks: list[Chunk]) -> Prefilled:
    (first,) = [chunk for chunk in chunks if isinstance(chunk, Prefilled)]
    return first


def tool_output(conv: Conversation) -> None:
    """What the sampling loop adds between two segments: the call (as the session closes
    over it) and the client's output."""
    conv.extend([FunctionCallOutput(call_id="call_1", output="line\n" * 40)])


# -- affinity and balance -------------------------------------------------------------------------


async def test_a_rollout_stays_on_its_replica_and_finds_its_prefix_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicated, engines = two_replicas()
    conv = conversation()
    session = replicated.open_session(conv)
    first = prefilled(await segment(session))
    home = session.replica
    assert home is not None and first.cached_tokens == 0
    tool_output(conv)
    second = prefilled(await segment(session))
    assert session.replica == home
    assert second.cached_tokens >= first.prompt_tokens - 16  # warm, but for a partial block
    assert engines[home].segments == 2 and engines[1 - home].segments == 0


async def test_new_rollouts_go_to_the_replica_holding_least(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicated, _ = two_replicas()
    sessions = [replicated.open_session(conversation()) for _ in range(4)]
    for session in sessions:
        await segment(session)
    assert [session.replica for session in sessions] == [0, 1, 0, 1]
    await sessions[0].aclose()
    await sessions[2].aclose()  # replica 0 holds nothing now
    newcomer = replicated.open_session(conversation())
    await segment(newcomer)
    assert newcomer.replica == 0
    assert [state.rollouts for state in replicated.states()] == [1, 2]


async def test_a_rollout_named_by_its_client_goes_back_to_its_replica_on_any_connection(
    nursery: trio.Nursery,
) -> None:
    replicated, engines = two_replicas()
    server = ProtoServer(replicated, ServerConfig(port=0))
    address = await nursery.start(server.serve)

    async def turn(**fields: object) -> int:
        """One turn on a new connection: the replica that served it."""
        before = [engine.segments for engine in engines]
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(address.http_url + "/responses", json=body(**fields))
        assert answer.status_code == 200, answer.text
        (served,) = [i for i, engine in enumerate(engines) if engine.segments > before[i]]
        return served

    named = {"metadata": {"rollout_id": "rl-step-3/rollout-17"}}
    home = await turn(**named)
    async with connect_checked(f"{address.ws_url}?dialect=prototype") as holder:
        await holder.send(create())
        await holder.segment()  # suspended on the replica that held least: `home`
        assert engines[home].segments == 2
        assert await turn() == 1 - home  # a rollout without a name goes where the load is least
        assert await turn(**named) == home  # the named one goes home, loaded or not
    async with httpx.AsyncClient(timeout=10) as http:
        refused = await http.post(
            address.http_url + "/responses", json=body(metadata={"rollout_id": ""})
        )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "metadata.rollout_id"


def test_a_rollout_id_is_remembered_by_a_small_digest_per_tenant() -> None:
    long = "r" * 512
    assert affinity_key("salt-a", long) == affinity_key("salt-a", long)
    assert affinity_key("salt-a", long) != affinity_key("salt-b", long)  # tenants apart
    assert affinity_key(None, "r1") != affinity_key(None, "r2")
    assert 0 <= affinity_key("salt-a", long) < 2**64  # 8 bytes, however long the id


# -- failover -------------------------------------------------------------------------------------


async def test_a_rollout_whose_replica_died_between_turns_goes_on_elsewhere_and_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen = Seen()
    replicated, engines = two_replicas(seen)
    conv = conversation()
    session = replicated.open_session(conv)
    await segment(session)
    home = session.replica
    assert home is not None
    engines[home].pulled = True  # while the client runs its tool
    tool_output(conv)
    chunks = await segment(session)
    assert chunks[0] == Rerouted(engine=f"engine-{1 - home}", lost=f"engine-{home}")
    assert prefilled(chunks) == Prefilled(prompt_tokens=conv.token_count, cached_tokens=0)
    assert any(isinstance(chunk, TextDelta) for chunk in chunks)
    assert session.replica == 1 - home
    assert seen.moves == [(f"engine-{home}", f"engine-{1 - home}")]
    down = replicated.states()[home]
    assert (down.up, down.rollouts, down.problem) == (False, 0, "connection refused")
    tool_output(conv)
    again = await segment(session)  # warm on its new replica: no second move
    assert not any(isinstance(chunk, Rerouted) for chunk in again)
    assert prefilled(again).cached_tokens > 0


async def test_a_new_rollout_sent_to_a_dead_replica_is_served_by_another_without_a_word(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicated, engines = two_replicas()
    engines[0].pulled = True  # not yet probed: the router still thinks it is up
    session = replicated.open_session(conversation())
    chunks = await segment(session)
    assert session.replica == 1
    assert not any(isinstance(chunk, Rerouted) for chunk in chunks)  # it was warm nowhere
    assert not replicated.router.is_up(0)


async def test_a_replica_that_dies_mid_segment_fails_that_segment_and_the_next_moves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicated, engines = two_replicas()
    conv = conversation()
    session = replicated.open_session(conv)
    await segment(session)
    home = session.replica
    assert home is not None
    engines[home].cut_after = 2  # the client gets two chunks, then the engine is gone
    tool_output(conv)
    send, receive = trio.open_memory_channel[Chunk](math.inf)
    with pytest.raises(GeneratorError) as failed:
        await session.generate(send, GenerationLimits())
    assert failed.value.code == ENGINE_UNAVAILABLE and not failed.value.unsent
    assert len([receive.receive_nowait() for _ in range(2)]) == 2  # what it had is not resent
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()
    chunks = await segment(session)  # the client tries again: the other replica, cold
    assert isinstance(chunks[0], Rerouted) and session.replica == 1 - home


async def test_with_every_replica_down_a_segment_fails_engine_unavailable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicated, engines = two_replicas()
    for engine in engines:
        engine.pulled = True
    session = replicated.open_session(conversation())
    with pytest.raises(GeneratorError) as failed:
        await segment(session)
    assert failed.value.code == ENGINE_UNAVAILABLE
    assert "see /readyz" in str(failed.value)
    with pytest.raises(GeneratorError, match="all 2 engine replicas are down"):
        await segment(session)  # now the router knows
    assert await replicated.readiness() == (
        "no engine replica answers: engine-0: connection refused; engine-1: connection refused"
    )


async def test_the_probe_takes_a_dead_replica_out_and_gives_it_work_once_it_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen = Seen()
    replicated, engines = two_replicas(seen)
    async with trio.open_nursery() as nursery:
        await nursery.start(replicated.supervise)
        engines[1].pulled = True
        await trio.sleep(replicated.probe_interval_s * 1.5)
        assert [state.up for state in replicated.states()] == [True, False]
        placed = [replicated.open_session(conversation()) for _ in range(2)]
        for session in placed:
            await segment(session)
        assert [session.replica for session in placed] == [0, 0]  # nothing goes to a dead one
        engines[1].pulled = False  # restarted
        await trio.sleep(replicated.probe_interval_s)
        assert replicated.router.is_up(1)
        newcomer = replicated.open_session(conversation())
        await segment(newcomer)
        assert newcomer.replica == 1  # it holds least
        nursery.cancel_scope.cancel()
    ups = [state.up for state in seen.states if state.name == "engine-1"]
    assert [up for i, up in enumerate(ups) if i == 0 or up != ups[i - 1]] == [True, False, True]


async def test_admission_counts_only_the_capacity_of_replicas_that_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With one of two replicas down, half the room is admitted against; a rollout that waits
    for the rest is admitted once the probe sees the replica back, with nobody releasing."""
    replicated, engines = two_replicas()
    server = ProtoServer(replicated, ServerConfig(port=0, kv_capacity_tokens=1000))
    admission = server.responses.admission
    assert admission is not None
    scheduler = admission.scheduler
    full = scheduler.capacity
    async with trio.open_nursery() as nursery:
        await nursery.start(replicated.supervise)
        assert admission.request("a", "k", full // 2 - 10).admitted
        engines[1].pulled = True
        await trio.sleep(replicated.probe_interval_s * 1.5)
        assert not admission.request("b", "k", full // 4).admitted
        assert scheduler.capacity == round(full / 2)
        engines[1].pulled = False
        with trio.fail_after(replicated.probe_interval_s * 3):
            await admission.wait("b")
        assert scheduler.capacity == full and scheduler.state("b") is not None
        nursery.cancel_scope.cancel()


async def test_a_warm_up_prefill_moves_too(autojump_clock: trio.testing.MockClock) -> None:
    replicated, engines = two_replicas()
    session = replicated.open_session(conversation())
    await segment(session)
    assert session.replica == 0
    engines[0].pulled = True
    assert (await session.prefill()).cached_tokens == 0
    assert session.replica == 1


# -- through the server ---------------------------------------------------------------------------


async def test_the_server_reports_each_replica_and_counts_a_failover(
    nursery: trio.Nursery,
) -> None:
    replicated, engines = two_replicas()
    replicated = ReplicatedGenerator(
        replicated.replicas, probe_interval_s=3600, observer=metrics.ReplicaMetrics()
    )
    server = ProtoServer(replicated, ServerConfig(port=0))
    address = await nursery.start(server.serve)
    base = address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        ready = (await http.get(f"{base}/readyz")).json()
        assert ready["status"] == "ready"
        assert [(e["name"], e["up"]) for e in ready["engines"]] == [
            ("engine-0", True),
            ("engine-1", True),
        ]
        before = parse((await http.get(f"{base}/metrics")).text)
        async with connect_checked(f"{address.ws_url}?dialect=prototype") as client:
            await client.send(create())
            first = await client.segment()
            assert first[-1]["type"] == "response.done"
            home = next(i for i, engine in enumerate(engines) if engine.segments)
            engines[home].pulled = True  # the engine dies while the client runs its tool
            await client.send({"type": "response.append", "input": answers(first)})
            second = await client.segment()  # on the other replica, cold
            assert second[-1]["type"] == "response.done"
            await client.send({"type": "response.append", "input": answers(second)})
            done = (await client.segment())[-1]
            assert done["type"] == "response.completed"
            assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
        after = parse((await http.get(f"{base}/metrics")).text)
        lost = f"engine-{home}"
        assert value(after, "proto_server_engine_up", engine=lost) == 0
        assert value(after, "proto_server_engine_up", engine=f"engine-{1 - home}") == 1
        moved = "proto_server_engine_failovers_total"
        assert value(after, moved, engine=lost) - value(before, moved, engine=lost) == 1
        turns = "proto_server_turns_total"
        assert value(after, turns, source="failover") - value(before, turns, source="failover") == 1
        ready = (await http.get(f"{base}/readyz")).json()  # one is enough to serve
        assert [e["up"] for e in ready["engines"]] == [home != 0, home != 1]
        engines[1 - home].pulled = True
        unready = await http.get(f"{base}/readyz")
        assert unready.status_code == 503
        error = unready.json()["error"]
        assert error["code"] == "engine_unavailable"
        assert "no engine replica answers" in error["message"]


class Checking(Pullable):
    """An engine whose grammar checks `text.format` schemas (as `VllmGenerator` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[TextFormat] = []

    def check_text_format(self, form: TextFormat) -> None:
        self.checked.append(form)


def test_a_text_format_is_checked_as_the_replicas_check_it() -> None:
    """Behind several engines a schema no grammar takes is still refused when it arrives."""
    engines = [Checking(), Checking()]
    replicated = ReplicatedGenerator([Replica(f"engine-{i}", e) for i, e in enumerate(engines)])
    assert isinstance(replicated, GrammarGenerator)
    form = TextFormat(kind="json_object")
    replicated.check_text_format(form)
    assert [engine.checked for engine in engines] == [[form], [form]]
