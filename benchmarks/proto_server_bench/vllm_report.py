"""`bench vllm`: what a run says (each path's figures per turn, the ratios and the goals, the
table, the plots) and the command (`run`, and its settings)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from proto_server.compose import connect_vllm
from proto_server.core.ranges import at_least, positive
from proto_server.core.settings import setting
from proto_server.launch import Launch
from proto_server_bench.paths import OURS, THEIRS
from proto_server_bench.report import NO_PLOTS, pyplot
from proto_server_bench.vllm import PLOTS, Turn, measure

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
    """bench-vllm.json and the PNGs, or why there are no plots (without matplotlib)."""
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


@attrs.frozen(kw_only=True)
class VllmBenchSettings:
    """What `bench vllm` runs: each field is a flag of its."""

    engine_url: str | None = setting(
        None, metavar="URL", required=True, help="the engine's base, ending in /v1"
    )
    engine_pid: int | None = setting(
        None, positive, metavar="PID", required=True,
        help="the process id of vLLM's API server (python -m vllm.entrypoints.openai.api_server)",
    )  # fmt: skip
    model: str | None = setting(None, metavar="NAME", help="the served model, if several")
    tokenizer: str | None = setting(None, metavar="PATH", help="as for serve")
    turns: int = setting(8, at_least(1), help="turns of the loop")
    tool_output_tokens: int = setting(
        400, at_least(1), metavar="N",
        help="mean size of each turn's tool output, in the model's tokens (0.75x to 1.25x)",
    )  # fmt: skip
    answer_tokens: int = setting(
        32, at_least(1), metavar="N",
        help="most tokens the model decodes each turn (proto-server's --max-tokens, vLLM's "
        "max_output_tokens)",
    )  # fmt: skip
    out: Path = setting(
        Path("bench-results/vllm"), metavar="DIR", help="where bench-vllm.json and the plots go"
    )


def run(args: VllmBenchSettings) -> int:
    """`proto-server bench vllm`: the generator serve would run, measured against vLLM's own."""
    # the served model's name and tokenizer
    assert args.engine_url is not None and args.engine_pid is not None  # required flags
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
