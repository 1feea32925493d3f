"""permessage-deflate against none, on a Codex-shaped rollout: bytes on the wire and CPU.

    python -m proto_server_bench.deflate [--repeats 5] [--rounds N] [--seed 2]

One server process with `--permessage-deflate` on; each rollout's client (the launched dialect,
as Codex 0.171 speaks it) offers the extension or does not, alternately, so both run against the
same server in one run. Per rollout: the bytes each way (WebSocket framing included), the server
process's CPU (all of it, from the first frame to the last event: compressing what it sends,
inflating what it reads) and the client's. Printed as medians over the repeats, side by side,
with their ratios. Everything is on loopback, where bytes cost almost nothing: the question is
what the CPU costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import trio

from proto_server_bench.measure import ServerProcess, ServerSettings, Setup
from proto_server_bench.transports import Transport, WsLaunched, WsLaunchedDeflate, run_rollout
from proto_server_bench.workload import make_workload

#: Fast enough that a rollout measures the server's work, not modelled GPU time.
DECODE_RATE = 100_000.0
PREFILL_RATE = 10_000_000.0


async def measure(repeats: int, rounds: int | None, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Each transport's rollouts, alternating, `repeats` of each."""
    workload = make_workload(seed, rounds=rounds)
    settings = ServerSettings(prefill_rate=PREFILL_RATE, prefix_cache=True, permessage_deflate=True)
    results: dict[str, list[dict[str, Any]]] = {WsLaunched.name: [], WsLaunchedDeflate.name: []}
    kinds: tuple[type[Transport], ...] = (WsLaunched, WsLaunchedDeflate)
    async with ServerProcess(settings) as server:
        for repeat in range(repeats):
            for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                await server.setup(Setup(script=workload.script(), decode_rate=DECODE_RATE))
                _, _, cpu_before = await server.collect()
                started = time.perf_counter()
                turns = await run_rollout(
                    kind, "127.0.0.1", server.port, workload, f"{kind.name}-{repeat}"
                )
                wall = time.perf_counter() - started
                _, _, cpu_after = await server.collect()
                results[kind.name].append(
                    {
                        "bytes_up": sum(t.bytes_up for t in turns),
                        "bytes_down": sum(t.bytes_down for t in turns),
                        "server_cpu_ms": (cpu_after - cpu_before) * 1e3,
                        "client_cpu_ms": sum(t.cpu_s for t in turns) * 1e3,
                        "wall_ms": wall * 1e3,
                        "turns": len(turns),
                    }
                )
    return results


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    plain, deflated = results[WsLaunched.name], results[WsLaunchedDeflate.name]
    lines = [
        f"{len(plain)} rollouts each, {plain[0]['turns']} turns; medians",
        f"{'':<16}{'no deflate':>14}{'deflate':>14}{'ratio':>8}",
    ]
    for key, unit in (
        ("bytes_up", "B"),
        ("bytes_down", "B"),
        ("server_cpu_ms", "ms"),
        ("client_cpu_ms", "ms"),
        ("wall_ms", "ms"),
    ):
        off = statistics.median(r[key] for r in plain)
        on = statistics.median(r[key] for r in deflated)
        lines.append(
            f"{key:<16}{off:>12,.0f}{unit:<2}{on:>12,.0f}{unit:<2}{on / off if off else 0:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m proto_server_bench.deflate")
    parser.add_argument("--repeats", type=int, default=5, help="rollouts of each kind")
    parser.add_argument("--rounds", type=int, default=None, help="tool rounds (default: seed's)")
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(report(trio.run(measure, args.repeats, args.rounds, args.seed)))


if __name__ == "__main__":
    main()
