"""The benchmark run: every transport, interleaved and repeated, then the streaming measurements.

`await run_bench(settings, progress)` -> `BenchRun`, everything measured, ready for `report`.
The order of the transports rotates from one repeat to the next, so none is always first after
a rate change or always last; each rollout gets a fresh `nonce`, so what the prefix cache shares
between rollouts is only what real sessions share: the tools and the developer message.
"""

from __future__ import annotations

import itertools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from proto_server.bench.measure import ServerProcess, ServerSettings, ServerTurn, Setup
from proto_server.bench.streaming import StreamCase, StreamResult, default_cases, run_streaming
from proto_server.bench.transports import TRANSPORTS, ClientTurn, run_rollout
from proto_server.bench.workload import Workload, make_workload

TRANSPORT_NAMES = tuple(t.name for t in TRANSPORTS)


@attrs.frozen(kw_only=True)
class BenchSettings:
    rounds: int | None = None  # tool rounds; None: 30 to 50, by the seed
    #: 2 draws 31 tool rounds and 131k tokens of history: a default run takes about a minute
    seed: int = 2
    output_kb: tuple[float, float] = (1.0, 8.0)
    large_share: float = 0.15
    large_kb: tuple[float, float] = (16.0, 48.0)
    decode_rates: tuple[float, ...] = (1000.0, 4000.0)
    prefill_rate: float = 100_000.0
    prefix_cache: bool = True
    repeats: int = 2
    transports: tuple[str, ...] = TRANSPORT_NAMES
    streaming: bool = True
    stream_rate: float = 4000.0
    stream_tokens: int = 20_000
    streams: int = 32
    client_fps: float = 1000.0
    stream_repeats: int = 1
    out_dir: Path = Path("bench-results")
    profile: bool = False

    def stream_cases(self) -> list[StreamCase]:
        return default_cases(
            rate=self.stream_rate,
            tokens=self.stream_tokens,
            streams=self.streams,
            client_fps=self.client_fps,
        )

    def workload(self) -> Workload:
        return make_workload(
            self.seed,
            rounds=self.rounds,
            output_kb=self.output_kb,
            large_share=self.large_share,
            large_kb=self.large_kb,
        )


@attrs.frozen
class Rollout:
    """One rollout through one transport: each turn as the client and the server lived it."""

    transport: str
    decode_rate: float
    repeat: int
    client: tuple[ClientTurn, ...]
    server: tuple[ServerTurn, ...]

    @property
    def seconds(self) -> float:
        """End to end, measured by the client: first request to the last turn's last event."""
        return sum(turn.wall_s for turn in self.client)


@attrs.frozen
class BenchRun:
    settings: BenchSettings
    workload: dict[str, Any]
    machine: dict[str, Any]
    rollouts: tuple[Rollout, ...]
    streaming: tuple[StreamResult, ...]
    seconds: float


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


async def run_bench(settings: BenchSettings, progress: Callable[[str], None]) -> BenchRun:
    started = time.perf_counter()
    workload = settings.workload()
    script = workload.script()
    profile_dir = str(settings.out_dir) if settings.profile else None
    if profile_dir is not None:
        settings.out_dir.mkdir(parents=True, exist_ok=True)
    server_settings = ServerSettings(
        prefill_rate=settings.prefill_rate,
        prefix_cache=settings.prefix_cache,
        profile_dir=profile_dir,
    )
    chosen = [t for t in TRANSPORTS if t.name in settings.transports]
    rollouts: list[Rollout] = []
    streaming: list[StreamResult] = []
    total = settings.repeats * len(settings.decode_rates) * len(chosen)
    progress(
        f"starting the server process; {total} rollouts of {workload.turns} turns "
        f"({len(chosen)} transports x {len(settings.decode_rates)} decode rates x "
        f"{settings.repeats} repeats)"
    )
    async with ServerProcess(server_settings) as server:
        done = 0
        blocks = itertools.product(range(settings.repeats), settings.decode_rates)
        for block, (repeat, rate) in enumerate(blocks):
            shift = block % len(chosen)
            for transport in chosen[shift:] + chosen[:shift]:
                await server.setup(Setup(script=script, decode_rate=rate))
                nonce = f"{transport.name}-{rate:g}-{repeat}-{settings.seed}"
                begun = time.perf_counter()
                client = await run_rollout(transport, "127.0.0.1", server.port, workload, nonce)
                server_turns, _, _ = await server.collect()
                if len(server_turns) != len(client):
                    raise RuntimeError(
                        f"{transport.name}: the server saw {len(server_turns)} turns and "
                        f"the client {len(client)}; the probe missed a turn"
                    )
                rollouts.append(
                    Rollout(transport.name, rate, repeat, tuple(client), tuple(server_turns))
                )
                done += 1
                progress(
                    f"[{done:>2}/{total}] {rate:>6g} tok/s  {transport.name:<15} repeat "
                    f"{repeat + 1}/{settings.repeats}  {time.perf_counter() - begun:5.1f} s"
                )
        if settings.streaming:
            streaming = await run_streaming(
                server, settings.stream_cases(), repeats=settings.stream_repeats, progress=progress
            )
    return BenchRun(
        settings=settings,
        workload=workload.sizes(),
        machine=machine(),
        rollouts=tuple(rollouts),
        streaming=tuple(streaming),
        seconds=time.perf_counter() - started,
    )
