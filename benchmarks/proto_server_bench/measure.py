"""Measuring the server from inside, per turn, in a process of its own.

The server runs in a spawned child process, so what it spends is its own: the client's work
(encoding histories, parsing events) runs in the parent, on the other core. In the child a
`Probe` (the server's `observer`) and a `ModelledGpu` (the simulated GPU's `meter`) record:

- when a request is in, decoded, its conversation rebuilt or extended, and when the generator
  starts (pre-inference time, wall clock);
- the server process's CPU time over each turn: from the end of the previous turn to the event
  that ends this one. Idle waiting (for the client, for modelled GPU sleeps) costs no CPU, so
  this is the server's own work: reading, decoding, validating, store lookups, rendering and
  tokenizing, encoding events, socket writes, minus the CPU the simulated GPU spent on its
  prefix-cache bookkeeping (GPU-side work);
- the GPU's modelled prefill and decode seconds (modelled, never measured);
- with latency tracking on, for each token, the time from its release by the simulated GPU to
  the write of the frame that carried it (what the server adds per event).
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import trio

from proto_server.core.merge import MERGEABLE
from proto_server.core.response.status import TERMINAL_EVENTS
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.script import RolloutScript
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.store import SQLiteStore
from proto_server.wire.events import ErrorEvent, ResponseDone, ServerEvent

TURN_ENDS = (*TERMINAL_EVENTS, ResponseDone, ErrorEvent)


@attrs.define
class ModelledGpu:
    """The simulated GPU's `meter`: modelled seconds, and when each token was released."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefilled_tokens: int = 0
    bookkeeping_s: float = 0.0
    released: collections.deque[float] | None = None

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.prefilled_tokens += tokens
        self.prefill_s += seconds

    def decoded(self, tokens: int, seconds: float, at: float) -> None:
        self.decode_s += seconds
        if self.released is not None:
            self.released.append(at)

    def bookkeeping(self, seconds: float) -> None:
        self.bookkeeping_s += seconds

    def totals(self) -> tuple[float, float, int, float]:
        return self.prefill_s, self.decode_s, self.prefilled_tokens, self.bookkeeping_s


@attrs.frozen
class ServerTurn:
    """One turn as the server lived it. `_ms` fields are measured unless named `modelled_`."""

    read_cpu_ms: float  # CPU from the previous turn's end until the request was in
    decode_ms: float  # wall: request in -> decoded and validated
    prepare_ms: float  # wall: decoded -> conversation rebuilt or extended (lookups, rendering)
    pre_inference_ms: float  # wall: request in -> generator starts
    pre_inference_cpu_ms: float
    server_cpu_ms: float  # CPU over the whole turn, less the simulated GPU's bookkeeping
    modelled_prefill_ms: float
    modelled_decode_ms: float
    rendered_tokens: int  # tokens the server rendered (tokenized) for this turn
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int  # prompt tokens the modelled GPU prefilled (not cached anywhere)
    events: int
    frames: int


@attrs.define
class _Open:
    received: float
    received_cpu: float
    read_cpu: float
    decoded: float | None = None
    rendered: float | None = None
    generating: float | None = None
    generating_cpu: float | None = None
    rendered_tokens: int = 0
    prompt: int = 0
    cached: int = 0
    events: int = 0
    frames: int = 0


