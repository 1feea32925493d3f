"""`proto-server bench agents`, reduced: many rollouts at once, every path's figures consistent.

Timings are not asserted (a shared, noisy machine); docs/benchmarks.md shows a real run.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import h11
import httpx
import orjson
import pytest
import trio
from proto_server_bench.agents import (
    ADMITTED,
    PLOTS,
    SPREAD,
    AgentsSettings,
    make_agents,
    percentile,
)
from proto_server_bench.agents_paths import AgentTurn, PathRun, Target, run_path
from proto_server_bench.agents_report import (
    against_vllm,
    past_need,
    spread_vs_one,
    summarize,
    unbounded_need,
)
from proto_server_bench.chat import CHAT, PROGRAMS
from proto_server_bench.paths import LAUNCHED, PROTOTYPE, STATELESS, start_serve
from proto_server_bench.shapes import lognormal

from proto_server.cli import main

from ..support.engine import Engine


def _consistent(path: dict[str, Any], rollouts: int, turns: int) -> None:
    """One path's figures agree with each other and with its turns."""
    assert path["failed"] is None
    assert path["turns"] == rollouts * turns
    assert path["input_tokens"] > 0 and path["makespan_s"] > 0
    assert 0 <= path["prefilled_tokens"] <= path["input_tokens"]
    assert path["prefilled_tokens"] + path["cached_tokens"] == path["input_tokens"]
    assert 0 <= path["cached_share"] <= 1
    assert 0 < path["unbounded_need_tokens"] <= path["prefilled_tokens"] + path["cached_tokens"]
    assert path["prefilled_vs_unbounded"] == pytest.approx(
        path["prefilled_tokens"] / path["unbounded_need_tokens"]
    )
    past = path["past_need_tokens"]
    assert past["evicted"] + past["partial_blocks"] + past["shared_prefix"] == (
        path["prefilled_tokens"] - path["unbounded_need_tokens"]
    )
    assert 0 <= past["evicted_turns"] <= rollouts * (turns - 1)
    assert 0 < path["ttft_p50_s"] <= path["ttft_p99_s"]
    assert set(path["cached_share_per_turn"]) == {str(t) for t in range(1, turns + 1)}
    assert all(0 <= share <= 1 for share in path["cached_share_per_turn"].values())


def test_a_reduced_agents_bench_reports_every_path_consistently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "agents", "--rollouts", "3", "--turns", "3", "--wait-s", "0.01,0.05",
            "--context-tokens", "120", "--tool-tokens", "40,80",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr()
    assert "rollout 2 done" in out.err and "[2/2]" in out.err  # progress, per rollout
    assert out.err.count(" done (") == 2 * 3  # per rollout, not per turn
    assert "simulated GPU (engine time modelled" in out.out
    data = orjson.loads((tmp_path / "agents.json").read_bytes())
    assert [p["path"] for p in data["paths"]] == [PROTOTYPE, LAUNCHED]
    for path in data["paths"]:
        assert out.out.count(path["path"]) == 3  # the table, the causes, the per-turn table
        _consistent(path, rollouts=3, turns=3)
        assert path["time"] == "modelled engine time" and path["preemptions"] is None
        # later turns resume warm: most of their prompt is cached
        assert path["cached_share_per_turn"]["3"] > 0.5 > path["cached_share_per_turn"]["1"]
    turns = data["turns"]
    assert {(t["path"], t["rollout"], t["turn"]) for t in turns} == {
        (p, r, t) for p in (PROTOTYPE, LAUNCHED) for r in range(3) for t in (1, 2, 3)
    }
    # the rollouts ran at once: each one's first turn went before any rollout's second
    for path in (PROTOTYPE, LAUNCHED):
        mine = [t for t in turns if t["path"] == path]
        assert max(t["at_s"] for t in mine if t["turn"] == 1) < min(
            t["at_s"] for t in mine if t["turn"] == 2
        )
    assert len(data["workload"]["waits_s"]) == 3 and len(data["workload"]["waits_s"][0]) == 2
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 1000


