"""`serve --engine-url A --engine-url B`: two real vLLM engines (CPU build, SmolLM2) behind one
proto-server. New rollouts spread, a rollout's next segment is as warm as on one engine, an
engine killed between a rollout's turns has the rollout finish on the other (its turn says
"failover"), and the engine started again is given work once the probe sees it.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from proto_server_bench.agents import SPREAD
from proto_server_bench.chat import CHAT
from proto_server_bench.paths import LAUNCHED, PROTOTYPE, STATELESS

from proto_server.cli import main

from ..support.clients import TERMINAL, model_connect
from ..support.engine import Engine, running
from ..support.metrics import parse, value
from ..support.servers import read_line
from .test_bench_agents import _consistent
from .test_vllm import ASK, TOOL, assert_warm, calls_of, segment_usage

# the engines serve SmolLM2 as the project's loader converts it (transformers: the model extra)
pytestmark = [pytest.mark.engine, pytest.mark.model, pytest.mark.deadline(900)]

PROMPTS = "vllm:prompt_tokens_total"


@pytest.fixture(scope="module")
def second_engine(
    vllm_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """Another engine of the same model, on its own port (this module's; stopped after it)."""
    log = tmp_path_factory.mktemp("vllm-b") / "engine.log"
    with running(Engine(vllm_engine.python, vllm_engine.model_dir, log)) as engine:
        yield engine


class Front:
    """A `serve` process in front of both engines."""

    def __init__(self, process: trio.Process, root: str) -> None:
        self.process = process
        self.root = root
        self.http = httpx.AsyncClient(base_url=root, timeout=30)

    @property
    def prototype_url(self) -> str:
        return self.root.replace("http://", "ws://", 1) + "/v1/responses?dialect=prototype"

    async def engines(self) -> list[dict[str, Any]]:
        answer = await self.http.get("/readyz")
        assert answer.status_code == 200, answer.text
        engines: list[dict[str, Any]] = answer.json()["engines"]
        return engines

    async def metrics(self) -> dict[Any, float]:
        return parse((await self.http.get("/metrics")).text)


@pytest.fixture
async def front(
    nursery: trio.Nursery, vllm_engine: Engine, second_engine: Engine
) -> AsyncIterator[Front]:
    # the second engine first: a new rollout goes to the lowest index on a tie
    command = [
        sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:",
        "--generator", "vllm", "--engine-url", second_engine.url, "--engine-url", vllm_engine.url,
        "--engine-probe-interval", "0.5", "--max-tokens", "48",
    ]  # fmt: skip
    with trio.fail_after(120):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        line = await read_line(process.stdout)
    assert "on 2 engines" in line, line
    front = Front(process, line.split("listening on ")[1].split(" ")[0].removesuffix("/v1"))
    yield front
    await front.http.aclose()
    process.terminate()
    with trio.fail_after(30):
        await process.wait()


def forced(**fields: Any) -> dict[str, Any]:
    """A forced call, its prompt new to every engine (the session's engine served ASK before)."""
    return {
        "type": "response.create",
        "instructions": f"Rollout {uuid.uuid4().hex}. You are helpful.",
        "input": ASK,
        "tools": [TOOL],
        "tool_choice": "required",
        "temperature": 0,
        **fields,
    }


def outputs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py b.py"}
        for call in calls_of(events)
    ]


def finish(**fields: Any) -> dict[str, Any]:
    return {"type": "response.append", "tool_choice": "none", **fields}