class Probe:
    """The server's `observer`: turns per-request hooks into `ServerTurn`s."""

    def __init__(self, gpu: ModelledGpu) -> None:
        self.gpu = gpu
        self.turns: list[ServerTurn] = []
        self.latencies: list[float] = []
        self._open: _Open | None = None
        self._end_cpu = time.process_time()
        self._gpu_mark = gpu.totals()

    def reset(self, *, track_latency: bool) -> None:
        self.turns, self.latencies, self._open = [], [], None
        self._end_cpu = time.process_time()
        self._gpu_mark = self.gpu.totals()
        self.gpu.released = collections.deque() if track_latency else None

    # -- ServerObserver ------------------------------------------------------------------------

    def received(self) -> None:
        if self._open is None:
            cpu = time.process_time()
            self._open = _Open(time.perf_counter(), cpu, cpu - self._end_cpu)

    def decoded(self) -> None:
        if self._open is not None and self._open.decoded is None:
            self._open.decoded = time.perf_counter()

    def rendered(self) -> None:
        if self._open is not None and self._open.rendered is None:
            self._open.rendered = time.perf_counter()

    def generating(self) -> None:
        if self._open is not None and self._open.generating is None:
            self._open.generating = time.perf_counter()
            self._open.generating_cpu = time.process_time()

    def prefilled(self, *, rendered: int, prompt: int, cached: int) -> None:
        if self._open is not None:
            self._open.rendered_tokens += rendered
            self._open.prompt, self._open.cached = prompt, cached

    def sent(self, event: ServerEvent, merged: int) -> None:
        released = self.gpu.released
        if released is not None and isinstance(event, MERGEABLE):
            now = trio.current_time()
            for _ in range(min(merged, len(released))):
                self.latencies.append(now - released.popleft())
        turn = self._open
        if turn is None:
            return
        turn.events += merged
        turn.frames += 1
        if isinstance(event, TURN_ENDS):
            self._close(turn)

    def _close(self, turn: _Open) -> None:
        cpu = time.process_time()
        prefill, decode, prefilled, bookkeeping = self.gpu.totals()
        mark_prefill, mark_decode, mark_prefilled, mark_bookkeeping = self._gpu_mark
        generating = turn.generating if turn.generating is not None else turn.received
        generating_cpu = turn.generating_cpu if turn.generating_cpu is not None else cpu
        decoded = turn.decoded if turn.decoded is not None else turn.received
        rendered = turn.rendered if turn.rendered is not None else decoded
        self.turns.append(
            ServerTurn(
                read_cpu_ms=turn.read_cpu * 1e3,
                decode_ms=(decoded - turn.received) * 1e3,
                prepare_ms=(rendered - decoded) * 1e3,
                pre_inference_ms=(generating - turn.received) * 1e3,
                pre_inference_cpu_ms=(generating_cpu - turn.received_cpu) * 1e3,
                server_cpu_ms=(cpu - self._end_cpu - (bookkeeping - mark_bookkeeping)) * 1e3,
                modelled_prefill_ms=(prefill - mark_prefill) * 1e3,
                modelled_decode_ms=(decode - mark_decode) * 1e3,
                rendered_tokens=turn.rendered_tokens,
                prompt_tokens=turn.prompt,
                cached_tokens=turn.cached,
                prefilled_tokens=prefilled - mark_prefilled,
                events=turn.events,
                frames=turn.frames,
            )
        )
        self._open = None
        self._end_cpu = cpu
        self._gpu_mark = (prefill, decode, prefilled, bookkeeping)


# -- the server process --------------------------------------------------------------------------


@attrs.frozen
class ServerSettings:
    prefill_rate: float
    prefix_cache: bool
    profile_dir: str | None = None
    permessage_deflate: bool = False


@attrs.frozen
class Setup:
    """What the next measurements run against."""

    script: RolloutScript
    decode_rate: float
    merge_deltas: bool = True
    track_latency: bool = False


def serve_child(conn: Connection, settings: ServerSettings) -> None:
    """The child process: the server, the probe, and a command loop on `conn`."""
    profiler = cProfile.Profile() if settings.profile_dir else None
    if profiler is not None:
        profiler.enable()
    try:
        trio.run(_serve, conn, settings)
    finally:
        if profiler is not None and settings.profile_dir:
            profiler.disable()
            _write_profile(profiler, Path(settings.profile_dir))


def _write_profile(profiler: cProfile.Profile, directory: Path) -> None:
    profiler.dump_stats(directory / "server-profile.pstats")
    with (directory / "server-profile.txt").open("w") as out:
        stats = pstats.Stats(profiler, stream=out)
        out.write("Where the server process spent its time (cProfile; times are inflated).\n\n")
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)


