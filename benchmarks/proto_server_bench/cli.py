"""`proto-server bench <section>`: a subcommand per benchmark, its flags the fields of its
settings class (core/settings.py's `setting`, as `serve`'s are), read back with `from_flags`.

`proto-server bench` with no section (or flags only) is `bench all`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import attrs
import orjson
import trio

from proto_server.core import settings as declared
from proto_server.core.ranges import InvalidSetting
from proto_server.core.settings import add_flags, from_flags, setting
from proto_server.launch import LocalModel
from proto_server_bench import (
    detached,
    families,
    fleet,
    fleet_report,
    local,
    memory,
    probes,
    vllm_report,
)
from proto_server_bench.agents import AgentsSettings
from proto_server_bench.agents_run import main as agents_main
from proto_server_bench.measure import ServerSettings
from proto_server_bench.report import render, write_all
from proto_server_bench.runner import BenchSettings, machine, run_bench
from proto_server_bench.stream_report import (
    render_streaming,
    streaming_targets,
    summarize_streaming,
)
from proto_server_bench.streaming import cold_wake, pacing_floor, run_streaming_only


@attrs.frozen(kw_only=True)
class Output:
    """Where a section that has no settings class of its own for it writes."""

    out: Path = setting(Path("bench-results"), metavar="DIR", help="where the JSON goes")


@attrs.frozen
class Section:
    """A subcommand: what it is, the classes its flags are the fields of, how it runs."""

    name: str
    help: str
    description: str
    settings: tuple[type, ...]
    run: Callable[[argparse.Namespace], int]


def _all(args: argparse.Namespace) -> int:
    settings = from_flags(BenchSettings, args)
    run = trio.run(run_bench, settings, partial(print, file=sys.stderr, flush=True))
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


def _streaming(args: argparse.Namespace) -> int:
    settings = from_flags(BenchSettings, args)
    if args.against is not None and not (args.against / "proto_server").is_dir():
        print(f"proto-server bench streaming: --against {args.against}: no proto_server "
              "package there", file=sys.stderr)  # fmt: skip
        return 2
    if args.against is not None and not (args.against / "benchmarks").is_dir():
        # its server runs this run's benchmark code, which a tree from before the benchmarks
        # left the package (proto_server/bench) cannot import
        print(f"proto-server bench streaming: --against {args.against}: no benchmarks/ "
              "there (a tree from before the benchmarks left the package); run that tree's "
              "own `proto-server bench streaming` beside this one's", file=sys.stderr)  # fmt: skip
        return 2
    return _run_streaming(settings, args.against, partial(print, file=sys.stderr, flush=True))


def _families(args: argparse.Namespace) -> int:
    settings = from_flags(families.FamiliesSettings, args)
    return families.main([Path(name) for name in settings.tokenizer], settings.rounds)


SECTIONS = (
    Section(
        "all",
        "the four transports side by side on a Codex-sized rollout, and the streaming cases",
        "Run the server in a process of its own and drive the same rollout through HTTP "
        "(stateless and with previous_response_id) and both WebSocket dialects; print a table, "
        "and save JSON and PNG plots.",
        (BenchSettings,),
        _all,
    ),
    Section(
        "streaming",
        "only the streaming measurements",
        "The streaming cases alone (paced, unlimited, concurrent, a slow client): a table, "
        "the targets and streaming.json.",
        (BenchSettings,),
        _streaming,
    ),
    Section(
        "agents",
        "many agents on one engine (a traffic shape), path after path",
        "Many rollouts at once on the simulated GPU or a vLLM CPU engine, through each of "
        "proto-server's paths and, on vLLM, its peers: makespan, prefill, cached share, TTFT.",
        (AgentsSettings,),
        lambda args: agents_main(from_flags(AgentsSettings, args)),
    ),
    Section(
        "fleet",
        "the scheduler on many modelled replicas, in virtual time",
        "A discrete-event simulation of many rollouts on modelled engine replicas under each "
        "policy (plain, affinity, the modelled Continuum and ThunderAgent, proto-server's).",
        (fleet.FleetSettings,),
        lambda args: fleet_report.main(from_flags(fleet.FleetSettings, args)),
    ),
    Section(
        "memory",
        "peak RSS per input shape against its memory charge",
        "A server process per shape: its peak RSS for one request of the shape against what "
        "the memory budget charged; or the steer flood (--steer-flood).",
        (memory.MemorySettings, Output),
        lambda args: memory.run(from_flags(memory.MemorySettings, args), args.out),
    ),
    Section(
        "detached",
        "streamed Responses whose clients went away, their events kept for a reattach",
        "One server process: N clients each stream a Response over SSE and go after a few "
        "events; once the Responses ended, the resident set each added against its kept "
        "events' bytes and against what the memory budget charged for it.",
        (detached.DetachedSettings, Output),
        lambda args: detached.run(from_flags(detached.DetachedSettings, args), args.out),
    ),
    Section(
        "probes",
        "hostile requests with a bystander timing the event loop",
        "A server process per case: how long each hostile request held the event loop (a "
        "bystander asks GET /healthz meanwhile), its peak RSS and its answer, and the goals.",
        (probes.ProbeSettings, Output),
        lambda args: probes.run(from_flags(probes.ProbeSettings, args), args.out),
    ),
    Section(
        "families",
        "each model family's prompt against vLLM's own rendering",
        "Each model family's prompt tokens for the same tool loop, proto-server's rendering "
        "against vLLM's chat endpoint's (both tokenized here, no engine).",
        (families.FamiliesSettings,),
        _families,
    ),
    Section(
        "local",
        "warm (append) against cold (re-prefill) prefill on the local model",
        "Simulate an agent loop on the local model and print, per turn, the prefill tokens and "
        "time of the warm path (the kept KV cache) and of a cold full re-prefill of the "
        "history, as a Markdown table.",
        (LocalModel, local.LocalBenchSettings),
        lambda args: local.run(
            from_flags(local.LocalBenchSettings, args), from_flags(LocalModel, args)
        ),
    ),
    Section(
        "vllm",
        "proto-server in front of vLLM against vLLM's own /v1/responses",
        "Run one agent loop (forced tool calls, a tool output appended each turn, a final "
        "answer) on a running vLLM through five paths: proto-server's prototype and launched "
        "WebSocket and its stateless HTTP (a proto-server process this command starts, "
        "--generator vllm), and vLLM's own /v1/responses with the whole history and chained by "
        "previous_response_id (start the engine with VLLM_ENABLE_RESPONSES_API_STORE=1). Per "
        "turn: TTFT, turn time, prompt and cached tokens, the client's bytes and the CPU of "
        "proto-server's process and of vLLM's API server process (--engine-pid; its engine core "
        "is a child and is not counted), measured. Prints a Markdown table, the ratios and the "
        "goals; writes JSON and PNG plots into --out.",
        (vllm_report.VllmBenchSettings,),
        lambda args: vllm_report.run(from_flags(vllm_report.VllmBenchSettings, args)),
    ),
)


def build_parser(prog: str = "proto-server bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="proto-server's benchmarks, a subcommand each (default: all)."
    )
    sections = parser.add_subparsers(dest="section", required=True, metavar="SECTION")
    for section in SECTIONS:
        sub = sections.add_parser(
            section.name,
            help=section.help,
            description=section.description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        for settings_class in section.settings:
            add_flags(sub, settings_class)
        if section.name == "streaming":
            sub.add_argument(
                "--against", type=Path, default=None, metavar="TREE",
                help="also measure the server of another proto-server source tree (e.g. a "
                "`git worktree` of the base commit), case by case in the same run, to compare",
            )  # fmt: skip
    return parser


def main(argv: Sequence[str], prog: str = "proto-server bench") -> int:
    """Run a section; a setting out of range is one line on stderr naming its flag, exit 2."""
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "all")
    args = build_parser(prog).parse_args(argv)
    section = next(s for s in SECTIONS if s.name == args.section)
    try:
        return section.run(args)
    except InvalidSetting as exc:
        flag = declared.flag_of(section.settings, exc.field)
        print(f"{prog} {section.name}: {flag}: {exc.why}", file=sys.stderr)
        return 2


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
