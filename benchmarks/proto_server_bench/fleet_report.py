"""`bench fleet`: what a run says: each policy's summary and the ratios against proto-server's,
the table, the plots, and the command (`main`)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import attrs

from proto_server_bench.agents import percentile
from proto_server_bench.fleet import (
    CONTINUUM,
    PLOTS,
    POLICIES,
    RATIOS,
    THUNDERAGENT,
    THUNDERAGENT_GOAL,
    FleetSettings,
    Progress,
    make_rollouts,
)
from proto_server_bench.fleet_simulate import PolicyRun, simulate
from proto_server_bench.report import NO_PLOTS, pyplot
from proto_server_bench.tables import table

# -- what a run says -----------------------------------------------------------------------------


def summarize(run: PolicyRun) -> dict[str, Any]:
    jct = run.jct_s
    need = run.unbounded_need_tokens
    return {
        "policy": run.policy,
        "time": "modelled (virtual time)",
        "jct_mean_s": statistics.fmean(jct),
        "jct_p50_s": percentile(jct, 0.5),
        "jct_p99_s": percentile(jct, 0.99),
        "makespan_s": run.makespan_s,
        "prompt_tokens": run.prompt_tokens,
        "cached_tokens": run.cached_tokens,
        "prefilled_tokens": run.prefilled_tokens,
        "unbounded_need_tokens": need,
        "prefilled_vs_unbounded": run.prefilled_tokens / need if need else math.nan,
        "kv_hit_rate": run.cached_tokens / run.prompt_tokens if run.prompt_tokens else math.nan,
        "preemptions": run.preemptions,
        "evictions_blocks": run.evictions,
        "demotions": run.demotions,
        "admission_wait_s_mean": run.admission_wait_s / max(1, len(jct)),
        "engine_steps": run.steps,
        "cpu_s": run.cpu_s,
        "counters": run.counters,
    }


def run_fleet(settings: FleetSettings, progress: Progress) -> dict[str, Any]:
    """Every policy on the same workload; the figures, side by side."""
    rollouts = make_rollouts(settings)
    turns = [len(r.output_tokens) for r in rollouts]
    finals = [
        r.prompt(len(r.output_tokens) - 1, settings.shared_tokens) + r.output_tokens[-1]
        for r in rollouts
    ]
    progress(
        f"fleet: {len(rollouts)} rollouts, {sum(turns)} turns on {settings.replicas} "
        f"modelled replicas of {settings.cache_tokens:,} cached tokens"
    )
    runs = []
    for policy in POLICIES:
        run = simulate(settings, rollouts, policy)
        progress(f"fleet: {policy}: {run.steps:,} modelled engine steps, {run.cpu_s:.1f} s CPU")
        runs.append(run)
    summaries = [summarize(run) for run in runs]
    by_name = {p["policy"]: p for p in summaries}
    proto = by_name["proto-server"]

    def over_proto(peer: str) -> dict[str, float]:
        return {key: by_name[peer][key] / proto[key] if proto[key] else math.nan for key in RATIOS}

    return {
        "settings": attrs.asdict(settings, value_serializer=_plain),
        "workload": {
            "rollouts": len(rollouts),
            "turns": {"total": sum(turns), "median": statistics.median(turns), "max": max(turns)},
            "final_context_tokens": {"median": statistics.median(finals), "max": max(finals)},
            "working_set_vs_caches": sum(finals) / (settings.cache_tokens * settings.replicas),
        },
        "policies": summaries,
        "plain_over_proto_server": over_proto("plain"),
        "thunderagent_over_proto_server": over_proto(THUNDERAGENT),
        "continuum_over_proto_server": over_proto(CONTINUUM),
        "jct_s": {run.policy: list(run.jct_s) for run in runs},
    }


def _plain(instance: Any, field: Any, value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def render(data: dict[str, Any]) -> str:
    s, w = data["settings"], data["workload"]
    lines = [
        f"proto-server bench fleet (MODELLED: virtual time, a discrete-event simulation): "
        f"{w['rollouts']} rollouts ({w['turns']['total']:,} turns, median "
        f"{w['turns']['median']:.0f}) on {s['replicas']} replicas, each a KV cache of "
        f"{s['cache_tokens']:,} tokens in "
        f"blocks of {s['block_tokens']}, at most {s['max_running']} running, prefill "
        f"{s['prefill_rate']:,.0f} tok/s, a decode step {s['step_s'] * 1000:.0f} ms; final "
        f"contexts median {w['final_context_tokens']['median']:,.0f} tokens; working set "
        f"{w['working_set_vs_caches']:.1f}x the caches; tool waits log-normal median "
        f"{s['wait_s'][0]} s, p99 {s['wait_s'][1]:.1f} s; seed {s['seed']}",
        "",
    ]
    header = [
        "policy",
        "JCT mean s",
        "JCT p50 s",
        "JCT p99 s",
        "makespan s",
        "KV hit rate",
        "prefilled",
        "prefilled/unbounded",
        "preemptions",
        "evicted blocks",
        "demotions",
    ]
    rows = [
        [
            p["policy"],
            f"{p['jct_mean_s']:.1f}",
            f"{p['jct_p50_s']:.1f}",
            f"{p['jct_p99_s']:.1f}",
            f"{p['makespan_s']:.1f}",
            f"{p['kv_hit_rate']:.1%}",
            f"{p['prefilled_tokens']:,}",
            f"{p['prefilled_vs_unbounded']:.2f}x",
            str(p["preemptions"]),
            f"{p['evictions_blocks']:,}",
            str(p["demotions"]),
        ]
        for p in data["policies"]
    ]
    lines += table(header, rows)
    lines += ["", *_peer_lines(data["policies"]), ""]
    r = data["plain_over_proto_server"]
    t = data["thunderagent_over_proto_server"]
    c = data["continuum_over_proto_server"]
    lines += [
        _ratio_line("plain forwarding / proto-server", r),
        _ratio_line("thunderagent (modelled) / proto-server", t),
        _ratio_line("continuum (modelled) / proto-server", c),
        f"Goal: JCT at least 2x better than plain forwarding: "
        f"{'HOLDS' if r['jct_mean_s'] >= 2 else 'FAILS'} on the mean ({r['jct_mean_s']:.2f}x)",
        f"Goal: JCT at least {THUNDERAGENT_GOAL}x better than the modelled ThunderAgent policy: "
        f"{'HOLDS' if t['jct_mean_s'] >= THUNDERAGENT_GOAL else 'FAILS'} on the mean "
        f"({t['jct_mean_s']:.2f}x)",
    ]
    return "\n".join(lines)


def _ratio_line(name: str, r: dict[str, float]) -> str:
    return (
        f"{name} (above 1: proto-server better): JCT mean {r['jct_mean_s']:.2f}x, p50 "
        f"{r['jct_p50_s']:.2f}x, p99 {r['jct_p99_s']:.2f}x, makespan {r['makespan_s']:.2f}x, "
        f"prefilled {r['prefilled_tokens']:.2f}x"
    )


def _peer_lines(policies: list[dict[str, Any]]) -> list[str]:
    """What the modelled peers did, by their own counters."""
    lines = []
    for p in policies:
        c = p["counters"]
        if p["policy"] == THUNDERAGENT:
            lines.append(
                f"{THUNDERAGENT}: {c['ticks']:,} scheduler ticks; {c['queued_new']:,} new "
                f"programs queued; {c['pauses']:,} pauses at tool boundaries "
                f"({c['paused_after_mark']:,} of them marked while running, {c['marks']:,} "
                f"marks); {c['resumes']:,} resumes ({c['migrations']:,} to another replica, "
                f"{c['forced_resumes']:,} forced after 30 min)"
            )
        elif p["policy"] == CONTINUUM:
            lines.append(
                f"{CONTINUUM}: {c['pins']:,} pins (TTL mean {c['ttl_s_mean']:.1f} s), "
                f"{c['pins_used']:,} used by the next turn, {c['pins_expired']:,} expired"
            )
    return lines


def write_files(data: dict[str, Any], directory: Path) -> list[Path] | str:
    """fleet.json and the PNGs, or why there are no plots (without matplotlib)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fleet.json").write_text(json.dumps(data, indent=2))
    plt = pyplot()
    if plt is None:
        return NO_PLOTS
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    for policy, jct in data["jct_s"].items():
        ordered = sorted(jct)
        axes.step(
            ordered,
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            label=policy,
        )
    axes.set(
        title="Job completion time per rollout (modelled, virtual time)",
        xlabel="s",
        ylabel="share of rollouts",
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[0])
    plt.close(figure)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    names = [p["policy"] for p in data["policies"]]
    axes.bar(names, [p["prefilled_tokens"] for p in data["policies"]], label="prefilled")
    need = data["policies"][0]["unbounded_need_tokens"]
    axes.axhline(need, color="black", linestyle="--", label="an unbounded cache's need")
    axes.set(title="Prefilled tokens per policy (modelled)", ylabel="tokens")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[1])
    plt.close(figure)
    return [directory / name for name in PLOTS]


def main(settings: FleetSettings) -> int:
    """The command: the run, its table on stdout, its files; 2 on bad settings."""
    problems = settings.problems()
    if problems:
        for problem in problems:
            print(f"proto-server bench fleet: {problem}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    data = run_fleet(settings, progress)
    print(render(data))
    plots = write_files(data, settings.out_dir)
    print(f"\nSaved {settings.out_dir / 'fleet.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 0
