"""What a run says: summaries, the targets of issue 6, a terminal table, JSON, PNG plots.

Medians everywhere (the machine is shared and noisy); ratios are taken against HTTP stateless
within the same repeat and decode rate, then the median of those ratios is reported, so a slow
moment hurts both sides of a ratio alike. Server-side per-turn costs do not depend on the decode
rate, so per-turn medians pool every rollout of a transport.

The summaries, the targets, the table and the plots all read the same medians (`per_turn`,
`_totals`) of one `BenchRun`, and each target is judged on the rows the table prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import orjson

from proto_server_bench.runner import BenchRun, Rollout
from proto_server_bench.stream_report import (
    render_streaming,
    streaming_targets,
    summarize_streaming,
)
from proto_server_bench.tables import Target, table
from proto_server_bench.transports import BASELINE, TRANSPORTS

WARM = ("ws-launched", "ws-prototype")
LABELS = {t.name: t.label for t in TRANSPORTS}
PLOTS = (
    "server-cpu-per-turn.png",
    "pre-inference-per-turn.png",
    "bytes-per-turn.png",
    "end-to-end.png",
)


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")


# -- summaries -----------------------------------------------------------------------------------


def _totals(rollout: Rollout) -> dict[str, float]:
    client, server = rollout.client, rollout.server
    return {
        "end_to_end_s": rollout.seconds,
        "server_cpu_s": sum(t.server_cpu_ms for t in server) / 1e3,
        "modelled_gpu_s": sum(t.modelled_prefill_ms + t.modelled_decode_ms for t in server) / 1e3,
        "modelled_decode_s": sum(t.modelled_decode_ms for t in server) / 1e3,
        "client_cpu_s": sum(t.cpu_s for t in client),
        "bytes_up": sum(t.bytes_up for t in client),
        "bytes_down": sum(t.bytes_down for t in client),
        "rendered_tokens": sum(t.rendered_tokens for t in server),
        "prefilled_tokens": sum(t.prefilled_tokens for t in server),
    }


def rollout_summary(run: BenchRun) -> list[dict[str, Any]]:
    """Per decode rate and transport: medians over repeats, and the ratio to HTTP stateless."""
    rows = []
    for rate in run.settings.decode_rates:
        at_rate = [r for r in run.rollouts if r.decode_rate == rate]
        baseline = {r.repeat: r.seconds for r in at_rate if r.transport == BASELINE}
        for name in _transports(run):
            mine = [r for r in at_rate if r.transport == name]
            if not mine:
                continue
            totals = [_totals(r) for r in mine]
            row: dict[str, Any] = {"decode_rate": rate, "transport": name}
            for key in totals[0]:
                row[key] = median(t[key] for t in totals)
            ratios = [r.seconds / baseline[r.repeat] for r in mine if r.repeat in baseline]
            row["ratio_to_baseline"] = median(ratios) if ratios else None
            rows.append(row)
    return rows


def _transports(run: BenchRun) -> list[str]:
    return [t.name for t in TRANSPORTS if t.name in run.settings.transports]


def per_turn(run: BenchRun, name: str, field: Callable[[Rollout, int], float]) -> list[float]:
    """The median over every rollout of `name` of `field(rollout, turn)`, turn by turn."""
    mine = [r for r in run.rollouts if r.transport == name]
    if not mine:
        return []
    turns = min(len(r.client) for r in mine)
    return [median(field(r, i) for r in mine) for i in range(turns)]


def _server(attribute: str) -> Callable[[Rollout, int], float]:
    def field(rollout: Rollout, turn: int) -> float:
        value: float = getattr(rollout.server[turn], attribute)
        return value

    return field


def _history(rollout: Rollout, turn: int) -> float:
    return float(rollout.server[turn].prompt_tokens)


DEEP_HISTORY = 100_000


def turn_summary(run: BenchRun) -> list[dict[str, Any]]:
    """Per transport: turn 1 against the last tool turn (the most history; the final turn
    streams a long message and is not like the others), and pre-inference time over the "deep"
    turns, those with 100k+ tokens of history (or the last tool turn if none has)."""
    rows = []
    deep: list[int] = []
    for name in _transports(run):
        cpu = per_turn(run, name, _server("server_cpu_ms"))
        if not cpu:
            continue
        pre = per_turn(run, name, _server("pre_inference_ms"))
        decode = per_turn(run, name, _server("decode_ms"))
        prepare = per_turn(run, name, _server("prepare_ms"))
        up = per_turn(run, name, lambda r, i: float(r.client[i].bytes_up))
        rendered = per_turn(run, name, _server("rendered_tokens"))
        history = per_turn(run, name, _history)
        last = max(0, len(cpu) - 2)
        if not deep:  # the same turns for every transport: the first one's
            deep = [i for i, h in enumerate(history) if h >= DEEP_HISTORY] or [last]
        rows.append(
            {
                "transport": name,
                "last_tool_turn": last + 1,
                "history_tokens": history[last],
                "server_cpu_ms_first": cpu[0],
                "server_cpu_ms_last": cpu[last],
                "server_cpu_growth": cpu[last] / cpu[0],
                "pre_inference_ms_first": pre[0],
                "pre_inference_ms_last": pre[last],
                "bytes_up_last": up[last],
                "rendered_tokens_last": rendered[last],
                "deep_turns": [i + 1 for i in deep],
                "deep_history_tokens": min(history[i] for i in deep),
                "pre_inference_ms_deep": median(pre[i] for i in deep),
                "decode_ms_deep": median(decode[i] for i in deep),
                "prepare_ms_deep": median(prepare[i] for i in deep),
                "start_ms_deep": median(pre[i] - decode[i] - prepare[i] for i in deep),
                "rendered_tokens_deep": median(rendered[i] for i in deep),
            }
        )
    return rows


# -- targets -------------------------------------------------------------------------------------


def targets(
    run: BenchRun, rollouts: list[dict[str, Any]], turns: list[dict[str, Any]]
) -> list[Target]:
    by_turn = {row["transport"]: row for row in turns}
    found: list[Target] = []
    cold = by_turn.get(BASELINE)
    for name in WARM:
        row = by_turn.get(name)
        if row is None:
            continue
        big = row["history_tokens"] >= 100_000
        found.append(
            Target(
                f"{name}: server time flat (last tool turn within 1.5x of turn 1, 100k+ history)",
                row["server_cpu_growth"] <= 1.5 and big,
                f"{row['server_cpu_ms_first']:.1f} ms -> {row['server_cpu_ms_last']:.1f} ms "
                f"({row['server_cpu_growth']:.2f}x) at {row['history_tokens']:,.0f} tokens",
            )
        )
    if cold is not None:
        found.append(
            Target(
                "http-stateless: server time grows with history",
                cold["server_cpu_growth"] > 1.5,
                f"{cold['server_cpu_ms_first']:.1f} ms -> {cold['server_cpu_ms_last']:.1f} ms "
                f"({cold['server_cpu_growth']:.2f}x) at {cold['history_tokens']:,.0f} tokens",
            )
        )
        for name in WARM:
            row = by_turn.get(name)
            if row is None:
                continue
            warm, base = row["pre_inference_ms_deep"], cold["pre_inference_ms_deep"]
            turns = row["deep_turns"]
            found.append(
                Target(
                    f"{name}: pre-inference < 2 ms median with {DEEP_HISTORY:,}+ tokens of history",
                    warm < 2.0 and row["deep_history_tokens"] >= DEEP_HISTORY,
                    f"{warm:.2f} ms over turns {turns[0]}-{turns[-1]} (decode "
                    f"{row['decode_ms_deep']:.2f}, extend and render "
                    f"{row['rendered_tokens_deep']:,.0f} new tokens {row['prepare_ms_deep']:.2f}, "
                    f"start {row['start_ms_deep']:.2f}) vs http-stateless {base:.2f} ms at the "
                    f"same turns ({base / warm:.0f}x less)",
                )
            )
    reductions = {}
    for row in rollouts:
        if row["transport"] == "ws-prototype" and row["ratio_to_baseline"] is not None:
            reductions[row["decode_rate"]] = 1 - row["ratio_to_baseline"]
    if 1000.0 in reductions:
        cut = reductions[1000.0]
        found.append(
            Target(
                "1,000 tok/s: ws-prototype end to end >= 40% lower than http-stateless",
                cut >= 0.40,
                f"{cut:.0%} lower",
            )
        )
    if 4000.0 in reductions:
        cut = reductions[4000.0]
        more = cut > reductions.get(1000.0, -1.0)
        found.append(
            Target(
                "4,000 tok/s: ws-prototype end to end lower still (>= 40%, more than at 1,000)",
                cut >= 0.40 and more,
                f"{cut:.0%} lower",
            )
        )
    return found


def projected_65(run: BenchRun) -> dict[str, float] | None:
    """End to end at 65 tok/s, projected from the 1,000 tok/s rollouts: the measured time with
    the modelled decode time rescaled. Not a measurement; None when 65 was run or 1,000 was not."""
    rates = run.settings.decode_rates
    if 65.0 in rates or 1000.0 not in rates:
        return None
    projected = {}
    for name in _transports(run):
        mine = [r for r in run.rollouts if r.transport == name and r.decode_rate == 1000.0]
        times = [r.seconds + _totals(r)["modelled_decode_s"] * (1000.0 / 65.0 - 1.0) for r in mine]
        if times:
            projected[name] = median(times)
    return projected


# -- the table -----------------------------------------------------------------------------------


def render(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    workload = summary["workload"]
    lines = [
        f"proto-server bench: {workload['turns']} turns ({workload['tool_rounds']} tool rounds), "
        f"seed {workload['seed']}, {settings['repeats']} repeat(s), prefix cache "
        f"{'on' if settings['prefix_cache'] else 'off'}, modelled prefill "
        f"{settings['prefill_rate']:,.0f} tok/s; {summary['machine']['cpus']} CPUs; "
        f"took {summary['seconds']:.0f} s",
        "Measured: end to end (client), server CPU, client CPU, bytes. Modelled (simulated GPU): "
        "GPU time.",
        "",
        "Per rollout (median of repeats; ratio = end to end / http-stateless's, same repeat):",
    ]
    header = ["tok/s", "transport", "end to end s", "ratio", "server CPU s", "modelled GPU s",
              "client CPU s", "MB up", "MB down", "tokens rendered",
              "tokens prefilled"]  # fmt: skip
    rows = [
        [
            f"{r['decode_rate']:g}",
            r["transport"],
            f"{r['end_to_end_s']:.2f}",
            f"{r['ratio_to_baseline']:.2f}" if r["ratio_to_baseline"] is not None else "-",
            f"{r['server_cpu_s']:.2f}",
            f"{r['modelled_gpu_s']:.2f}",
            f"{r['client_cpu_s']:.2f}",
            f"{r['bytes_up'] / 1e6:.2f}",
            f"{r['bytes_down'] / 1e6:.2f}",
            f"{r['rendered_tokens']:,.0f}",
            f"{r['prefilled_tokens']:,.0f}",
        ]
        for r in summary["rollouts"]
    ]
    lines += table(header, rows)
    if summary["projected_65"]:
        projected = summary["projected_65"]
        base = projected.get(BASELINE)
        parts = [
            f"{name} {seconds:.1f} s" + (f" ({seconds / base:.2f})" if base else "")
            for name, seconds in projected.items()
        ]
        lines += ["", "At 65 tok/s, projected (not run): " + ", ".join(parts)]
    lines += [
        "",
        "Per turn, server side (median of all rollouts): turn 1 -> the last tool turn; 100k+: "
        "median over the turns with 100k+ tokens of history, pre-inference = decode (request in "
        "-> event) + prepare (store lookup, rebuild or extend, render) + start (-> generator "
        "runs); wall clock, ms:",
    ]
    header = ["transport", "history tokens", "server CPU ms", "growth", "pre-inference ms",
              "100k+: pre-inference ms", "decode/prepare/start", "KB up, last",
              "tokens rendered, last"]  # fmt: skip
    rows = [
        [
            t["transport"],
            f"{t['history_tokens']:,.0f}",
            f"{t['server_cpu_ms_first']:.1f} -> {t['server_cpu_ms_last']:.1f}",
            f"{t['server_cpu_growth']:.2f}x",
            f"{t['pre_inference_ms_first']:.2f} -> {t['pre_inference_ms_last']:.2f}",
            f"{t['pre_inference_ms_deep']:.2f}",
            f"{t['decode_ms_deep']:.2f}/{t['prepare_ms_deep']:.2f}/{t['start_ms_deep']:.2f}",
            f"{t['bytes_up_last'] / 1e3:.1f}",
            f"{t['rendered_tokens_last']:,.0f}",
        ]
        for t in summary["turns"]
    ]
    lines += table(header, rows)
    if summary["streaming"]:
        lines += ["", *render_streaming(summary["streaming"])]
    lines += ["", "Targets:"]
    for target in summary["targets"]:
        verdict = {True: "HOLDS", False: "FAILS", None: "n/a"}[target["holds"]]
        lines.append(f"  [{verdict}] {target['name']}: {target['detail']}")
    return "\n".join(lines)


# -- JSON and plots ------------------------------------------------------------------------------


def summarize(run: BenchRun) -> dict[str, Any]:
    rollouts = rollout_summary(run)
    turns = turn_summary(run)
    streaming = summarize_streaming(run.streaming)
    return {
        "settings": {
            **attrs.asdict(run.settings, filter=lambda a, _: a.name != "out_dir"),
            "out_dir": str(run.settings.out_dir),
        },
        "machine": run.machine,
        "workload": run.workload,
        "seconds": run.seconds,
        "rollouts": rollouts,
        "turns": turns,
        "projected_65": projected_65(run),
        "streaming": streaming,
        "targets": [
            attrs.asdict(t)
            for t in [
                *targets(run, rollouts, turns),
                *(streaming_targets(streaming) if streaming else []),
            ]
        ],
    }


def write_json(run: BenchRun, summary: dict[str, Any], path: Path) -> None:
    data = {
        **summary,
        "raw": [
            {
                "transport": r.transport,
                "decode_rate": r.decode_rate,
                "repeat": r.repeat,
                "end_to_end_s": r.seconds,
                "turns": [
                    {"client": attrs.asdict(c), "server": attrs.asdict(s)}
                    for c, s in zip(r.client, r.server, strict=True)
                ],
            }
            for r in run.rollouts
        ],
    }
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


#: What a benchmark says instead of its plots when matplotlib is not installed.
NO_PLOTS = "plots skipped: matplotlib is not installed (pip install 'matplotlib>=3.8')"


def pyplot() -> Any:
    """matplotlib's pyplot on its file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(run: BenchRun, summary: dict[str, Any], directory: Path) -> list[Path] | str:
    """The PNGs, or why there are none (matplotlib is the `bench` extra)."""
    plt = pyplot()
    if plt is None:
        return NO_PLOTS
    names = _transports(run)
    written = []

    def per_turn_plot(filename: str, title: str, ylabel: str, field: Any) -> None:
        figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
        for name, style in zip(names, ("-", "--", "-.", ":"), strict=False):
            values = per_turn(run, name, field)
            axes.plot(range(1, len(values) + 1), values, style, marker=".", label=LABELS[name])
        axes.set_yscale("log")
        axes.set(title=title, xlabel="turn", ylabel=ylabel)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(directory / filename)
        plt.close(figure)
        written.append(directory / filename)

    per_turn_plot(PLOTS[0], "Server CPU per turn (measured)", "ms", _server("server_cpu_ms"))
    per_turn_plot(
        PLOTS[1],
        "Pre-inference: request in -> generator starts (measured)",
        "ms",
        _server("pre_inference_ms"),
    )
    per_turn_plot(
        PLOTS[2],
        "Client -> server bytes per turn (measured)",
        "bytes",
        lambda r, i: float(r.client[i].bytes_up),
    )
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    rates = run.settings.decode_rates
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        rows = {r["decode_rate"]: r for r in summary["rollouts"] if r["transport"] == name}
        heights = [rows[rate]["end_to_end_s"] if rate in rows else 0.0 for rate in rates]
        gpu = [rows[rate]["modelled_gpu_s"] if rate in rows else 0.0 for rate in rates]
        xs = [i + index * width for i in range(len(rates))]
        axes.bar(xs, heights, width, label=LABELS[name])
        axes.bar(xs, gpu, width, color="black", alpha=0.25)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(rates))])
    axes.set_xticklabels([f"{rate:g} tok/s" for rate in rates])
    axes.set(title="End to end per rollout (shaded: modelled GPU time)", ylabel="seconds")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[3])
    plt.close(figure)
    written.append(directory / PLOTS[3])
    return written


def write_all(run: BenchRun) -> tuple[dict[str, Any], Path, list[Path] | str]:
    directory = run.settings.out_dir
    directory.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    path = directory / "bench.json"
    write_json(run, summary, path)
    return summary, path, write_plots(run, summary, directory)