def test_the_agents_bench_runs_the_launched_path_on_two_engines_beside_one(
    vllm_engine: Engine, second_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench agents` with two engines: the launched path through one server in front of both,
    beside it on the first alone, each turn's cached share compared (issue 19's goal)."""
    engines = (vllm_engine, second_engine)
    before = [e.metric(PROMPTS) for e in engines]
    args = ["bench", "agents", "--engine", "vllm", "--admission", "off",
            "--engine-url", vllm_engine.url, "--engine-url", second_engine.url,
            "--rollouts", "2", "--turns", "2", "--wait-s", "0.05,0.1", "--context-tokens", "100",
            "--tool-tokens", "40,60", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    data = orjson.loads((tmp_path / "agents.json").read_bytes())
    spread = LAUNCHED + SPREAD.format(2)
    assert [p["path"] for p in data["paths"]] == [PROTOTYPE, LAUNCHED, spread, STATELESS, CHAT]
    for path in data["paths"]:
        _consistent(path, rollouts=2, turns=2)
    on_both = next(p for p in data["paths"] if p["path"] == spread)
    assert on_both["engine"]["finished"] >= 4  # counted on both engines together
    # every path but the spread one ran on the first engine: the second saw only its turns
    after = [e.metric(PROMPTS) for e in engines]
    assert after[1] - before[1] > 0
    assert after[1] - before[1] < on_both["input_tokens"]  # the two rollouts went one each
    compared = data["spread_vs_one"]
    assert compared["path"] == spread and set(compared["points_per_turn"]) == {"2"}
    out = capsys.readouterr().out
    assert f"{spread} against one engine" in out and "Goal (issue 19): each turn within 5" in out


async def test_two_engines_spread_stay_warm_fail_over_and_take_work_again(
    front: Front, vllm_engine: Engine, second_engine: Engine
) -> None:
    a_engine, b_engine = second_engine, vllm_engine  # as the router places them
    prompts = [await trio.to_thread.run_sync(e.metric, PROMPTS) for e in (a_engine, b_engine)]
    with trio.fail_after(300):
        async with model_connect(front.prototype_url) as a, model_connect(front.prototype_url) as b:
            # balance: two rollouts at once go to the two engines
            await a.send(forced())
            a_first = await a.until("response.done", *TERMINAL)
            assert a_first[-1]["type"] == "response.done", a_first[-1]
            await b.send(forced())
            b_first = await b.until("response.done", *TERMINAL)
            assert b_first[-1]["type"] == "response.done", b_first[-1]
            engines = await front.engines()
            assert [(e["name"], e["up"], e["rollouts"]) for e in engines] == [
                (a_engine.url, True, 1),
                (b_engine.url, True, 1),
            ]
            after = [await trio.to_thread.run_sync(e.metric, PROMPTS) for e in (a_engine, b_engine)]
            assert after[0] > prompts[0] and after[1] > prompts[1]  # each engine did one

            # affinity: b's next segment finds its prefix on its engine, as on one engine
            await b.send(finish(input=outputs(b_first)))
            b_rest = await b.until(*TERMINAL)
            assert b_rest[-1]["type"] in ("response.completed", "response.incomplete")
            b_segments = segment_usage(b_first + b_rest)
            print("two engines, b's segments (prompt, cached, output):", b_segments)
            assert_warm(b_segments)

            # failover: a's engine dies while a's tool runs; a finishes on the other one
            await trio.to_thread.run_sync(a_engine.kill)
            await a.send(finish(input=outputs(a_first)))
            a_rest = await a.until(*TERMINAL)
            assert a_rest[-1]["type"] in ("response.completed", "response.incomplete"), a_rest[-1]
            a_segments = segment_usage(a_first + a_rest)
            print("two engines, a's segments after failover (prompt, cached, output):", a_segments)
            (_, (prompt, cached, _)) = a_segments
            assert cached < prompt - 32  # prefilled again: only the shared start was cached
    samples = await front.metrics()
    assert value(samples, "proto_server_turns_total", source="failover") == 1
    assert value(samples, "proto_server_engine_failovers_total", engine=a_engine.url) == 1
    assert value(samples, "proto_server_engine_up", engine=a_engine.url) == 0
    engines = await front.engines()  # still ready: one engine is enough
    assert [(e["up"], e["rollouts"]) for e in engines] == [(False, 0), (True, 0)]
    assert engines[0]["problem"]

    # the engine comes back on its port: the probe sees it, and new work goes there
    await trio.to_thread.run_sync(a_engine.start)
    for _ in range(120):  # 30 s
        if (await front.engines())[0]["up"]:
            break
        await trio.sleep(0.25)
    else:
        pytest.fail("the restarted engine was not seen up within 30 s")
    before = await trio.to_thread.run_sync(a_engine.metric, PROMPTS)
    with trio.fail_after(120):
        async with model_connect(front.prototype_url) as c:
            await c.send({"type": "response.create", "input": "Hi", "temperature": 0})
            done = await c.until(*TERMINAL)
    assert done[-1]["type"] in ("response.completed", "response.incomplete"), done[-1]
    assert await trio.to_thread.run_sync(a_engine.metric, PROMPTS) > before
