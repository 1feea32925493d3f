"""A pause for a weight update (`POST /admin/pause`, `/admin/resume`, `GET /admin/paused`;
server/dialects/admin.py over server/rollouts/pausing.py and core/pause.py): behind a key of
its own; `wait` lets running segments end, then says everything is held; `keep` freezes them
where they are (the simulated GPU says no token more); new segments (a create, an append to a
suspended rollout) wait at the gate, their Response in progress, and go on after the resume,
carrying the weight version it set beside their token ids; a suspended rollout stays
suspended; a segment held past --pause-timeout ends its Response incomplete. On the autojump
clock, so the waits cost no real time."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from proto_server.cli import admin_key, main
from proto_server.core.pause import Pause, PauseMode, PauseRefused
from proto_server.core.request import TOKEN_IDS
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.limits import GeneratorError
from proto_server.engine.replicas import Replica, ReplicatedGenerator
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.rollouts.pausing import PauseGate
from proto_server.testing.client import EventTimeout, WireClient

from ..support.clients import connect
from ..support.frames import THREE_SEGMENTS, answers, body, create, launched_create
from ..support.generators import RecordingGenerator
from ..support.servers import Running, StartServer
from ..support.stores import CheckpointStore

ADMIN = {"Authorization": "Bearer admin-secret"}
CLIENT = {"Authorization": "Bearer client-key"}
TEXT = {"segments": [{"text": "word " * 400}]}  # 8 s at 50 tokens/s
SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50)


async def start(start_server: StartServer, script: dict[str, Any], **config: Any) -> Running:
    running: Running = await start_server(
        script, store=CheckpointStore(), admin_key="admin-secret", api_keys=("client-key",),
        **config,
    )  # fmt: skip
    return running


async def admin(
    http: httpx.AsyncClient, running: Running, method: str, route: str, **kwargs: Any
) -> dict[str, Any]:
    answer = await http.request(
        method, f"{running.address.http_url.removesuffix('/v1')}/admin/{route}", headers=ADMIN,
        **kwargs,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def silent(client: WireClient, seconds: float) -> int:
    """How many events come within the next `seconds` (read one event timeout at a time)."""
    came = 0
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        try:
            await client.receive()
            came += 1
        except EventTimeout:
            pass
    return came


def versions(output: list[dict[str, Any]]) -> list[str | None]:
    return [item.get("weight_version") for item in output]


async def test_the_admin_routes_are_off_without_an_admin_key(start_server: StartServer) -> None:
    running = await start_server(TEXT, api_keys=("client-key",))
    root = running.address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        for key in ({}, CLIENT, ADMIN):
            answer = await http.get(f"{root}/admin/paused", headers=key)
            assert answer.status_code == 404
            assert "--admin-key" in answer.json()["error"]["message"]


async def test_only_the_admin_key_opens_the_admin_routes(start_server: StartServer) -> None:
    """Not a client's key, not a wrong one, not none; and the admin key is no client's."""
    running = await start(start_server, TEXT)
    root = running.address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        for key in ({}, CLIENT, {"Authorization": "Bearer admin-secre"}, {"Authorization": "x"}):
            for method, route in (("GET", "paused"), ("POST", "pause"), ("POST", "resume")):
                answer = await http.request(method, f"{root}/admin/{route}", headers=key)
                assert answer.status_code == 401, (key, route)
                assert answer.json()["error"]["code"] == "invalid_admin_key"
        assert (await http.get(f"{root}/admin/paused", headers=ADMIN)).json() == {
            "is_paused": False, "held": False, "mode": None, "running": 0, "waiting": 0,
            "weight_version": None,
        }  # fmt: skip
        refused = await http.post(f"{root}/v1/responses", json=body(), headers=ADMIN)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        bad = await http.post(f"{root}/admin/pause?mode=abort", headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
        for version in (2, "", "v" * 257):  # a label every later item carries: bounded
            bad = await http.post(
                f"{root}/admin/resume", headers=ADMIN, json={"weight_version": version}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight_version"
        missing = await http.get(f"{root}/admin/nothing", headers=ADMIN)
        assert missing.status_code == 404


async def test_wait_lets_running_segments_end_then_holds_new_ones_until_the_resume(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start(start_server, TEXT, timing=SLOW)
    url = f"{running.address.http_url}/responses"
    ended: dict[str, float] = {}

    async def post(name: str) -> None:
        answer = await http.post(url, json=body(store=False, include=[TOKEN_IDS]), headers=CLIENT)
        assert answer.status_code == 200 and answer.json()["status"] == "completed"
        ended[name] = trio.current_time()
        outputs[name] = answer.json()["output"]

    outputs: dict[str, list[dict[str, Any]]] = {}
    with trio.fail_after(120):
        async with httpx.AsyncClient(timeout=None) as http, trio.open_nursery() as nursery:
            await admin(http, running, "POST", "resume", json={"weight_version": "v1"})
            nursery.start_soon(post, "before")
            await trio.sleep(2)  # it streams (8 s)
            paused = await admin(http, running, "POST", "pause?mode=wait")
            held_at = trio.current_time()
            assert paused["is_paused"] and paused["held"] and paused["running"] == 0
            assert held_at >= 8  # once the running segment ended (8 s of tokens)
            nursery.start_soon(post, "after")
            await trio.sleep(30)  # held: it does not begin
            assert "after" not in ended
            status = await admin(http, running, "GET", "paused")
            assert status["waiting"] == 1 and status["mode"] == "wait"
            resumed = await admin(http, running, "POST", "resume", json={"weight_version": "v2"})
            assert not resumed["is_paused"] and resumed["weight_version"] == "v2"
    assert ended["before"] <= held_at + 1  # its answer followed its end
    assert ended["after"] >= held_at + 30
    assert versions(outputs["before"]) == ["v1"]
    assert versions(outputs["after"]) == ["v2"]


async def test_a_suspended_rollout_stays_suspended_and_its_append_waits_for_the_resume(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start(start_server, THREE_SEGMENTS)
    with trio.fail_after(7200):
        async with (
            httpx.AsyncClient(timeout=None) as http,
            connect(running.prototype_url, Authorization=CLIENT["Authorization"]) as client,
        ):
            await client.send(create(include=[TOKEN_IDS]))
            first = await client.segment()
            assert first[-1]["type"] == "response.done"
            paused = await admin(http, running, "POST", "pause")
            assert paused["held"] and paused["running"] == 0
            await trio.sleep(300)  # suspended through the pause (within --suspend-timeout)
            await client.send({"type": "response.append", "input": answers(first)})
            announced = await client.receive()
            assert announced["type"] == "response.in_progress"
            assert await silent(client, 120) == 0, "a held segment streamed"
            await admin(http, running, "POST", "resume", json={"weight_version": "v2"})
            second = await client.segment()
    done = [e["item"] for e in second if e["type"] == "response.output_item.done"]
    assert versions(done) == ["v2", "v2"]
    assert all("weight_version" not in e["item"] for e in first if "item" in e)
    usage = second[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # the simulated GPU kept it warm


async def test_keep_freezes_running_segments_where_they_are(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start(start_server, TEXT, timing=SLOW)
    with trio.fail_after(1200):
        async with (
            httpx.AsyncClient(timeout=None) as http,
            connect(running.prototype_url, Authorization=CLIENT["Authorization"]) as client,
        ):
            await client.send(create(tools=[]))
            await client.until("response.output_text.delta")
            paused = await admin(http, running, "POST", "pause?mode=keep")
            assert paused["held"] and paused["running"] == 1 and paused["mode"] == "keep"
            conflict = await http.post(
                f"{running.address.http_url.removesuffix('/v1')}/admin/pause?mode=wait",
                headers=ADMIN,
            )
            assert conflict.status_code == 409
            frozen_at = trio.current_time()
            assert await silent(client, 600) <= 2  # at most the deltas already on their way
            await admin(http, running, "POST", "resume")
            events = await client.until("response.completed")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and events[-1]["response"]["status"] == "completed"
    assert trio.current_time() >= frozen_at + 600


async def test_a_segment_held_past_the_pause_timeout_ends_incomplete(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start(start_server, TEXT, pause_timeout_s=30)
    with trio.fail_after(120):
        async with httpx.AsyncClient(timeout=None) as http:
            await admin(http, running, "POST", "pause")
            answer = await http.post(
                f"{running.address.http_url}/responses", json=body(store=False), headers=CLIENT
            )
            assert (await admin(http, running, "GET", "paused"))["waiting"] == 0
    assert answer.json()["status"] == "incomplete"
    assert answer.json()["incomplete_details"] == {"reason": "pause_timeout"}


def test_the_admin_key_comes_from_its_flag_or_its_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert admin_key(None, {}) is None
    assert admin_key(None, {"PROTO_SERVER_ADMIN_KEY": " k "}) == "k"
    assert admin_key("f", {"PROTO_SERVER_ADMIN_KEY": "k"}) == "f"
    for flag, environ in ((" ", {}), (None, {"PROTO_SERVER_ADMIN_KEY": ""})):
        with pytest.raises(ValueError, match="must not be empty"):
            admin_key(flag, environ)
    assert main(["serve", "--admin-key", "k", "--workers", "2", "--store", ":memory:"]) == 2
    assert "one worker per port" in capsys.readouterr().err


class Unfreezable(RecordingGenerator):
    """The simulated GPU without its freeze: as the local model, it cannot hold what runs."""

    renderer = None

    def __init__(self) -> None:
        super().__init__(SimulatedGenerator(DefaultModel()))


async def test_keep_is_refused_where_the_generator_cannot_freeze(nursery: trio.Nursery) -> None:
    server = ProtoServer(Unfreezable(), ServerConfig(port=0, admin_key="admin-secret"))
    address = await nursery.start(server.serve)
    root = address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        refused = await http.post(f"{root}/admin/pause?mode=keep", headers=ADMIN)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "unsupported_pause_mode"
        assert not (await http.get(f"{root}/admin/paused", headers=ADMIN)).json()["is_paused"]
        held = await http.post(f"{root}/admin/pause?mode=wait", headers=ADMIN)
        assert held.json()["held"]


def test_the_pause_as_data() -> None:
    """Held once nothing runs (wait) or at once (keep); another mode is refused while paused;
    a resume while not paused only sets the version."""
    pause = Pause()
    assert pause.start() and pause.running == 1
    pause.pause(PauseMode.WAIT)
    assert not pause.held and not pause.start()
    with pytest.raises(PauseRefused):
        pause.pause(PauseMode.KEEP)
    assert pause.end() and pause.held
    pause.resume("v2")
    assert not pause.paused and pause.weight_version == "v2"
    pause.resume()
    assert pause.weight_version == "v2"
    pause.pause(PauseMode.KEEP)
    assert pause.held and pause.status().mode == "keep"


class Refusing(Unfreezable):
    """A replica whose engine refuses to pause (vLLM without VLLM_SERVER_DEV_MODE)."""

    def __init__(self) -> None:
        super().__init__()
        self.resumed = 0

    async def pause_engine(self, mode: str) -> None:
        raise GeneratorError("engine_error", "the engine serves no /pause")

    async def resume_engine(self) -> None:
        self.resumed += 1


async def test_a_pause_reaches_every_replica_and_one_refusal_undoes_it() -> None:
    engines = [SimulatedGenerator(DefaultModel()), SimulatedGenerator(DefaultModel())]
    gate = PauseGate(
        ReplicatedGenerator([Replica(f"engine-{i}", e) for i, e in enumerate(engines)]),
        timeout_s=60,
    )
    assert (await gate.pause(PauseMode.KEEP)).held
    assert all(engine.freeze.frozen for engine in engines)
    await gate.resume("v2")
    assert not any(engine.freeze.frozen for engine in engines)

    refusing = Refusing()
    gate = PauseGate(
        ReplicatedGenerator([Replica("up", engines[0]), Replica("old", refusing)]), timeout_s=60
    )
    with pytest.raises(GeneratorError, match="no /pause"):
        await gate.pause(PauseMode.KEEP)
    assert not gate.state.paused and not engines[0].freeze.frozen and refusing.resumed == 1


async def test_a_launched_turn_sent_while_paused_is_in_progress_then_runs_after_the_resume(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start(start_server, TEXT)
    with trio.fail_after(600):
        async with (
            httpx.AsyncClient(timeout=None) as http,
            connect(running.address.ws_url, Authorization=CLIENT["Authorization"]) as client,
        ):
            await admin(http, running, "POST", "pause?mode=keep")
            await client.send(launched_create(tools=[], include=[TOKEN_IDS]))
            head = [await client.receive(), await client.receive()]
            assert [e["type"] for e in head] == ["response.created", "response.in_progress"]
            assert await silent(client, 120) == 0
            await admin(http, running, "POST", "resume", json={"weight_version": "v3"})
            events = await client.until("response.completed")
    assert versions(events[-1]["response"]["output"]) == ["v3"]
