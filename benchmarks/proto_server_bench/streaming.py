"""Streaming: how fast tokens get through, and what the server spends on each (issue 13).

The model just talks (one text segment) over the prototype dialect, to plain trio-websocket
clients that keep every frame; after the timed part the stream checker reads each stream, so a
faster path cannot pass by sending something else. The cases:

- one stream at the burst rate (4,000 tokens/s): server CPU per token, and the time from a
  token's release by the simulated GPU to the write of the frame that carried it (median, p99);
- one stream with unlimited decode, deltas merged (the default) and not: tokens/s delivered,
  server CPU per token and per frame;
- 32 concurrent streams with unlimited decode: tokens/s in total, from one server process;
- twice as many (64) at 500 tokens/s each, released on the simulated engine's shared steps:
  server CPU per token;
- one stream to a client that can take only so many frames a second: merged deltas keep its
  tokens/s up.

Server CPU is the server process's own (`time.process_time` in the child) over the case, so
the clients' work, in this process, is not in it. `against` measures a second server, from
another source tree, in the same run, case by case, so "before" and "after" share the machine's
noise.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import orjson
import trio
from trio_websocket import wrap_client_stream

from proto_server.engine.script import RolloutScript, Segment
from proto_server.testing.checker import InvariantViolation, StreamChecker, o200k_count
from proto_server.wire.converter import encode_server_event_bytes
from proto_server.wire.events import OutputTextDelta
from proto_server_bench.measure import ServerProcess, ServerSettings, Setup
from proto_server_bench.transports import BenchError, CountingStream
from proto_server_bench.workload import streaming_text

HOST = "127.0.0.1"
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "response.cancelled")
#: A modelled decode rate that never limits: the pacer is always behind, it never sleeps.
UNLIMITED = 1e9
#: Twice `--streams` paced streams (64 by default) at this rate: what one server spends a token
#: when the engine steps them all at once.
PACED_RATE = 500.0
CREATE = {"type": "response.create", "model": "bench", "input": "talk", "store": False}


@attrs.frozen
class StreamCase:
    """One measurement: `streams` Responses of `tokens` tokens each, at the same time."""

    name: str
    streams: int
    tokens: int
    rate: float
    merge: bool = True
    client_fps: float | None = None
    track_latency: bool = False


#: A short stream each server runs first, unmeasured.
WARM_UP = StreamCase("warm-up", 1, 64, UNLIMITED)


@attrs.frozen
class StreamResult:
    name: str
    server: str  # "this tree", or the other tree's name
    repeat: int
    streams: int
    decode_rate: float | None  # modelled tokens/s of each stream; None: unlimited
    merge_deltas: bool
    client_frames_per_s: float | None  # the slow client's limit, else None
    tokens: int
    frames: int
    seconds: float  # measured: first event to the last completed
    tokens_per_s: float
    frames_per_s: float
    server_cpu_share: float  # server CPU seconds per wall second over the case (1.0 = a core)
    cpu_us_per_token: float
    cpu_us_per_frame: float
    latency_ms_median: float | None = None  # per token: modelled release -> frame written
    latency_ms_p99: float | None = None
    #: Streams the checker passed, of `streams`; the first violation found, if any.
    checked: int = 0
    violation: str | None = None


@attrs.frozen
class _Tally:
    frames: list[str | bytes]
    first: float
    last: float


def default_cases(*, rate: float, tokens: int, streams: int, client_fps: float) -> list[StreamCase]:
    """The issue's cases: the burst rate, unlimited merged and not, many streams, a slow client."""
    return [
        StreamCase(f"one stream, {rate:,.0f} tok/s", 1, tokens // 4, rate, track_latency=True),
        StreamCase("one stream, unlimited decode", 1, tokens, UNLIMITED),
        StreamCase("one stream, unlimited, unmerged", 1, tokens // 2, UNLIMITED, merge=False),
        StreamCase(f"{streams} streams, unlimited", streams, max(8, tokens // 8), UNLIMITED),
        # engine-like steps: every stream's token of a step is released at once (issue 19)
        StreamCase(
            f"{2 * streams} streams, {PACED_RATE:,.0f} tok/s each",
            2 * streams,
            max(8, tokens // 8),
            PACED_RATE,
        ),
        StreamCase("slow client", 1, tokens // 8, rate, merge=False, client_fps=client_fps),
        StreamCase("slow client", 1, tokens // 8, rate, merge=True, client_fps=client_fps),
    ]


async def _connect(port: int, small_buffer: bool) -> trio.SocketStream:
    if not small_buffer:
        return await trio.open_tcp_stream(HOST, port)
    sock = trio.socket.socket()
    # a small receive window, so a slow reader slows the server's writer soon, as over a WAN
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((HOST, port))
    return trio.SocketStream(sock)


async def _stream(port: int, frame_interval: float | None) -> _Tally:
    """One Response: the create, then every frame until its terminal event (kept, unread)."""
    slow = frame_interval is not None
    async with trio.open_nursery() as nursery:
        stream = CountingStream(await _connect(port, slow))
        ws = await wrap_client_stream(
            nursery,
            stream,  # type: ignore[arg-type]  # any trio Stream works
            HOST,
            "/v1/responses?dialect=prototype",
            message_queue_size=1 if slow else 64,
            receive_buffer_size=4096 if slow else 65536,
        )
        await ws.send_message(orjson.dumps(CREATE).decode())
        frames: list[str | bytes] = []
        first: float | None = None
        deadline = 0.0
        while True:
            message = await ws.get_message()
            now = time.perf_counter()
            if first is None:
                first, deadline = now, trio.current_time()
            if frame_interval is not None:
                deadline += frame_interval
                await trio.sleep_until(deadline)
            frames.append(message)
            # a terminal event ends the stream; a delta's text may say anything, its type not
            head = message[:40]
            if isinstance(head, str) and '"response.output_text.delta"' in head:
                continue
            if orjson.loads(message)["type"] in (*TERMINAL, "error"):
                break
        await ws.aclose()
        nursery.cancel_scope.cancel()
    return _Tally(frames, first, now)


def _check(frames: Sequence[str | bytes]) -> tuple[int, str | None]:
    """Read one stream with the checker: (tokens it completed with, the violation or None)."""
    checker = StreamChecker(dialect="prototype", count_tokens=o200k_count)
    checker.sent(CREATE)
    tokens = 0
    try:
        for frame in frames:
            checker.received(frame)
        checker.finish()
        last = orjson.loads(frames[-1])
        if last["type"] != "response.completed":
            raise BenchError(f"a stream ended with {orjson.dumps(last).decode()[:300]}")
        tokens = last["response"]["usage"]["output_tokens"]
    except InvariantViolation as exc:
        return tokens, str(exc)
    return tokens, None


def _percentile(ordered: Sequence[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


async def measure_case(
    server: ServerProcess, case: StreamCase, *, label: str = "this tree", repeat: int = 0
) -> StreamResult:
    script = RolloutScript((Segment(text=streaming_text(case.tokens)),))
    await server.setup(
        Setup(
            script=script,
            decode_rate=case.rate,
            merge_deltas=case.merge,
            track_latency=case.track_latency,
        )
    )
    *_, cpu_before = await server.collect()
    tallies: list[_Tally] = []
    interval = 1.0 / case.client_fps if case.client_fps else None

    async def one() -> None:
        tallies.append(await _stream(server.port, interval))

    async with trio.open_nursery() as nursery:
        for _ in range(case.streams):
            nursery.start_soon(one)
    _, latencies, cpu_after = await server.collect()
    # the checker reads after the timed part: its cost is the client's, and not in the window
    checks = [_check(t.frames) for t in tallies]
    violations = [v for _, v in checks if v is not None]
    seconds = max(t.last for t in tallies) - min(t.first for t in tallies)
    total_tokens = sum(tokens for tokens, _ in checks)
    frames = sum(len(t.frames) for t in tallies)
    cpu = cpu_after - cpu_before
    median = p99 = None
    if latencies:
        latencies.sort()
        median = statistics.median(latencies) * 1e3
        p99 = _percentile(latencies, 0.99) * 1e3
    return StreamResult(
        name=case.name,
        server=label,
        repeat=repeat,
        streams=case.streams,
        decode_rate=None if case.rate >= UNLIMITED else case.rate,
        merge_deltas=case.merge,
        client_frames_per_s=case.client_fps,
        tokens=total_tokens,
        frames=frames,
        seconds=seconds,
        tokens_per_s=total_tokens / seconds,
        frames_per_s=frames / seconds,
        server_cpu_share=cpu / seconds,
        cpu_us_per_token=cpu / max(1, total_tokens) * 1e6,
        cpu_us_per_frame=cpu / max(1, frames) * 1e6,
        latency_ms_median=median,
        latency_ms_p99=p99,
        checked=len(checks) - len(violations),
        violation=violations[0] if violations else None,
    )


async def run_streaming(
    server: ServerProcess,
    cases: Sequence[StreamCase],
    *,
    repeats: int = 1,
    progress: Callable[[str], None],
    against: tuple[str, ServerProcess] | None = None,
) -> list[StreamResult]:
    """Every case `repeats` times; with `against`, each case on the other server right after."""
    servers = [("this tree", server)] + ([against] if against is not None else [])
    for _, each in servers:  # unmeasured: what a first stream loads (the tokenizer) is loaded
        await measure_case(each, WARM_UP)
    results = []
    for repeat in range(repeats):
        for case in cases:
            # who goes first alternates, so neither is always the one after a pause
            order = servers if repeat % 2 == 0 else servers[::-1]
            for label, each in order:
                fps = f", a client reading {case.client_fps:g} frames/s" if case.client_fps else ""
                progress(
                    f"streaming [{repeat + 1}/{repeats}] {label}: {case.name}, {case.streams} x "
                    f"{case.tokens} tokens, merged deltas {'on' if case.merge else 'off'}{fps}"
                )
                results.append(await measure_case(each, case, label=label, repeat=repeat))
    return results


async def pacing_floor(rate: float, tokens: int) -> float:
    """CPU microseconds a token that a trio task costs just by waking on the simulated GPU's
    schedule at `rate` (a sleep until each token is due, nothing else): part of what the
    server process spends per token at that rate that is the simulated GPU's, not the server's.
    Measured in this process, while nothing else runs in it."""
    started_cpu = time.process_time()
    deadline = trio.current_time()
    for _ in range(tokens):
        deadline += 1.0 / rate
        if deadline > trio.current_time():
            await trio.sleep_until(deadline)
    return (time.process_time() - started_cpu) / tokens * 1e6


def cold_wake(rate: float) -> tuple[float, float]:
    """Median microseconds of one fixed piece of the server's per-token work (a text delta
    encoded to bytes, 8 times) run back to back, and run right after sleeping one token's
    interval at `rate`. On a machine whose CPU goes cold while idle (a VM's parked vCPU), the
    second is what every wake of the paced case pays, whatever the code does. Half a second
    of sleeps at most (or 100 of them)."""
    rounds = max(100, min(2000, int(rate / 2)))
    event = OutputTextDelta(item_id="msg_0", output_index=0, content_index=0, delta=" token")

    def median_us(pause: float) -> float:
        took = []
        for number in range(rounds):
            if pause:
                time.sleep(pause)
            started = time.perf_counter()
            for _ in range(8):
                encode_server_event_bytes(event, number)
            took.append(time.perf_counter() - started)
        return statistics.median(took) * 1e6

    median_us(0)  # warm
    return median_us(0), median_us(1.0 / rate)


async def run_streaming_only(
    settings: ServerSettings,
    cases: Sequence[StreamCase],
    *,
    repeats: int,
    progress: Callable[[str], None],
    against: Path | None = None,
) -> list[StreamResult]:
    """`proto-server bench streaming`: a server process (two, with `against`), the cases."""
    async with ServerProcess(settings) as server:
        if against is None:
            return await run_streaming(server, cases, repeats=repeats, progress=progress)
        async with ServerProcess(settings, tree=against) as other:
            return await run_streaming(
                server, cases, repeats=repeats, progress=progress, against=(against.name, other)
            )