async def _serve(conn: Connection, settings: ServerSettings) -> None:
    gpu = ModelledGpu()
    probe = Probe(gpu)
    cache = PrefixCache() if settings.prefix_cache else None
    with tempfile.TemporaryDirectory(prefix="proto-bench-") as directory:
        # a store on disk, as `proto-server serve` keeps one by default
        store = SQLiteStore(Path(directory) / "responses.sqlite3")
        server = ProtoServer(
            SimulatedGenerator(RolloutScript(())),
            ServerConfig(port=0, permessage_deflate=settings.permessage_deflate),
            store=store,
        )
        responses = server.responses  # what the setups below replace between runs
        responses.observer = probe
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            conn.send(("ready", address.port))
            while True:
                command, argument = await trio.to_thread.run_sync(conn.recv)
                if command == "setup":
                    setup: Setup = argument
                    timing = TimingModel(
                        prefill_tokens_per_s=settings.prefill_rate,
                        decode_tokens_per_s=setup.decode_rate,
                    )
                    responses.generator = SimulatedGenerator(
                        setup.script, timing, prefix_cache=cache, meter=gpu
                    )
                    responses.config = attrs.evolve(
                        responses.config, merge_deltas=setup.merge_deltas
                    )
                    probe.reset(track_latency=setup.track_latency)
                    conn.send(("ok", None))
                elif command == "collect":
                    await server.wait_idle()
                    conn.send(("ok", (probe.turns, probe.latencies, time.process_time())))
                else:
                    conn.send(("ok", None))
                    nursery.cancel_scope.cancel()
                    break
        await store.aclose()


class ServerProcess:
    """The parent's handle on the child: `async with ServerProcess(settings) as server:`.

    The child is a fresh interpreter (`python -m proto_server_bench.child FD`) talking over a
    socket pair, so nothing of the parent (its main module, its threads) is carried over.
    """

    def __init__(self, settings: ServerSettings, *, tree: Path | None = None) -> None:
        """`tree`: a source tree of proto-server whose server to run instead of this one's (the
        child imports from its working directory, and the benchmarks from its `benchmarks/`
        where it has one), so two versions can be measured in one run."""
        self._settings = settings
        self._tree = tree
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._theirs = theirs
        self._process: trio.Process | None = None
        self.port = 0

    async def __aenter__(self) -> ServerProcess:
        fd = self._theirs.fileno()
        self._process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "proto_server_bench.child", str(fd)],
            pass_fds=(fd,),
            cwd=self._tree,
            env=None if self._tree is None else _benchmarks_of(self._tree),
        )
        self._theirs.close()
        self._conn.send(self._settings)
        _, self.port = await trio.to_thread.run_sync(self._receive, 120.0)
        return self

    def _receive(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            code = self._process.poll() if self._process is not None else None
            raise RuntimeError(
                f"the benchmark's server process did not answer within {timeout:g} s "
                f"(exit code {code}); see its error output above"
            )
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(
                "the benchmark's server process ended unexpectedly; see its error output above"
            ) from None

    async def call(self, command: str, argument: Any = None) -> Any:
        self._conn.send((command, argument))
        status, result = await trio.to_thread.run_sync(self._receive, 120.0)
        assert status == "ok", status
        return result

    async def setup(self, setup: Setup) -> None:
        await self.call("setup", setup)

    async def collect(self) -> tuple[list[ServerTurn], list[float], float]:
        """The turns and per-token latencies since the last setup, and the CPU seconds the
        server process has used so far."""
        turns, latencies, cpu = await self.call("collect")
        return turns, latencies, cpu

    async def __aexit__(self, *exc_info: object) -> None:
        process = self._process
        try:
            if process is not None and process.poll() is None:
                with trio.move_on_after(30):
                    await self.call("stop")
                    await process.wait()
        finally:
            if process is not None and process.poll() is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            self._conn.close()


def _benchmarks_of(tree: Path) -> dict[str, str]:
    """The environment with `tree`'s benchmarks first on the path (where it has them)."""
    env = dict(os.environ)
    if (tree / "benchmarks").is_dir():
        path = [str(tree.resolve() / "benchmarks"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
    return env


def child_main(fd: int) -> None:
    """The child's entry (`python -m proto_server_bench.child FD`): settings first, then serve."""
    conn = Connection(fd)
    settings: ServerSettings = conn.recv()
    serve_child(conn, settings)
