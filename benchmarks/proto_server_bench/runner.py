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

from proto_server.core.ranges import at_least, between, positive_finite
from proto_server.core.settings import setting
from proto_server_bench import flags
from proto_server_bench.measure import ServerProcess, ServerSettings, ServerTurn, Setup
from proto_server_bench.streaming import StreamCase, StreamResult, default_cases, run_streaming
from proto_server_bench.transports import TRANSPORTS, ClientTurn, run_rollout
from proto_server_bench.workload import Workload, make_workload

TRANSPORT_NAMES = tuple(t.name for t in TRANSPORTS)


@attrs.frozen(kw_only=True)
class BenchSettings:
    """What `bench all` and `bench streaming` run: each field is a flag of theirs."""

    turns: int | None = setting(
        None, at_least(2),
        help="requests per rollout (tool rounds + 1 final answer); default: 31 to 51, by the seed",
    )  # fmt: skip
    #: 2 draws 31 tool rounds and 131k tokens of history: a default run takes about a minute
    seed: int = setting(2, help="workload seed")
    output_kb: tuple[float, float] = setting(
        (1.0, 8.0), nargs=2, metavar=("MIN", "MAX"), help="size range of ordinary tool outputs"
    )
    large_share: float = setting(
        0.15, between(0, 1), help="share of tool outputs that are large test logs"
    )
    large_kb: tuple[float, float] = setting(
        (16.0, 48.0), nargs=2, metavar=("MIN", "MAX"), help="size range of the large tool outputs"
    )
    decode_rates: tuple[float, ...] = setting(
        (1000.0, 4000.0), flags.rates, parse=flags.numbers, metavar="R1,R2",
        help="modelled decode tokens/s to run at (the write-up's regimes: 65, 1000, 4000)",
    )  # fmt: skip
    prefill_rate: float = setting(
        100_000.0, positive_finite, metavar="TOKENS_PER_S",
        help="modelled prefill tokens/s for tokens not in any cache",
    )  # fmt: skip
    prefix_cache: bool = setting(
        True, help="model a prefix cache across requests (without, cold paths prefill their "
        "history)",
    )  # fmt: skip
    repeats: int = setting(2, at_least(1), help="rollouts per transport and rate")
    transports: tuple[str, ...] = setting(
        TRANSPORT_NAMES, flags.some_of(TRANSPORT_NAMES), parse=flags.names, metavar="NAMES",
        help=f"comma-separated subset of {','.join(TRANSPORT_NAMES)}",
    )  # fmt: skip
    streaming: bool = setting(True, help="bench all: the streaming measurements too")
    stream_rate: float = setting(
        4000.0, positive_finite, help="modelled decode tokens/s of the streaming measurements"
    )
    stream_tokens: int = setting(
        20_000, at_least(64),
        help="tokens of the unlimited single stream (the paced one gets a quarter, the unmerged "
        "half, each concurrent one and the slow client an eighth)",
    )  # fmt: skip
    streams: int = setting(32, at_least(1), help="concurrent streams")
    client_fps: float = setting(1000.0, positive_finite, help="frames/s the slow client reads")
    stream_repeats: int = setting(
        1, at_least(1), help="runs of each streaming case (the table shows medians)"
    )
    out_dir: Path = setting(
        Path("bench-results"), flag="--out", metavar="DIR", help="where the JSON and plots go"
    )
    profile: bool = setting(
        False,
        help="profile the server process (cProfile): DIR/server-profile.txt and .pstats",
    )

    @property
    def rounds(self) -> int | None:
        """Tool rounds a rollout (None: 30 to 50, by the seed)."""
        return None if self.turns is None else self.turns - 1

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
