"""proto-server in front of vLLM against vLLM's own `/v1/responses`, turn by turn, measured.

One agent loop (forced tool calls, a tool output of 300-500 tokens appended after each, a final
answer) runs through five paths on the same engine, interleaved turn by turn: proto-server's
prototype WebSocket (one Response, suspended on each call), its launched WebSocket (turns
chained by `previous_response_id`), its stateless HTTP (the whole history each turn), vLLM's
own `/v1/responses` with the whole history (`store: false`) and chained by
`previous_response_id` (the engine started with `VLLM_ENABLE_RESPONSES_API_STORE=1`).
proto-server runs as a process of its own so that its CPU, like that of vLLM's API server
process (its engine core is a child process and is not counted), is read from `/proc` (each
thread's scheduler time) at each turn's end. Whatever the model said, every path's client
appends the same tool output each turn: as the output of the model's call when it made one,
else as a user message (vLLM's own endpoint without a tool parser answers in text). Times are
wall-clock on the client: to the first output delta (TTFT) and to the terminal event; token
counts are what each path reports in `usage`. The paths' clients are paths.py's.

Why one module of this length: the run and the report of one experiment. `Turn` is what
`run_paths` records at each turn's end (the engine's decode and both front ends' CPU read
around it) and what `summarize`, `render` and `write_files` read back; apart, a column of the
table could drift from the figure measured for it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from proto_server.bench.paths import (
    ASK,
    INSTRUCTIONS,
    OURS,
    PATH_FAILURES,
    PATHS,
    THEIRS,
    Items,
    Send,
    calls,
    follow_up,
    open_path,
    start_proto_server,
    valid_call,
)
from proto_server.bench.report import NO_PLOTS, pyplot
from proto_server.compose import connect_vllm
from proto_server.launch import Launch

#: The engine's histograms (`/metrics`): its decode after the first token is their difference.
E2E, ENGINE_TTFT = "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"
PLOTS = ("ttft-per-turn.png", "cached-share-per-turn.png", "front-end-cpu-per-turn.png")
Progress = Callable[[str], None]


@attrs.frozen
class Turn:
    path: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    #: Whether the model called the tool this turn.
    called: bool
    #: Whether every call it made names the tool with arguments its schema allows.
    valid: bool
    #: To the first output event the client saw.
    ttft_s: float
    turn_s: float
    #: The engine's time from its first token to its last (its /metrics).
    engine_decode_s: float
    #: What the client sent for the turn: the frame or the request body.
    client_bytes: int
    #: CPU of proto-server's process and of vLLM's API server process over the turn.
    proto_cpu_ms: float
    api_server_cpu_ms: float

    @property
    def front_end_cpu_ms(self) -> float:
        """The CPU of the path's own front end: proto-server, or vLLM's API server."""
        return self.proto_cpu_ms if self.path in OURS else self.api_server_cpu_ms

    @property
    def first_token_s(self) -> float:
        """The turn less the engine's decode after its first token: when the first token was
        there, comparable on every path (whether the client saw it or not)."""
        return self.turn_s - self.engine_decode_s

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """The CPU time of each live thread of a process so far, in ns: the scheduler's own count
    (`/proc/PID/task/TID/schedstat`), not clock ticks, which are 10 ms, a turn's whole cost."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return times


class CpuMeter:
    """CPU of both front ends between consecutive marks (no CPU falls between two turns), summed
    over their threads; a thread that ends between two marks takes its last share with it."""

    def __init__(self, proto_pid: int, api_server_pid: int) -> None:
        self.pids = (proto_pid, api_server_pid)
        self.last = [thread_cpu_ns(pid) for pid in self.pids]

    def mark(self) -> tuple[float, float]:
        """The CPU of each front end since the last mark, in ms."""
        now = [thread_cpu_ns(pid) for pid in self.pids]
        proto, api = (
            sum(ns - last.get(tid, 0) for tid, ns in times.items()) / 1e6
            for times, last in zip(now, self.last, strict=True)
        )
        self.last = now
        return proto, api


