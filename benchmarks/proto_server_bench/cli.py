"""`proto-server bench`: the four transports side by side, from a fresh install, no arguments.

Why one module of this length: the sections share flags that mean different things in each
(`--rollouts`, `--context-tokens`, `--tool-tokens`, `--wait-s`, `--turns`, `--prefill-rate`), and
argparse takes each flag once. So the shared flags, their defaults and how each section reads them
(`_run_agents`, `_run_fleet`, `run`) are declared in one place.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import orjson
import trio

from proto_server.bench import families, fleet, memory, probes
from proto_server.bench.agents import ADMISSION_CHOICES, ENGINES, AgentsSettings
from proto_server.bench.agents import main as agents_main
from proto_server.bench.measure import ServerSettings
from proto_server.bench.report import render, write_all
from proto_server.bench.runner import TRANSPORT_NAMES, BenchSettings, machine, run_bench
from proto_server.bench.stream_report import (
    render_streaming,
    streaming_targets,
    summarize_streaming,
)
from proto_server.bench.streaming import cold_wake, pacing_floor, run_streaming_only


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 1000,4000, got {text!r}") from None
    if not rates or not all(0 < rate < math.inf for rate in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive and finite, got {text!r}")
    return rates


def _rate(text: str) -> float:
    """One rate (tokens/s, frames/s): positive and finite."""
    rates = _rates(text)
    if len(rates) != 1:
        raise argparse.ArgumentTypeError(f"expected one rate, got {text!r}")
    return rates[0]


def _transports(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in TRANSPORT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown transport(s) {unknown or text!r}; choose from {','.join(TRANSPORT_NAMES)}"
        )
    return names


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    defaults = BenchSettings()
    bench = commands.add_parser(
        "bench",
        help="measure the four transports side by side on a Codex-sized rollout",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run the server in a process of its own and drive the same rollout through "
        "HTTP (stateless and with previous_response_id) and both WebSocket dialects; print a "
        "table, and save JSON and PNG plots.",
    )
    bench.add_argument(
        "section",
        nargs="?",
        choices=("all", "streaming", "agents", "fleet", "memory", "probes", "families"),
        default="all",
        help="what to run: everything, only the streaming measurements (issue 13's figures), "
        "many agents at once on one engine (issue 19's; its flags are under 'agents'), the "
        "scheduler on many modelled replicas in virtual time (its flags under 'fleet'), or peak "
        "RSS per input shape against its memory charge (a server process per shape; the --mb, "
        "--shapes and --steer-flood flags), or hostile requests with a bystander timing how long "
        "each held the event loop (a server process per case; the --probe-* flags), or each "
        "model family's prompt tokens against vLLM's own rendering of the same tool loop "
        "(--tokenizer, --rounds)",
    )
    bench.add_argument(
        "--turns",
        type=int,
        default=None,
        help="requests per rollout (tool rounds + 1 final answer); default: 31 to 51, by the seed",
    )
    bench.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    bench.add_argument(
        "--output-kb",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=defaults.output_kb,
        help="size range of ordinary tool outputs",
    )
    bench.add_argument(
        "--large-share",
        type=float,
        default=defaults.large_share,
        help="share of tool outputs that are large test logs",
    )
    bench.add_argument(
        "--large-kb",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=defaults.large_kb,
        help="size range of the large tool outputs",
    )
    bench.add_argument(
        "--decode-rates",
        type=_rates,
        default=defaults.decode_rates,
        metavar="R1,R2",
        help="modelled decode tokens/s to run at (the write-up's regimes: 65, 1000, 4000)",
    )
    bench.add_argument(
        "--prefill-rate",
        type=_rate,
        default=defaults.prefill_rate,
        metavar="TOKENS_PER_S",
        help="modelled prefill tokens/s for tokens not in any cache",
    )
    bench.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="model no prefix cache across requests (cold paths then prefill their history)",
    )
    bench.add_argument(
        "--repeats", type=int, default=defaults.repeats, help="rollouts per transport and rate"
    )
    bench.add_argument(
        "--transports",
        type=_transports,
        default=defaults.transports,
        metavar="NAMES",
        help=f"comma-separated subset of {','.join(TRANSPORT_NAMES)}",
    )
    bench.add_argument(
        "--no-streaming",
        dest="streaming",
        action="store_false",
        help="skip the streaming measurements",
    )
    bench.add_argument(
        "--stream-rate",
        type=_rate,
        default=defaults.stream_rate,
        help="modelled decode tokens/s of the streaming measurements",
    )
    bench.add_argument(
        "--stream-tokens",
        type=int,
        default=defaults.stream_tokens,
        help="tokens of the unlimited single stream (the paced one gets a quarter, the unmerged "
        "half, each concurrent one and the slow client an eighth)",
    )
    bench.add_argument(
        "--stream-repeats",
        type=int,
        default=defaults.stream_repeats,
        help="runs of each streaming case (the table shows medians)",
    )
    bench.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="TREE",
        help="streaming: also measure the server of another proto-server source tree (e.g. a "
        "`git worktree` of the base commit), case by case in the same run, to compare",
    )
    bench.add_argument("--streams", type=int, default=defaults.streams, help="concurrent streams")
    bench.add_argument(
        "--client-fps",
        type=_rate,
        default=defaults.client_fps,
        help="frames/s the slow client reads",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=defaults.out_dir,
        metavar="DIR",
        help="where bench.json and the plots go",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="profile the server process (cProfile): DIR/server-profile.txt and .pstats",
    )
    _agents_arguments(bench.add_argument_group("agents", "bench agents: many rollouts at once"))
    _fleet_arguments(bench.add_argument_group(
        "fleet", "bench fleet: many rollouts on modelled replicas, virtual time"))  # fmt: skip
    memory.add_arguments(bench)
    probes.add_arguments(bench)
    group = bench.add_argument_group("families", "bench families: prompts against vLLM's own")
    group.add_argument(
        "--tokenizer",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a model directory, or a folder with tokenizer.json and tokenizer_config.json "
        "(repeatable; default: every npm tokenizer installed with the test clients)",
    )
    group.add_argument("--rounds", type=int, default=4, help="tool calls in the rendered tool loop")
    return bench


def _median_p99(text: str) -> tuple[float, float]:
    """`MEDIAN,P99` of a log-normal: both positive and finite, the median no larger."""
    try:
        median, p99 = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MEDIAN,P99 like 1,15, got {text!r}") from None
    if not 0 < median <= p99 < math.inf:
        raise argparse.ArgumentTypeError(f"expected 0 < MEDIAN <= P99, finite; got {text!r}")
    return median, p99


def _agents_arguments(group: argparse._ArgumentGroup) -> None:
    defaults = AgentsSettings()
    group.add_argument("--rollouts", type=int, default=None,
                       help=f"rollouts at once (agents: {defaults.rollouts}; fleet: "
                       f"{fleet.FleetSettings().rollouts})")  # fmt: skip
    group.add_argument(
        "--context-tokens", type=int, default=None, metavar="N",
        help=f"each rollout's own first message, in the model's tokens (agents: "
        f"{defaults.context_tokens}; fleet: the log-normal's median, its p99 4x that)",
    )  # fmt: skip
    group.add_argument(
        "--tool-tokens", type=_median_p99, default=None, metavar="MEDIAN,P99",
        help=f"tool outputs' sizes in the model's tokens (log-normal; agents: "
        f"{_pair(defaults.output_tokens)}; fleet: {_pair(fleet.FleetSettings().tool_tokens)})",
    )  # fmt: skip
    group.add_argument(
        "--wait-s", type=_median_p99, default=None, metavar="MEDIAN,P99",
        help="tools' times in seconds (log-normal; agents: the published gaps' P99/median, "
        "81.4/5.2 s, scaled to a 1 s median; fleet: the published 5.2,81.4)",
    )  # fmt: skip
    group.add_argument(
        "--decode-tokens", type=int, default=defaults.answer_tokens, metavar="N",
        help="agents: most tokens decoded a turn (proto-server's --max-tokens; vLLM's "
        "max_output_tokens on the answer turn, 128 on a forced call's as bench-vllm gives)",
    )  # fmt: skip
    group.add_argument(
        "--engine", choices=ENGINES, default=defaults.engine,
        help="agents: the simulated GPU (proto-server's paths, engine time modelled) or a vLLM "
        "CPU engine (SmolLM2, block size 32; vLLM's own /v1/responses too)",
    )  # fmt: skip
    group.add_argument(
        "--engine-url", action="append", default=None, metavar="URL",
        help="agents, --engine vllm: a running engine's base (ending in /v1); again for another "
        "replica (the launched path then also runs through one server in front of all); "
        "default: start --engines of them",
    )  # fmt: skip
    group.add_argument(
        "--engines", type=int, default=defaults.engines, metavar="N",
        help="agents, --engine vllm: engines to start; more than 1 adds the launched path "
        "through one proto-server in front of all of them, beside it on the first alone",
    )  # fmt: skip
    group.add_argument(
        "--num-gpu-blocks-override", dest="gpu_blocks", type=int, default=None, metavar="N",
        help="agents, --engine vllm: the engine's KV cache in blocks of 32 tokens (pressure)",
    )  # fmt: skip
    group.add_argument(
        "--admission", choices=ADMISSION_CHOICES, default=defaults.admission,
        help="agents: proto-server's paths without the server's admission by KV capacity "
        "(--kv-capacity-tokens; from the engine with vllm), with it, or both side by side; "
        "auto: both where the cache's size is known (vllm, or --num-gpu-blocks-override)",
    )  # fmt: skip
    group.add_argument(
        "--admission-growth", type=float, default=None, metavar="G",
        help="agents: the admitting server's --admission-growth (default: the server's own); "
        "fleet: proto-server's policy's",
    )  # fmt: skip
    group.add_argument(
        "--admission-ttl", dest="admission_ttl_s", type=float, default=None, metavar="S",
        help="agents: the admitting server's --admission-ttl (default: the server's own)",
    )  # fmt: skip
    group.add_argument(
        "--admission-ttl-median", dest="admission_ttl_median", type=float, default=None,
        metavar="K", help="agents: the admitting server's --admission-ttl-median",
    )  # fmt: skip
    group.add_argument(
        "--admission-workers", type=int, default=defaults.admission_workers, metavar="N",
        help="agents, --engine vllm: the admitting server's --workers; more than 1 share the "
        "engine's room through a store file (--admission-shared)",
    )  # fmt: skip
    group.add_argument(
        "--thunderagent-url", default=defaults.thunderagent_url, metavar="URL",
        help="agents, --engine vllm: a ThunderAgent you started in front of the first engine "
        "(thunderagent --backends ENGINE --router tr --metrics), or any proxy that takes a "
        "program_id with chat completions and POST /programs/release: adds its path",
    )  # fmt: skip
    group.add_argument(
        "--vllm-python", default=defaults.vllm_python, metavar="PATH",
        help="agents, --engine vllm: the engine's interpreter ($PROTO_SERVER_VLLM_PYTHON wins)",
    )  # fmt: skip


def _pair(pair: tuple[float, float]) -> str:
    return f"{pair[0]:g},{pair[1]:g}"


def _fleet_arguments(group: argparse._ArgumentGroup) -> None:
    d = fleet.FleetSettings()
    group.add_argument(
        "--replicas", type=int, default=d.replicas, help="fleet: modelled engine replicas"
    )
    group.add_argument(
        "--fleet-turns",
        type=_median_p99,
        default=d.turns,
        metavar="MEDIAN,P99",
        help="fleet: turns a rollout (log-normal; at least 2)",
    )
    group.add_argument(
        "--shared-tokens",
        type=int,
        default=d.shared_tokens,
        metavar="N",
        help="fleet: the prefix every rollout shares (instructions, tools)",
    )
    group.add_argument(
        "--output-tokens",
        type=_median_p99,
        default=d.output_tokens,
        metavar="MEDIAN,P99",
        help="fleet: tokens decoded a turn (log-normal)",
    )
    group.add_argument(
        "--arrival-s",
        type=float,
        default=d.arrival_s,
        metavar="S",
        help="fleet: rollouts start uniformly over this window (0: all at once)",
    )
    group.add_argument(
        "--cache-tokens",
        type=int,
        default=d.cache_tokens,
        metavar="N",
        help="fleet: each replica's KV cache in tokens",
    )
    group.add_argument(
        "--block-tokens",
        type=int,
        default=d.block_tokens,
        metavar="N",
        help="fleet: the KV cache's block (vLLM's --block-size)",
    )
    group.add_argument(
        "--max-running",
        type=int,
        default=d.max_running,
        metavar="N",
        help="fleet: running sequences a replica holds (vLLM's --max-num-seqs)",
    )
    group.add_argument(
        "--step-tokens",
        type=int,
        default=d.step_tokens,
        metavar="N",
        help="fleet: prompt tokens a step prefills at most (vLLM's --max-num-batched-tokens)",
    )
    group.add_argument(
        "--fleet-prefill-rate",
        type=_rate,
        default=d.prefill_rate,
        metavar="TOKENS_PER_S",
        help="fleet: modelled prefill tokens/s of a replica",
    )
    group.add_argument(
        "--step-ms",
        type=_rate,
        default=d.step_s * 1000,
        metavar="MS",
        help="fleet: modelled time of a decode step (a token for every running sequence)",
    )
    group.add_argument(
        "--kv-target-fill",
        type=float,
        default=d.target_fill,
        metavar="FRACTION",
        help="fleet, proto-server's policy: share of a replica's cache admitted rollouts fill; "
        "agents: the admitting server's --kv-target-fill",
    )
    group.add_argument(
        "--ttl-s",
        type=_rate,
        default=d.ttl_s,
        metavar="S",
        help="fleet, proto-server's policy: how long a suspended rollout keeps "
        "its place (the server's --admission-ttl)",
    )
    group.add_argument(
        "--ttl-median",
        type=_rate,
        default=None,
        metavar="K",
        help="fleet, proto-server's policy: the place kept K times the median time away, at "
        "most --ttl-s (the server's --admission-ttl-median)",
    )
    group.add_argument(
        "--bypass",
        type=int,
        default=d.bypass,
        metavar="N",
        help="fleet, proto-server's policy: waiters smallest first, the oldest passed by at "
        "most N (the server's --admission-bypass; 0: first come first served)",
    )
    group.add_argument(
        "--thunderagent-interval",
        type=_rate,
        default=d.thunder_interval_s,
        metavar="S",
        help="fleet, the modelled ThunderAgent: its --scheduler-interval (pause and resume "
        "every S seconds)",
    )
    group.add_argument(
        "--thunderagent-decay",
        action="store_true",
        help="fleet, the modelled ThunderAgent: its --use-acting-token-decay (a program on its "
        "tool counts 2^-t of its tokens after t s, when resuming)",
    )
    group.add_argument(
        "--continuum-ttl",
        type=_rate,
        default=d.continuum_ttl_s,
        metavar="S",
        help="fleet, the modelled Continuum: the TTL it pins for until it has seen more than "
        "100 tool times (its 2 s)",
    )


def _run_fleet(args: argparse.Namespace) -> int:
    d = fleet.FleetSettings()
    context = (
        d.context_tokens
        if args.context_tokens is None
        else (float(args.context_tokens), 4.0 * args.context_tokens)
    )
    settings = fleet.FleetSettings(
        rollouts=d.rollouts if args.rollouts is None else args.rollouts,
        replicas=args.replicas,
        seed=args.seed,
        turns=args.fleet_turns,
        shared_tokens=args.shared_tokens,
        context_tokens=context,
        tool_tokens=d.tool_tokens if args.tool_tokens is None else args.tool_tokens,
        output_tokens=args.output_tokens,
        wait_s=d.wait_s if args.wait_s is None else args.wait_s,
        arrival_s=args.arrival_s,
        cache_tokens=args.cache_tokens,
        block_tokens=args.block_tokens,
        max_running=args.max_running,
        step_tokens=args.step_tokens,
        prefill_rate=args.fleet_prefill_rate,
        step_s=args.step_ms / 1000,
        target_fill=args.kv_target_fill,
        ttl_s=args.ttl_s,
        ttl_median=args.ttl_median,
        bypass=args.bypass,
        growth=d.growth if args.admission_growth is None else args.admission_growth,
        thunder_interval_s=args.thunderagent_interval,
        thunder_decay=args.thunderagent_decay,
        continuum_ttl_s=args.continuum_ttl,
        out_dir=args.out,
    )
    return fleet.main(settings)


def _run_agents(args: argparse.Namespace) -> int:
    d = AgentsSettings()
    settings = AgentsSettings(
        rollouts=d.rollouts if args.rollouts is None else args.rollouts,
        turns=4 if args.turns is None else args.turns,
        context_tokens=d.context_tokens if args.context_tokens is None else args.context_tokens,
        output_tokens=d.output_tokens if args.tool_tokens is None else args.tool_tokens,
        wait_s=d.wait_s if args.wait_s is None else args.wait_s,
        seed=args.seed,
        engine=args.engine,
        engine_urls=tuple(args.engine_url or ()),
        engines=args.engines,
        gpu_blocks=args.gpu_blocks,
        vllm_python=args.vllm_python,
        answer_tokens=args.decode_tokens,
        prefill_rate=args.prefill_rate,
        out_dir=args.out,
        admission=args.admission,
        admission_ttl_s=args.admission_ttl_s,
        admission_growth=args.admission_growth,
        admission_ttl_median=args.admission_ttl_median,
        admission_workers=args.admission_workers,
        kv_target_fill=args.kv_target_fill,
        thunderagent_url=args.thunderagent_url,
    )
    return agents_main(settings)


def run(args: argparse.Namespace) -> int:
    if args.section == "memory":
        return memory.run(args)
    if args.section == "probes":
        return probes.run(args)
    if args.section == "families":
        if args.rounds < 1:
            print("proto-server bench families: --rounds must be at least 1", file=sys.stderr)
            return 2
        return families.main(args.tokenizer, args.rounds)
    if args.section == "fleet":
        return _run_fleet(args)
    if args.turns is not None and args.turns < 2:
        print("proto-server bench: --turns must be at least 2 (a tool round and the answer)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.repeats < 1 or args.streams < 1 or args.stream_repeats < 1 or args.stream_tokens < 64:
        print("proto-server bench: --repeats, --streams and --stream-repeats must be at least 1, "
              "--stream-tokens at least 64", file=sys.stderr)  # fmt: skip
        return 2
    if args.against is not None and not (args.against / "proto_server").is_dir():
        print(f"proto-server bench: --against {args.against}: no proto_server package there",
              file=sys.stderr)  # fmt: skip
        return 2
    settings = BenchSettings(
        rounds=None if args.turns is None else args.turns - 1,
        seed=args.seed,
        output_kb=tuple(args.output_kb),
        large_share=args.large_share,
        large_kb=tuple(args.large_kb),
        decode_rates=args.decode_rates,
        prefill_rate=args.prefill_rate,
        prefix_cache=args.prefix_cache,
        repeats=args.repeats,
        transports=args.transports,
        streaming=args.streaming,
        stream_rate=args.stream_rate,
        stream_tokens=args.stream_tokens,
        streams=args.streams,
        client_fps=args.client_fps,
        stream_repeats=args.stream_repeats,
        out_dir=args.out,
        profile=args.profile,
    )
    if args.section == "agents":
        return _run_agents(args)
    progress = partial(print, file=sys.stderr, flush=True)
    if args.section == "streaming":
        return _run_streaming(settings, args.against, progress)
    run = trio.run(run_bench, settings, progress)
    summary, path, plots = write_all(run)
    print(render(summary))
    print(f"\nSaved {path}")
    if isinstance(plots, str):
        print(plots)
    else:
        print("Plots: " + ", ".join(str(p) for p in plots))
    if settings.profile:
        print(f"Server profile: {settings.out_dir / 'server-profile.txt'} (and .pstats)")
    return 0


def _run_streaming(
    settings: BenchSettings, against: Path | None, progress: Callable[[str], None]
) -> int:
    """`proto-server bench streaming`: the streaming cases alone; a table and streaming.json."""
    server_settings = ServerSettings(
        prefill_rate=settings.prefill_rate,
        prefix_cache=settings.prefix_cache,
        profile_dir=str(settings.out_dir) if settings.profile else None,
    )
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = trio.run(
        partial(
            run_streaming_only,
            server_settings,
            settings.stream_cases(),
            repeats=settings.stream_repeats,
            progress=progress,
            against=against,
        )
    )
    rate = settings.stream_rate
    floor = trio.run(pacing_floor, rate, max(64, int(rate)))  # a second of the schedule
    hot_us, cold_us = cold_wake(rate)
    rows = summarize_streaming(results)
    found = streaming_targets(rows)
    lines = [
        f"proto-server bench streaming: {machine()['cpus']} CPUs; took "
        f"{time.perf_counter() - started:.0f} s",
        "",
        *render_streaming(rows),
        "",
        f"Pacing floor: a trio task that only sleeps until each token is due at {rate:,.0f} "
        f"tok/s costs {floor:.1f} us/token of CPU here (the simulated GPU's share of the paced "
        "case's us/token; measured alone in the benchmark's process).",
        f"Cold wakes: the same work (a text delta encoded 8 times) takes {hot_us:.1f} us back to "
        f"back and {cold_us:.1f} us right after sleeping one token's interval "
        f"({cold_us / hot_us:.1f}x): a paced token's work runs cold, an unlimited one's hot.",
        "",
        "Targets (this tree):",
        *(f"  [{'HOLDS' if t.holds else 'FAILS'}] {t.name}: {t.detail}" for t in found),
    ]
    print("\n".join(lines))
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    path = settings.out_dir / "streaming.json"
    data = {
        "machine": machine(),
        "streaming": rows,
        "targets": [attrs.asdict(t) for t in found],
        "pacing_floor_us_per_token": floor,
        "cold_wake_us": {"back_to_back": hot_us, "after_a_token_interval": cold_us},
        "raw": [attrs.asdict(r) for r in results],
    }
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    print(f"\nSaved {path}")
    if settings.profile:
        print(f"Server profile: {settings.out_dir / 'server-profile.txt'} (and .pstats)")
    return 0