def test_a_shape_with_arrivals_starts_each_rollout_at_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--shape poisson`: the header names the shape, its parameters and the seed; no rollout
    starts before its drawn arrival; the table has rollouts per minute beside the makespan."""
    args = ["bench", "agents", "--shape", "poisson", "--arrival-rate", "6", "--rollouts", "3",
            "--turns", "2", "--wait-s", "0.01,0.05", "--context-tokens", "120",
            "--tool-tokens", "40,80", "--seed", "5", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "seed 5, shape poisson: 3 rollouts, Poisson arrivals at 6/s; 2 turns" in out
    assert "rollouts/min" in out
    data = orjson.loads((tmp_path / "agents.json").read_bytes())
    work = data["workload"]
    assert work["shape"] == "poisson" and work["seed"] == 5
    arrivals = work["arrivals_s"]
    assert arrivals == sorted(arrivals) and 0 < arrivals[-1] <= 3 / 6
    for path in data["paths"]:
        _consistent(path, rollouts=3, turns=2)
        assert path["finished_rollouts"] == 3
        assert path["rollouts_per_minute"] == pytest.approx(180 / path["makespan_s"])
        firsts = {t["rollout"]: t["at_s"] for t in data["turns"]
                  if t["path"] == path["path"] and t["turn"] == 1}  # fmt: skip
        assert all(firsts[r] >= arrivals[r] - 0.01 for r in range(3))


async def test_one_agents_rollouts_run_one_after_another_and_none_before_its_time() -> None:
    """A closed loop's agent starts its next rollout when its last ends; a rollout with an
    arrival waits for it (the simulated GPU, through proto-server's launched path)."""
    settings = AgentsSettings(rollouts=3, turns=2, context_tokens=60, output_tokens=(20.0, 30.0),
                              wait_s=(0.01, 0.02))  # fmt: skip
    drawn = make_agents(settings, lambda text: len(text.split()), "n")
    agents = [attrs.evolve(drawn[0], agent=0), attrs.evolve(drawn[1], agent=0),
              attrs.evolve(drawn[2], agent=1, at_s=0.3)]  # fmt: skip
    process, url = await start_serve([])
    try:
        run = await run_path(LAUNCHED, Target(url, "", "proto-sim", 16), agents, "n", [],
                             lambda line: None)  # fmt: skip
    finally:
        process.terminate()
        await process.wait()
    assert run.failed is None and run.finished == 3
    turn = {(t.rollout, t.turn): t for t in run.turns}
    assert turn[1, 1].at_s >= turn[0, 2].at_s + turn[0, 2].turn_s  # after agent 0's first
    assert turn[2, 1].at_s >= 0.3 > turn[0, 1].at_s


def test_the_workload_is_seeded_and_each_rollout_has_its_own_context() -> None:
    def count(text: str) -> int:
        return len(text.split())

    settings = AgentsSettings(rollouts=4, turns=5, context_tokens=200, seed=7)
    one, two = make_agents(settings, count, "n"), make_agents(settings, count, "n")
    assert one == two
    assert one != make_agents(AgentsSettings(rollouts=4, turns=5, seed=8), count, "n")
    firsts = {agent.context.split("\n", 1)[0] for agent in one}
    assert len(firsts) == 4  # no two rollouts share their first line
    for agent in one:
        assert len(agent.outputs) == len(agent.waits_s) == 4
        assert count(agent.context) >= 200
        assert all(w > 0 for w in agent.waits_s)


def test_lognormal_draws_have_the_median_and_p99_asked_for() -> None:
    rng = random.Random(0)
    draws = [lognormal(rng, 1.0, 15.0) for _ in range(20_000)]
    assert percentile(draws, 0.5) == pytest.approx(1.0, rel=0.05)
    assert percentile(draws, 0.99) == pytest.approx(15.0, rel=0.15)
    assert math.isnan(percentile([], 0.5))
    assert percentile([4, 1, 3, 2], 0.5) == 2  # nearest rank
    assert percentile(list(range(1, 101)), 0.99) == 99


def test_the_unbounded_need_counts_new_tokens_and_the_shared_prefix_once() -> None:
    def turn(rollout: int, number: int, prompt: int, cached: int, out: int) -> AgentTurn:
        return AgentTurn("p", rollout, number, prompt, cached, out, 0.1, 0.2, 0.0)

    turns = [
        turn(0, 1, 500, 0, 20), turn(0, 2, 700, 512, 20),  # 180 new after 500 + 20
        turn(1, 1, 510, 64, 20), turn(1, 2, 700, 0, 20),  # 64 shared: once; 170 new
    ]  # fmt: skip
    assert unbounded_need(turns) == 500 + 180 + (510 - 64) + 170


def test_what_is_prefilled_past_the_need_is_told_by_cause() -> None:
    def turn(rollout: int, number: int, prompt: int, cached: int, out: int) -> AgentTurn:
        return AgentTurn("p", rollout, number, prompt, cached, out, 0.1, 0.2, 0.0)

    turns = [
        turn(0, 1, 500, 64, 20), turn(0, 2, 700, 512, 20),  # 180 new, 8 more: a partial block
        turn(0, 3, 900, 0, 20),  # 180 new, all 720 before it let go while it waited
        turn(1, 1, 510, 0, 20), turn(1, 2, 700, 512, 20),  # 170 new, 18 more
        turn(2, 1, 520, 0, 20),  # the shared 64 prefilled by a second rollout: one too many
    ]  # fmt: skip
    past = past_need(turns, block_tokens=32)
    assert past == {"evicted": 720, "evicted_turns": 1, "partial_blocks": 8 + 18,
                    "shared_prefix": 64}  # fmt: skip
    excess = sum(t.input_tokens - t.cached_tokens for t in turns) - unbounded_need(turns)
    assert past["evicted"] + past["partial_blocks"] + past["shared_prefix"] == excess


@pytest.mark.parametrize(
    ("flag", "value"), [("--wait-s", "2,1"), ("--tool-tokens", "0,5"), ("--wait-s", "1")]
)
def test_bench_agents_refuses_a_distribution_it_cannot_draw(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    try:
        code = main(["bench", "agents", flag, value])
    except SystemExit as exited:  # argparse refuses what it cannot read as MEDIAN,P99
        code = exited.code  # type: ignore[assignment]
    assert code == 2 and flag in capsys.readouterr().err


def test_bench_agents_refuses_a_shape_it_has_not_and_flags_a_shape_draws_itself(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "agents", "--shape", "steady"]) == 2
    assert "--shape: must be one of burst, poisson, swe-bench-pro" in capsys.readouterr().err
    assert main(["bench", "agents", "--shape", "agentperf", "--tool-tokens", "10,20"]) == 2
    assert "--tool-tokens: --shape agentperf draws its own" in capsys.readouterr().err
    assert main(["bench", "agents", "--arrival-rate", "2"]) == 2
    assert "--arrival-rate: only --shape poisson takes it" in capsys.readouterr().err
    assert main(["bench", "agents", "--shape", "poisson", "--arrival-rate", "0"]) == 2
    assert "--arrival-rate: must be positive and finite" in capsys.readouterr().err


def test_bench_agents_refuses_a_cache_of_less_than_two_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "agents", "--num-gpu-blocks-override", "1"]) == 2
    assert "--num-gpu-blocks-override: must be at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:8710", "http://"])
def test_bench_agents_refuses_a_proxy_url_it_cannot_reach(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "agents", "--engine", "vllm", "--thunderagent-url", url]) == 2
    assert "--thunderagent-url: must be the proxy's root" in capsys.readouterr().err


@pytest.mark.parametrize("growth", ["0.5", "101"])
def test_bench_agents_refuses_a_growth_the_server_would(
    growth: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "agents", "--admission-growth", growth]) == 2
    assert "--admission-growth: must be between 1 and 100" in capsys.readouterr().err


def test_with_a_bounded_cache_each_proto_server_path_runs_without_and_with_admission(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A known cache size: a second server admits rollouts by it, its paths beside the first's."""
    args = ["bench", "agents", "--rollouts", "3", "--turns", "2", "--wait-s", "0.01,0.05",
            "--context-tokens", "120", "--tool-tokens", "40,80",
            "--num-gpu-blocks-override", "40", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    data = orjson.loads((tmp_path / "agents.json").read_bytes())
    assert [p["path"] for p in data["paths"]] == [
        PROTOTYPE, PROTOTYPE + ADMITTED, LAUNCHED, LAUNCHED + ADMITTED
    ]  # fmt: skip
    for path in data["paths"]:
        _consistent(path, rollouts=3, turns=2)
        # the admitting server's places that lapsed, read from its /metrics; none elsewhere
        admitted = path["path"].endswith(ADMITTED)
        assert (path["demotions"] is not None) == admitted
        assert not admitted or path["demotions"] >= 0
    assert PROTOTYPE + ADMITTED in capsys.readouterr().out


def test_admission_on_the_simulated_gpu_needs_its_cache_bounded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "agents", "--admission", "both"]) == 2
    assert "--admission on the simulated GPU needs" in capsys.readouterr().err


@pytest.mark.engine
@pytest.mark.model  # the engine's SmolLM2, converted by transformers
@pytest.mark.deadline(400)
def test_agents_on_a_real_engine_measure_every_path(
    vllm_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The admitting server runs two workers, sharing the engine's room through a store file."""
    args = ["bench", "agents", "--engine", "vllm", "--engine-url", vllm_engine.url,
            "--rollouts", "2", "--turns", "2", "--wait-s", "0.05,0.1", "--context-tokens", "100",
            "--tool-tokens", "40,60", "--admission-workers", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    data = orjson.loads((tmp_path / "agents.json").read_bytes())
    assert [p["path"] for p in data["paths"]] == [
        PROTOTYPE, PROTOTYPE + ADMITTED, LAUNCHED, LAUNCHED + ADMITTED, STATELESS, CHAT
    ]  # fmt: skip
    for path in data["paths"]:
        _consistent(path, rollouts=2, turns=2)
        assert path["time"] == "measured" and path["preemptions"] is not None
        engine = path["engine"]
        assert engine["finished"] >= 4  # the engine counted every turn (and nothing less)
        assert engine["prompt_tokens"] >= path["input_tokens"] * 0.9
    assert "vLLM /v1/responses" in capsys.readouterr().out


def test_bench_agents_starts_several_engines_only_of_vllm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "agents", "--engines", "2"]) == 2
    assert "more than 1 needs --engine vllm" in capsys.readouterr().err
    args = ["bench", "agents", "--engine", "vllm", "--engines", "2", "--engine-url", "http://x/v1"]
    assert main(args) == 2
    assert "give it or --engine-url, not both" in capsys.readouterr().err
    assert main(["bench", "agents", "--admission-ttl-median", "-1"]) == 2
    assert "--admission-ttl-median: must be between 0 and 1000" in capsys.readouterr().err
    assert main(["bench", "agents", "--admission-workers", "2"]) == 2  # a simulated GPU each
    assert "more than 1 needs --engine vllm" in capsys.readouterr().err
    assert main(["bench", "agents", "--kv-target-fill", "1.5"]) == 2
    assert "--kv-target-fill: must be between 0.01 and 1" in capsys.readouterr().err


def _path(name: str, shares: dict[str, float], failed: str | None = None) -> dict[str, Any]:
    return {"path": name, "cached_share_per_turn": shares, "failed": failed}


def test_several_engines_are_held_to_each_turns_cached_share_on_one() -> None:
    one = _path(LAUNCHED, {"1": 0.1, "2": 0.80, "3": 0.90})
    close = _path(LAUNCHED + SPREAD.format(2), {"1": 0.0, "2": 0.78, "3": 0.91})
    far = _path(LAUNCHED + SPREAD.format(2), {"1": 0.1, "2": 0.70, "3": 0.95})
    held = spread_vs_one([one, close])
    assert held is not None and held["holds"]
    assert held["points_per_turn"] == {"2": pytest.approx(-2.0), "3": pytest.approx(1.0)}
    missed = spread_vs_one([one, far])
    assert missed is not None and not missed["holds"]
    assert missed["worst_points"] == pytest.approx(-10.0)
    assert spread_vs_one([one]) is None
    assert spread_vs_one([one, _path(close["path"], {}, failed="boom")]) is None


def test_each_of_our_paths_is_judged_by_issue_19s_goals_only_under_pressure() -> None:
    def path(name: str, makespan: float, ttft_p99: float, prefill: float) -> dict[str, Any]:
        return {"path": name, "failed": None, "makespan_s": makespan, "ttft_p99_s": ttft_p99,
                "prefilled_vs_unbounded": prefill, "working_set_tokens": 4800}  # fmt: skip

    ours, vllm = path(LAUNCHED + ADMITTED, 35.0, 4.0, 1.1), path(STATELESS, 50.0, 10.0, 2.5)
    tight = AgentsSettings(engine="vllm", gpu_blocks=100)  # 3,200 tokens: 1.5x
    judged = against_vllm([ours, vllm], tight)
    assert judged is not None and set(judged) == {ours["path"]}
    assert judged[ours["path"]]["ratios"] == pytest.approx(
        {"prefilled_vs_unbounded": 1.1, "makespan": 0.7, "ttft_p99": 0.4}
    )
    assert all(judged[ours["path"]]["holds"].values())
    slow = against_vllm([path(LAUNCHED, 40.0, 6.0, 1.3), vllm], tight)
    assert slow is not None and not any(slow[LAUNCHED]["holds"].values())
    roomy = against_vllm([ours, vllm], AgentsSettings(engine="vllm", gpu_blocks=1000))
    assert roomy is not None and set(roomy[ours["path"]]["holds"].values()) == {None}  # no pressure
    assert against_vllm([ours], tight) is None  # nothing to hold it against
    assert against_vllm([ours, vllm], AgentsSettings(engine="vllm")) is None  # cache unbounded


def test_ttft_after_a_tool_counts_only_the_turns_that_follow_one() -> None:
    def turn(rollout: int, number: int, ttft: float) -> AgentTurn:
        return AgentTurn("p", rollout, number, 100 * number, 0, 10, ttft, ttft, 0.0)

    turns = [turn(r, 1, 9.0 + r) for r in range(2)]  # the first turns: no tool before them
    turns += [turn(r, t, 0.1 * (t + 3 * r)) for r in range(2) for t in (2, 3, 4)]
    summary = summarize(PathRun("p", tuple(turns), 12.0, {}), modelled=False)
    assert summary["ttft_after_tool_p50_s"] == pytest.approx(0.4)  # of 0.2 .. 0.7 (six)
    assert summary["ttft_after_tool_p90_s"] == pytest.approx(0.7)
    assert summary["ttft_p99_s"] == 10.0  # every turn's


def test_bench_agents_takes_a_program_proxy_only_in_front_of_vllm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "agents", "--thunderagent-url", "http://127.0.0.1:9/"]) == 2
    assert "--thunderagent-url needs --engine vllm" in capsys.readouterr().err


class RecordingProxy:
    """A stand-in for a proxy that schedules programs (ThunderAgent's API) in front of a real
    engine: it keeps each chat-completions body and each release it got, and forwards the body
    to the engine without its `program_id`, as ThunderAgent does."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.bodies: list[dict[str, Any]] = []
        self.released: list[str] = []
        self.order: list[str] = []  # each program's requests and release, as they came

    async def serve(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)

        async def next_event() -> Any:
            while (event := connection.next_event()) is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            return event

        async def send(event: Any) -> None:
            await stream.send_all(connection.send(event) or b"")

        request, body = await next_event(), b""
        while not isinstance(event := await next_event(), h11.EndOfMessage):
            body += event.data
        headers = [("connection", "close")]
        if request.target == b"/programs/release":
            program = json.loads(body)["program_id"]
            self.released.append(program)
            self.order.append(f"release {program}")
            answer = json.dumps({"program_id": program, "released": True}).encode()
            await send(h11.Response(status_code=200, headers=[
                *headers, ("content-type", "application/json"),
                ("content-length", str(len(answer)))]))  # fmt: skip
            await send(h11.Data(data=answer))
        else:
            assert request.target == b"/v1/chat/completions"
            payload = json.loads(body)
            self.bodies.append(payload)
            self.order.append(f"request {payload.get('program_id')}")
            forwarded = {k: v for k, v in payload.items() if k != "program_id"}
            async with (
                httpx.AsyncClient(timeout=120) as http,
                http.stream(
                    "POST", f"{self.engine_url}/chat/completions", json=forwarded
                ) as answered,  # fmt: skip
            ):
                await send(h11.Response(status_code=answered.status_code, headers=[
                    *headers, ("content-type", answered.headers["content-type"]),
                    ("transfer-encoding", "chunked")]))  # fmt: skip
                async for part in answered.aiter_raw():
                    await send(h11.Data(data=part))
        await send(h11.EndOfMessage())
        await stream.aclose()


@pytest.mark.engine
@pytest.mark.model  # the engine's SmolLM2, converted by transformers
async def test_the_chat_completions_paths_resend_the_history_and_a_proxy_gets_each_program(
    vllm_engine: Engine, nursery: trio.Nursery
) -> None:
    """vLLM's chat completions alone, and the same through a proxy of ThunderAgent's kind (a
    recording one on 127.0.0.1): each rollout's turns resend its whole history with the model's
    calls and the tools' outputs, and through the proxy carry one `program_id` per rollout,
    released once after its last turn."""
    proxy = RecordingProxy(vllm_engine.url)
    listeners = await nursery.start(partial(trio.serve_tcp, proxy.serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    target = Target("", vllm_engine.url, "smollm2", 16, programs_url=f"http://127.0.0.1:{port}/v1")
    settings = AgentsSettings(rollouts=2, turns=3, context_tokens=80, output_tokens=(30.0, 40.0),
                              wait_s=(0.01, 0.02))  # fmt: skip
    agents = make_agents(settings, lambda text: len(text.split()), "n")
    async with httpx.AsyncClient(base_url=vllm_engine.url.removesuffix("/v1")) as engine:
        runs = {path: await run_path(path, target, agents, "n", [engine], lambda line: None)
                for path in (CHAT, PROGRAMS)}  # fmt: skip
    for run in runs.values():
        summary = summarize(run, modelled=False)
        _consistent(summary, rollouts=2, turns=3)
        assert summary["ttft_after_tool_p50_s"] <= summary["ttft_after_tool_p90_s"]
        assert run.engine["finished"] >= 6  # the engine counted every turn
        # each turn after the first resends the rollout's history: its prefix is found cached
        assert all(t.cached_tokens > 0 for t in run.turns if t.turn > 1)
    # only the proxy's path went through it: 2 programs of 3 turns, each released once, last
    programs = [body["program_id"] for body in proxy.bodies]
    assert len(programs) == 6 and len(set(programs)) == 2
    assert sorted(proxy.released) == sorted(set(programs))
    for program in set(programs):
        mine = [entry for entry in proxy.order if entry.endswith(program)]
        assert mine == [f"request {program}"] * 3 + [f"release {program}"]
        bodies = [body for body in proxy.bodies if body["program_id"] == program]
        system = bodies[0]["messages"][0]
        assert system["role"] == "system" and f"[n {PROGRAMS}]" in system["content"]  # salted
        for before, after in itertools.pairwise(bodies):
            sent = after["messages"]
            assert sent[: len(before["messages"])] == before["messages"]  # the history, whole
            said, tool = sent[len(before["messages"]) :]
            assert said["role"] == "assistant" and len(said["tool_calls"]) == 1
            assert tool == {"role": "tool", "tool_call_id": said["tool_calls"][0]["id"],
                            "content": tool["content"]}  # fmt: skip
            assert tool["content"] in {o for a in agents for o in a.outputs}
        assert [b["tool_choice"] for b in bodies] == ["required", "required", "none"]