async def engine_decode_total(http: httpx.AsyncClient) -> tuple[float, float]:
    """The engine's finished requests and their summed decode time after the first token."""
    sums = {f"{E2E}_count": 0.0, f"{E2E}_sum": 0.0, f"{ENGINE_TTFT}_sum": 0.0}
    for line in (await http.get("/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums[f"{E2E}_count"], sums[f"{E2E}_sum"] - sums[f"{ENGINE_TTFT}_sum"]


async def engine_decode_after(http: httpx.AsyncClient, finished: float) -> tuple[float, float]:
    """As `engine_decode_total`, once the engine has counted more than `finished` requests (it
    records a request a moment after its stream ends)."""
    for _ in range(100):
        count, decode = await engine_decode_total(http)
        if count > finished:
            break
        await trio.sleep(0.02)
    return count, decode


def tool_output(turn: int, tokens: int, tokenizer: Any) -> str:
    """A deterministic, turn-specific tool output of about `tokens` of the model's tokens."""
    lines: list[str] = []
    line = 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(f"tests/test_{turn}_{line}.py::test_case_{line} PASSED [{line % 100}%]")
        line += 1
    return "\n".join(lines)


def output_sizes(turns: int, tokens: int) -> list[int]:
    """Turn 2..N's tool output sizes: 0.75x to 1.25x `tokens` (300-500 for 400), varied."""
    return [round(tokens * (0.75 + 0.125 * ((turn * 3) % 5))) for turn in range(2, turns + 1)]


@attrs.frozen
class Setup:
    """Where the front ends are and what the loop is."""

    proto_url: str
    proto_pid: int
    engine_url: str
    engine_pid: int
    model: str
    turns: int
    answer_tokens: int


async def run_paths(
    setup: Setup, outputs: Sequence[str], nonce: str, progress: Progress
) -> dict[str, list[Turn] | str]:
    """Every path's loop, interleaved turn by turn (turn 1 on each path, then turn 2, ...), so
    that whatever else this machine does falls on all of them alike. Turn 1 asks, each later
    turn adds a tool output; every turn but the last forces a call, the last answers
    (`tool_choice: none`). A path that fails keeps why, and the others go on."""
    results: dict[str, list[Turn] | str] = {}
    sends: dict[str, Send] = {}
    root = setup.engine_url.removesuffix("/v1")
    with contextlib.suppress(*PATH_FAILURES):  # closing a path that failed
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(httpx.AsyncClient(base_url=root, timeout=30))
            for path in PATHS:
                # the path's own instructions: nothing of its prompts is in the cache from another
                instructions = f"[{nonce} {path}] {INSTRUCTIONS}"
                opened = open_path(path, setup.proto_url, setup.engine_url, setup.model,
                                   instructions, setup.answer_tokens)  # fmt: skip
                try:
                    sends[path] = await stack.enter_async_context(opened)
                except PATH_FAILURES as exc:
                    results[path] = f"{exc.__class__.__name__}: {exc}"
            new: dict[str, Items] = {path: [{"role": "user", "content": ASK}] for path in sends}
            turns: dict[str, list[Turn]] = {path: [] for path in sends}
            finished, decoded = await engine_decode_total(engine)
            meter = CpuMeter(setup.proto_pid, setup.engine_pid)
            for turn in range(1, setup.turns + 1):
                for path, send in list(sends.items()):
                    try:
                        said = await send(new[path], "required" if turn < setup.turns else "none")
                    except PATH_FAILURES as exc:
                        results[path] = f"{exc.__class__.__name__}: {exc}"
                        progress(f"{path} failed: {results[path]}")
                        del sends[path]
                        continue
                    proto_cpu, api_cpu = meter.mark()
                    before = decoded
                    finished, decoded = await engine_decode_after(engine, finished)
                    meter.mark()  # the API server's answer to /metrics is no turn's
                    made = calls(said.output)
                    result = Turn(path, turn, *said.usage, bool(made),
                                  all(valid_call(call) for call in made), said.ttft_s,
                                  said.turn_s, decoded - before, said.client_bytes, proto_cpu,
                                  api_cpu)  # fmt: skip
                    turns[path].append(result)
                    progress(
                        f"turn {turn}/{setup.turns}, {path}: prompt {result.prompt_tokens}, "
                        f"cached {result.cached_tokens}, TTFT {result.ttft_s * 1e3:.0f} ms, "
                        f"front-end CPU {result.front_end_cpu_ms:.1f} ms"
                    )
                    if turn < setup.turns:
                        new[path] = follow_up(said.output, outputs[turn - 1])
            results.update({path: turns[path] for path in sends})
    return {path: results[path] for path in PATHS if path in results}


async def measure(
    *,
    engine_url: str,
    engine_pid: int,
    model: str,
    tokenizer: Any,
    turns: int,
    tool_output_tokens: int,
    answer_tokens: int,
    nonce: str,
    progress: Progress = lambda line: None,
) -> dict[str, list[Turn] | str]:
    """Every path's turns (or why it failed), interleaved on the same engine."""
    outputs = [
        tool_output(turn, size, tokenizer)
        for turn, size in enumerate(output_sizes(turns, tool_output_tokens), 2)
    ]
    process, proto_url = await start_proto_server(engine_url, answer_tokens)
    setup = Setup(proto_url, process.pid, engine_url, engine_pid, model, turns, answer_tokens)
    try:
        return await run_paths(setup, outputs, nonce, progress)
    finally:
        process.terminate()
        with trio.move_on_after(30):
            await process.wait()


# -- what a run says -----------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _by_turn(results: dict[str, list[Turn] | str]) -> dict[str, dict[int, Turn]]:
    return {
        path: {t.turn: t for t in turns}
        for path, turns in results.items()
        if isinstance(turns, list)
    }


def summarize(results: dict[str, list[Turn] | str]) -> dict[str, Any]:
    """Per path, medians over turns 2..N; per proto-server path, its ratios to each of vLLM's
    and whether each goal holds at every turn."""
    turns = _by_turn(results)
    paths: dict[str, Any] = {}
    for path, by in turns.items():
        later = [by[t] for t in sorted(by) if t > 1]
        cpu = [t.front_end_cpu_ms for t in later]
        half = len(cpu) // 2
        paths[path] = {
            "ttft_ms": _median([t.ttft_s * 1e3 for t in later]),
            "first_token_ms": _median([t.first_token_s * 1e3 for t in later]),
            "turn_ms": _median([t.turn_s * 1e3 for t in later]),
            "front_end_cpu_ms": _median(cpu),
            "api_server_cpu_ms": _median([t.api_server_cpu_ms for t in later]),
            "cached_share": _median([t.cached_share for t in later]),
            "client_bytes": _median([float(t.client_bytes) for t in later]),
            # the later half of the turns against the earlier half: 1.0 is flat with history
            "cpu_growth": _median(cpu[half:]) / max(_median(cpu[:half] or cpu), 1e-9),
            "cpu_growth_ms": _median(cpu[half:]) - _median(cpu[:half] or cpu),
            "calls": sum(t.called for t in by.values()),
            "valid_calls": sum(t.called and t.valid for t in by.values()),
        }
    theirs = [turns[p] for p in THEIRS if p in turns]
    goals: dict[str, Any] = {}
    for path in OURS:
        if path not in turns or not theirs:
            continue
        ours = turns[path]
        common = [t for t in sorted(ours) if all(t in other for other in theirs)]
        rest = [t for t in common if t > 1]
        vllm_cpu = min(paths[p]["front_end_cpu_ms"] for p in THEIRS if p in turns)
        goals[path] = {
            "ratios": {
                other: {
                    "ttft": _median([turns[other][t].ttft_s / ours[t].ttft_s for t in rest]),
                    "first_token": _median(
                        [turns[other][t].first_token_s / ours[t].first_token_s for t in rest]
                    ),
                    "front_end_cpu": paths[other]["front_end_cpu_ms"]
                    / max(paths[path]["front_end_cpu_ms"], 1e-9),
                    "cached_share": paths[path]["cached_share"]
                    / max(paths[other]["cached_share"], 1e-9),
                }
                for other in THEIRS
                if other in turns
            },
            "cached_at_least_vllm": all(
                ours[t].cached_tokens >= max(o[t].cached_tokens for o in theirs) for t in common
            ),
            "ttft_worse_turns": [
                t for t in rest if ours[t].ttft_s > min(o[t].ttft_s for o in theirs)
            ],
            "first_token_worse_turns": [
                t for t in rest if ours[t].first_token_s > min(o[t].first_token_s for o in theirs)
            ],
            # within 1.5x, or within 1 ms (this machine's noise between two turns)
            "cpu_flat": paths[path]["cpu_growth"] <= 1.5 or paths[path]["cpu_growth_ms"] <= 1.0,
            "cpu_at_most_a_fifth": paths[path]["front_end_cpu_ms"] <= vllm_cpu / 5,
        }
    failed = {path: why for path, why in results.items() if isinstance(why, str)}
    return {"paths": paths, "goals": goals, "failed": failed}


def _call(turn: Turn) -> str:
    if not turn.called:
        return "no"
    return "yes" if turn.valid else "invalid"


def _holds(failing: Sequence[int]) -> str:
    return "holds" if not failing else f"does not hold (turns {', '.join(map(str, failing))})"


def render(results: dict[str, list[Turn] | str], summary: dict[str, Any]) -> str:
    """Markdown: a row per turn and path, the medians, the ratios and the goals."""
    lines = [
        "| turn | path | prompt | cached | out | call | TTFT ms | first token ms | turn ms "
        "| client bytes | proto-server CPU ms | vLLM API server CPU ms |",
        "|---:|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    turns = _by_turn(results)
    for turn in sorted({t for by in turns.values() for t in by}):
        for path, by in turns.items():
            if turn in by:
                t = by[turn]
                lines.append(
                    f"| {turn} | {path} | {t.prompt_tokens} | {t.cached_tokens} | "
                    f"{t.output_tokens} | {_call(t)} | {t.ttft_s * 1e3:.0f} | "
                    f"{t.first_token_s * 1e3:.0f} | {t.turn_s * 1e3:.0f} | {t.client_bytes} | "
                    f"{t.proto_cpu_ms:.1f} | {t.api_server_cpu_ms:.1f} |"
                )
    lines += [
        "",
        "Medians over turns 2..N (front-end CPU: proto-server's process for its paths, vLLM's "
        "API server process for vLLM's, each summed over its threads as the scheduler counts "
        "it; CPU growth: the later half of the turns against the earlier half):",
        "",
        "| path | TTFT ms | first token ms | turn ms | front-end CPU ms | CPU growth "
        "| vLLM API server CPU ms | cached share | client bytes | calls (valid) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path, row in summary["paths"].items():
        lines.append(
            f"| {path} | {row['ttft_ms']:.0f} | {row['first_token_ms']:.0f} | "
            f"{row['turn_ms']:.0f} | "
            f"{row['front_end_cpu_ms']:.1f} | {row['cpu_growth']:.2f}x | "
            f"{row['api_server_cpu_ms']:.1f} | {row['cached_share']:.0%} | "
            f"{row['client_bytes']:.0f} | {row['calls']} ({row['valid_calls']}) |"
        )
    for path, why in summary["failed"].items():
        lines.append(f"\n{path} failed: {why}")
    for path, goal in summary["goals"].items():
        lines.append(f"\n{path}:")
        for other, ratio in goal["ratios"].items():
            lines.append(
                f"- against {other}: median TTFT ratio {ratio['ttft']:.2f}x, first-token ratio "
                f"{ratio['first_token']:.2f}x, front-end CPU "
                f"ratio {ratio['front_end_cpu']:.1f}x, cached share ratio "
                f"{ratio['cached_share']:.2f}x (above 1: proto-server better)"
            )

        lines += [
            f"- cached tokens at every turn at least vLLM's: "
            f"{'holds' if goal['cached_at_least_vllm'] else 'does not hold'}",
            f"- TTFT (first output seen) no worse than vLLM's at any turn: "
            f"{_holds(goal['ttft_worse_turns'])}",
            f"- first token (turn less the engine's decode) no worse than vLLM's at any turn: "
            f"{_holds(goal['first_token_worse_turns'])}",
            "- front-end CPU flat with history: "
            + ("holds" if goal["cpu_flat"] else "does not hold"),
            f"- front-end CPU at most a fifth of vLLM's API server's: "
            f"{'holds' if goal['cpu_at_most_a_fifth'] else 'does not hold'}",
        ]
    return "\n".join(lines)


def write_files(
    results: dict[str, list[Turn] | str], summary: dict[str, Any], directory: Path
) -> list[Path] | str:
    """bench-vllm.json and the PNGs, or why there are no plots (matplotlib is the `bench`
    extra)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {
        path: turns if isinstance(turns, str) else [attrs.asdict(t) for t in turns]
        for path, turns in results.items()
    }
    (directory / "bench-vllm.json").write_text(json.dumps({**summary, "turns": raw}, indent=2))
    plt = pyplot()
    if plt is None:
        return NO_PLOTS
    written = []
    fields: list[tuple[str, str, str, Callable[[Turn], float]]] = [
        (PLOTS[0], "Time to first output seen by the client per turn (measured)", "ms",
         lambda t: t.ttft_s * 1e3),
        (PLOTS[1], "Cached share of the prompt per turn (engine's count)", "share",
         lambda t: t.cached_share),
        (PLOTS[2], "Front-end CPU per turn (proto-server / vLLM API server)", "ms",
         lambda t: t.front_end_cpu_ms),
    ]  # fmt: skip
    for filename, title, ylabel, field in fields:
        figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
        for (path, by), style in zip(
            _by_turn(results).items(), ("-", "--", "-.", ":", "-"), strict=False
        ):
            xs = sorted(by)
            axes.plot(xs, [field(by[x]) for x in xs], style, marker=".", label=path)
        axes.set(title=title, xlabel="turn", ylabel=ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(directory / filename)
        plt.close(figure)
        written.append(directory / filename)
    return written


def run(args: argparse.Namespace) -> int:
    """`proto-server bench-vllm`: the generator serve would run, measured against vLLM's own."""
    # the served model's name and tokenizer
    launch = Launch(generator="vllm", engine_url=(args.engine_url,), tokenizer=args.tokenizer)
    generator = connect_vllm(launch, args.engine_url, args.model)
    print(
        f"{generator.name} on vLLM at {generator.url} (API server pid {args.engine_pid}); "
        f"{args.turns} turns, tool outputs of {args.tool_output_tokens} tokens on average, "
        f"at most {args.answer_tokens} tokens decoded a turn; wall-clock times and CPU "
        "measured on this machine",
        flush=True,
    )
    results = trio.run(
        partial(
            measure,
            engine_url=generator.url,
            engine_pid=args.engine_pid,
            model=generator.name,
            tokenizer=generator.tokenizer,
            turns=args.turns,
            tool_output_tokens=args.tool_output_tokens,
            answer_tokens=args.answer_tokens,
            nonce=str(os.getpid()),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    summary = summarize(results)
    print(render(results, summary))
    plots = write_files(results, summary, args.out)
    print(f"\nJSON: {args.out / 'bench-vllm.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 0 if not summary["failed"] else 1
