"""Streaming: how fast tokens get through, alone, many at once, and to a slow client.

The model just talks (one text segment) over the prototype dialect. Three measurements:

- one stream at the burst rate (4,000 tokens/s): tokens/s the client received, and what the
  server added per token (modelled release -> the write of the frame that carried it);
- many concurrent streams: aggregate frames/s and tokens/s, and the server's CPU use;
- one stream to a client that can take only so many frames a second (its socket buffer small,
  its reading paced): tokens/s with merged deltas and without.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

import attrs
import orjson
import trio
from trio_websocket import wrap_client_stream

from proto_server.bench.measure import ServerProcess, Setup
from proto_server.bench.transports import BenchError, CountingStream
from proto_server.bench.workload import streaming_text
from proto_server.engine.script import RolloutScript, Segment

HOST = "127.0.0.1"
DELTA = '{"type":"response.output_text.delta"'
FAILED = ("response.failed", "response.incomplete", "response.cancelled", "error")


@attrs.frozen
class StreamResult:
    name: str
    streams: int
    decode_rate: float  # modelled tokens/s of each stream
    merge_deltas: bool
    client_frames_per_s: float | None  # the slow client's limit, else None
    tokens: int
    frames: int
    seconds: float  # measured: first event to the last completed
    tokens_per_s: float
    frames_per_s: float
    server_cpu_share: float  # server CPU seconds per wall second over the run (1.0 = a core)
    latency_ms_median: float | None = None  # per token: modelled release -> frame written
    latency_ms_p90: float | None = None


@attrs.frozen
class _Tally:
    tokens: int
    frames: int
    first: float
    last: float


async def _connect(port: int, small_buffer: bool) -> trio.SocketStream:
    if not small_buffer:
        return await trio.open_tcp_stream(HOST, port)
    sock = trio.socket.socket()
    # a small receive window, so a slow reader slows the server's writer soon, as over a WAN
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((HOST, port))
    return trio.SocketStream(sock)


async def _stream(port: int, frame_interval: float | None) -> _Tally:
    """One Response: the create, then every event until it completes."""
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
        create = {"type": "response.create", "model": "bench", "input": "talk", "store": False}
        await ws.send_message(orjson.dumps(create).decode())
        first: float | None = None
        frames = 0
        deadline = 0.0
        while True:
            message = await ws.get_message()
            now = time.perf_counter()
            if first is None:
                first, deadline = now, trio.current_time()
            if frame_interval is not None:
                deadline += frame_interval
                await trio.sleep_until(deadline)
            if isinstance(message, str) and message.startswith(DELTA):
                frames += 1
                continue
            event = orjson.loads(message)
            if event["type"] == "response.completed":
                tokens = event["response"]["usage"]["output_tokens"]
                break
            if event["type"] in FAILED:
                raise BenchError(f"a stream ended with {orjson.dumps(event).decode()[:500]}")
        await ws.aclose()
        nursery.cancel_scope.cancel()
    return _Tally(tokens, frames, first, now)


async def _measure(
    server: ServerProcess,
    name: str,
    *,
    streams: int,
    tokens: int,
    rate: float,
    merge: bool,
    client_fps: float | None = None,
    track_latency: bool = False,
) -> StreamResult:
    script = RolloutScript((Segment(text=streaming_text(tokens)),))
    await server.setup(
        Setup(script=script, decode_rate=rate, merge_deltas=merge, track_latency=track_latency)
    )
    *_, cpu_before = await server.collect()
    tallies: list[_Tally] = []
    interval = 1.0 / client_fps if client_fps else None

    async def one() -> None:
        tallies.append(await _stream(server.port, interval))

    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(one)
    _, latencies, cpu_after = await server.collect()
    seconds = max(t.last for t in tallies) - min(t.first for t in tallies)
    total_tokens = sum(t.tokens for t in tallies)
    frames = sum(t.frames for t in tallies)
    result = StreamResult(
        name=name,
        streams=streams,
        decode_rate=rate,
        merge_deltas=merge,
        client_frames_per_s=client_fps,
        tokens=total_tokens,
        frames=frames,
        seconds=seconds,
        tokens_per_s=total_tokens / seconds,
        frames_per_s=frames / seconds,
        server_cpu_share=(cpu_after - cpu_before) / seconds,
    )
    if latencies:
        latencies.sort()
        result = attrs.evolve(
            result,
            latency_ms_median=statistics.median(latencies) * 1e3,
            latency_ms_p90=latencies[int(len(latencies) * 0.9)] * 1e3,
        )
    return result


async def run_streaming(
    server: ServerProcess,
    *,
    rate: float,
    tokens: int,
    streams: int,
    client_fps: float,
    progress: Callable[[str], None],
) -> list[StreamResult]:
    results = []
    progress(f"streaming: one stream of {tokens} tokens at {rate:g} tokens/s")
    results.append(
        await _measure(
            server, "one stream", streams=1, tokens=tokens, rate=rate, merge=True,
            track_latency=True,
        )
    )  # fmt: skip
    per_stream = max(1, tokens // 8)
    for merge in (True, False):
        progress(
            f"streaming: {streams} concurrent streams of {per_stream} tokens at {rate:g} "
            f"tokens/s, merged deltas {'on' if merge else 'off'}"
        )
        results.append(
            await _measure(
                server, "concurrent streams", streams=streams, tokens=per_stream, rate=rate,
                merge=merge,
            )
        )  # fmt: skip
    for merge in (False, True):
        progress(
            f"streaming: a client that reads {client_fps:g} frames/s, merged deltas "
            f"{'on' if merge else 'off'}"
        )
        results.append(
            await _measure(
                server, "slow client", streams=1, tokens=tokens // 2, rate=rate, merge=merge,
                client_fps=client_fps,
            )
        )  # fmt: skip
    return results
