"""`proto-server bench memory`: peak RSS of a real server per input shape, against its charge.

Each shape runs against a `proto-server serve` process of its own (nothing else in it grows):
a small request of the same kind warms it up, its resident set (`VmRSS`) is read and its peak
(`VmHWM`) reset, then ONE request of the shape is sent, over HTTP (`POST /v1/responses`) or a
WebSocket, and once it is answered the peak is read again, with the most the server's process
memory budget ever charged (`proto_server_memory_peak_bytes` on `/metrics`). The ratio printed
is the peak above the baseline over that charge: at most 1, the budget covers what the shape
really costs.

`--steer-flood LANES STEERS MB` is the issue-22 attack instead: one connection, LANES lanes each
with a Response that completed with an unanswered call, then STEERS steers of MB each per lane,
all sent at once; the peak RSS against `--max-memory` plus the baseline, and the answers by code.

The shapes and the steer flood are two measurements of one thing, peak RSS against what the
memory budget charged, on the same server process (`Server`), the same reading of `VmHWM` and the
same frames (`frame_of`, `called`); `armed` and `post` are what `bench probes` (probes.py) sends
its shapes with.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio

from proto_server.core.ranges import Range
from proto_server.core.settings import setting
from proto_server.testing.client import WireClient, connect
from proto_server_bench import flags

MiB = 1024 * 1024
SHAPES = ("huge string", "many items", "many tools", "deep JSON", "big steer", "big inject")
#: Which transports each shape is sent over: creates over both, a steer and an inject are
#: WebSocket events only (an inject in the prototype dialect, as the multi-agent beta sends it).
TRANSPORTS = {
    "huge string": ("http", "websocket"),
    "many items": ("http", "websocket"),
    "many tools": ("http", "websocket"),
    "deep JSON": ("http", "websocket"),
    "big steer": ("websocket",),
    "big inject": ("websocket",),
}
#: A tool call, then an answer: a create completes with a call awaiting output (what a steer
#: waits behind), or suspends on it (what an inject resumes).
SCRIPT = {
    "segments": [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}],
        },
        {"text": "Done."},
    ]
}
EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
BETA = ("OpenAI-Beta", "responses_multi_agent=v1")
END = ("response.completed", "response.failed", "response.incomplete", "response.done", "error")
#: Generous: a 15 MB frame is decoded and rendered on 2 busy cores.
EVENT_TIMEOUT_S = 300.0


def text_of(nbytes: int) -> str:
    """The costliest text to render per byte: one run with no whitespace is one regex piece for
    the tokenizer (a 15 MB one peaked at 886 MB before its text was cut into chunks)."""
    return "x" * nbytes


def frame_of(shape: str, nbytes: int, *, previous: str = "resp_1") -> dict[str, Any]:
    """A client frame of about `nbytes` of JSON, of `shape` (`previous`: the Response a steer or
    an inject names)."""
    create: dict[str, Any] = {"type": "response.create", "model": "m", "tools": [EXEC_COMMAND]}
    if shape == "huge string":
        return {**create, "input": [{"role": "user", "content": text_of(nbytes)}]}
    if shape == "many items":
        return {**create, "input": [{"role": "user", "content": "hi"}] * (nbytes // 34)}
    if shape == "many tools":
        tool = {
            "type": "function",
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        }
        size = len(orjson.dumps(tool)) + 1
        tools = [EXEC_COMMAND, *({**tool, "name": f"f{i}"} for i in range(nbytes // size))]
        return {**create, "tools": tools, "input": "hi"}
    if shape == "deep JSON":
        deep: Any = 1
        for _ in range(60):  # 120 levels: within the decoder's 128
            deep = {"a": [deep]}
        item = {"type": "mcp_list_tools", "tools": [deep]}  # carried whole, as unknown items are
        size = len(orjson.dumps(item)) + 1
        return {**create, "input": [item] * (nbytes // size)}
    if shape == "big steer":
        return {
            "type": "response.steer",
            "previous_response_id": previous,
            "input": text_of(nbytes),
        }
    if shape == "big inject":
        text = text_of(nbytes)
        output = {"type": "function_call_output", "call_id": "c1", "output": text}
        return {"type": "response.inject", "response_id": previous, "input": [output]}
    raise ValueError(shape)


# -- the server process --------------------------------------------------------------------------


def status_kib(pid: int, field: str) -> int:
    """`field` (VmRSS, VmHWM) of process `pid`, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def reset_peak(pid: int) -> bool:
    """Reset `VmHWM` to the current RSS (Linux 4.0+, `clear_refs` 5); False where refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


class Server:
    """A `proto-server serve` subprocess on a free port, its log to a file."""

    def __init__(
        self, flags: list[str], workdir: Path, *, script: bool | Mapping[str, Any] = True
    ) -> None:
        """`script`: SCRIPT's call then answer (True), another script, or the built-in default
        model (False)."""
        path = workdir / "script.json"
        path.write_text(json.dumps(SCRIPT if script is True else script))
        self.log = (workdir / "server.log").open("wb")
        command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store",
                   ":memory:", *(["--script", str(path)] if script else []), "--no-prefix-cache",
                   "--log-level", "warning", "--prefill-rate", "1e12", "--decode-rate", "1e6",
                   *flags]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if "listening on " not in line:
            self.process.kill()
            raise RuntimeError(f"the server did not start: {line!r} (log: {self.log.name})")
        http = line.split("listening on ")[1].split(" ")[0]  # http://host:port/v1
        self.http = http.rsplit("/", 1)[0]
        self.ws = http.replace("http://", "ws://", 1) + "/responses"
        self.pid = self.process.pid

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    async def budget_peak(self) -> int:
        """The most the process memory budget ever charged, from `/metrics`."""
        return int(await self.gauge("proto_server_memory_peak_bytes"))

    async def gauge(self, name: str) -> float:
        """A label-less metric of the server's, from `/metrics`."""
        async with httpx.AsyncClient() as client:
            scrape = await client.get(self.http + "/metrics", timeout=30)
        for line in scrape.text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise RuntimeError(f"no {name} on /metrics ({scrape.status_code}): {scrape.text[:300]!r}")


@contextmanager
def server(flags: list[str], *, script: bool | Mapping[str, Any] = True) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="proto-bench-memory-") as workdir:
        running = Server(flags, Path(workdir), script=script)
        try:
            yield running
        finally:
            running.close()


def _flags(nbytes: int, max_memory_mib: int, connection_mib: int) -> list[str]:
    return ["--max-message-bytes", str(max(nbytes * 2, 1 << 24)), "--max-memory",
            str(max_memory_mib), "--max-connection-memory", str(connection_mib)]  # fmt: skip


# -- one shape -----------------------------------------------------------------------------------


async def called(client: WireClient, **fields: Any) -> tuple[str, str]:
    """A small stored create that ends with a call awaiting output: its id and the call's."""
    await client.send(frame_of("many items", 64) | {"store": True, **fields})
    events = await client.until(*END)
    calls = [e["item"]["call_id"] for e in events if e["type"] == "response.output_item.done"
             and e["item"]["type"] == "function_call"]  # fmt: skip
    return str(events[0]["response"]["id"]), str(calls[0])


def answer_of(kind: str, data: Any) -> str:
    """`kind` (an event's type, an HTTP status) with what says why: an error's code, an
    incomplete Response's reason, or the count `input_tokens` answered."""
    if not isinstance(data, dict):
        return kind
    response: dict[str, Any] = data["response"] if isinstance(data.get("response"), dict) else {}
    error = data.get("error") or response.get("error") or {}
    why = error.get("code") if isinstance(error, dict) else None
    why = why or (response.get("incomplete_details") or {}).get("reason")
    if why is None and isinstance(data.get("input_tokens"), int):
        why = f"{data['input_tokens']:,} tokens"
    return f"{kind} {why}" if why else kind


async def post(http: httpx.AsyncClient, url: str, body: bytes) -> str:
    """POST `body`; the answer (`answer_of`): an event stream's last event, else the status and
    its JSON. Only the closing event is decoded: a long stream costs the client little."""
    headers = {"content-type": "application/json"}
    async with http.stream("POST", url, content=body, headers=headers) as answer:
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            return answer_of(f"HTTP {answer.status_code}", orjson.loads(await answer.aread()))
        last, data = "", b"{}"
        async for line in answer.aiter_lines():
            if line.startswith("event: "):
                last = line[7:]
            elif line.startswith("data: ") and last in END:
                data = line[6:].encode()
    return answer_of(last, orjson.loads(data))


def body_of(frame: dict[str, Any]) -> bytes:
    """A create frame as an HTTP body: its `type` dropped, streamed."""
    return orjson.dumps({k: v for k, v in frame.items() if k != "type"} | {"stream": True})


#: Sends the one measured request and waits for its answer (`answer_of`).
Send = Callable[[], Awaitable[str]]


@asynccontextmanager
async def armed(
    running: Server, shape: str, transport: str, nbytes: int
) -> AsyncIterator[tuple[Send, int]]:
    """A client of `running` warmed up by a small request of `shape` over `transport`, with ONE
    request of `shape` ready to send, and its size: whoever measures sends it."""
    warm = max(nbytes // 256, 4096)
    if transport == "http":
        url = running.http + "/v1/responses"
        async with httpx.AsyncClient(timeout=httpx.Timeout(EVENT_TIMEOUT_S)) as http:
            await post(http, url, body_of(frame_of(shape, warm)))
            body = body_of(frame_of(shape, nbytes))
            yield partial(post, http, url, body), len(body)
        return
    inject = shape == "big inject"
    url = running.ws + ("?dialect=prototype" if inject else "")
    async with connect(url, headers=[BETA] if inject else [], max_message_size=4 * nbytes + MiB,
                       event_timeout_s=EVENT_TIMEOUT_S) as client:  # fmt: skip
        target, call_id = "", ""
        if shape in ("big steer", "big inject"):
            target, call_id = await called(client)
            small = frame_of(shape, warm, previous=target)
            if inject:  # resumes it to its end; the measured inject resumes another
                small["input"][0]["call_id"] = call_id
                await client.send(small)
                await client.until(*END)
                target, call_id = await called(client)
            else:  # waits behind the call, as the measured one will
                await client.send(small)
                await client.until("response.steer.pending", "response.steer.failed")
        else:
            await client.send(frame_of(shape, warm))
            await client.until(*END)
        frame = frame_of(shape, nbytes, previous=target)
        if inject:
            frame["input"][0]["call_id"] = call_id
        text = orjson.dumps(frame).decode()
        del frame
        ends = (
            ("response.steer.pending", "response.steer.failed", "error")
            if shape == "big steer"
            else END
        )

        async def send() -> str:
            await client.send(text)
            last = (await client.until(*ends))[-1]
            client.received.clear()
            return answer_of(str(last["type"]), last)

        yield send, len(text)


async def _one(running: Server, shape: str, transport: str, nbytes: int) -> dict[str, Any]:
    """Warm up, reset the peak, send one frame of `shape`, and measure."""
    async with armed(running, shape, transport, nbytes) as (send, frame_bytes):
        baseline = status_kib(running.pid, "VmRSS")
        reset = reset_peak(running.pid)
        answer = await send()
    peak = status_kib(running.pid, "VmHWM") - baseline
    charge = await running.budget_peak()
    return {"shape": shape, "transport": transport, "frame": frame_bytes, "baseline": baseline,
            "peak": peak, "charge": charge, "answer": answer, "peak_reset": reset}  # fmt: skip


def measure_shape(shape: str, transport: str, nbytes: int) -> dict[str, Any]:
    """`shape` over `transport` against a server of its own; its row."""
    budget = max(4096, 200 * nbytes // MiB)  # room for every charge: nothing is refused
    with server(_flags(nbytes, budget, budget)) as running:
        return trio.run(_one, running, shape, transport, nbytes)


# -- the steer flood -----------------------------------------------------------------------------


async def _flood(running: Server, lanes: int, steers: int, nbytes: int) -> dict[str, Any]:
    text = text_of(nbytes)
    size = 2 * nbytes + MiB  # a refused steer comes back with its input
    async with connect(
        running.ws, max_message_size=size, event_timeout_s=EVENT_TIMEOUT_S, message_queue_size=64
    ) as client:
        targets = []
        for lane in range(lanes):
            targets.append((await called(client, stream_id=f"l{lane}"))[0])
        baseline = status_kib(running.pid, "VmRSS")
        reset = reset_peak(running.pid)
        answers: Counter[str] = Counter()
        peak_seen = [0]

        async def read() -> None:
            for _ in range(lanes * steers):
                event = await client.until("response.steer.pending", "response.steer.failed",
                                           "error")  # fmt: skip
                last = event[-1]
                code = last.get("error", {}).get("code", "")
                answers[f"{last['type']} {code}".strip()] += 1
                client.received.clear()
                peak_seen[0] = max(peak_seen[0], status_kib(running.pid, "VmHWM"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for _ in range(steers):
                for target in targets:
                    frame = {"type": "response.steer", "previous_response_id": target,
                             "input": text}  # fmt: skip
                    await client.send(orjson.dumps(frame).decode())
    peak = status_kib(running.pid, "VmHWM")
    return {
        "lanes": lanes,
        "steers": steers,
        "steer_bytes": nbytes,
        "baseline": baseline,
        "peak": peak,
        "peak_above_baseline": peak - baseline,
        "budget_peak": await running.budget_peak(),
        "answers": dict(answers),
        "peak_reset": reset,
    }


def steer_flood(
    lanes: int, steers: int, nbytes: int, max_memory_mib: int, connection_mib: int
) -> dict[str, Any]:
    with server(_flags(nbytes, max_memory_mib, connection_mib)) as running:
        row = trio.run(_flood, running, lanes, steers, nbytes)
    row["max_memory"] = max_memory_mib * MiB
    row["max_connection_memory"] = connection_mib * MiB
    return row


# -- the command ---------------------------------------------------------------------------------


#: `--mb`: a size in MB, positive and finite (nan, inf and 0 are refused, exit 2).
megabytes = flags.checked("MB", float, lambda value: 0 < value < math.inf)


def _allowed_flood(flood: tuple[float, float, float]) -> bool:
    lanes, steers, mb = flood
    return lanes >= 1 and steers >= 1 and lanes % 1 == 0 and steers % 1 == 0 and 0 < mb < math.inf


@attrs.frozen(kw_only=True)
class MemorySettings:
    """What `bench memory` runs: each field is a flag of its."""

    nbytes: int = setting(
        15 * MiB, flag="--mb", unit=MiB, parse=megabytes, metavar="MB",
        help="size of each shape's frame, in MB",
    )  # fmt: skip
    shapes: tuple[str, ...] = setting(
        SHAPES, flags.some_of(SHAPES), parse=flags.names, metavar="NAMES",
        help=f"comma-separated subset of {','.join(SHAPES)}",
    )  # fmt: skip
    steer_flood: tuple[float, float, float] | None = setting(
        None, Range("whole LANES and STEERS of at least 1, and MB positive", _allowed_flood),
        nargs=3, metavar=("LANES", "STEERS", "MB"),
        help="instead of the shapes, one connection with LANES lanes each sent STEERS steers of "
        "MB (the attack measured: 32 9 15), under --flood-max-memory",
    )  # fmt: skip
    flood_max_memory: tuple[int, int] = setting(
        (1024, 256), Range("at least 1 MiB each", lambda pair: min(pair) >= 1),
        nargs=2, parse=int, metavar=("MIB", "CONNECTION_MIB"),
        help="the flood's --max-memory and --max-connection-memory",
    )  # fmt: skip


def _mb(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def run(settings: MemorySettings, out: Path) -> int:
    """The shapes' table (or the flood's figures), saved as memory.json in `out`."""
    progress = partial(print, file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory.json"
    if settings.steer_flood is not None:
        lanes, steers, mb = settings.steer_flood
        progress(f"steer flood: {int(lanes)} lanes x {int(steers)} steers x {mb:g} MB")
        started = time.perf_counter()
        row = steer_flood(int(lanes), int(steers), int(mb * MiB), *settings.flood_max_memory)
        within = row["peak_above_baseline"] <= row["max_memory"]
        print(
            f"steer flood: {row['lanes']} lanes x {row['steers']} steers x "
            f"{_mb(row['steer_bytes'])} MB, --max-memory {_mb(row['max_memory'])} MiB, "
            f"--max-connection-memory {_mb(row['max_connection_memory'])} MiB "
            f"({time.perf_counter() - started:.0f} s)\n"
            f"  baseline RSS {_mb(row['baseline'])} MiB, peak RSS {_mb(row['peak'])} MiB: "
            f"{_mb(row['peak_above_baseline'])} MiB above the baseline "
            f"({'within' if within else 'PAST'} the budget); the budget charged at most "
            f"{_mb(row['budget_peak'])} MiB\n"
            "  answers: " + ", ".join(f"{n} {kind}" for kind, n in sorted(row["answers"].items()))
        )
        path.write_bytes(orjson.dumps({"steer_flood": row}, option=orjson.OPT_INDENT_2))
        print(f"Saved {path}")
        return 0 if within else 1
    nbytes = settings.nbytes
    rows = []
    cases = [(shape, transport) for shape in settings.shapes for transport in TRANSPORTS[shape]]
    for number, (shape, transport) in enumerate(cases, 1):
        progress(f"memory [{number}/{len(cases)}]: {shape} over {transport}, "
                 f"{nbytes / MiB:g} MB")  # fmt: skip
        rows.append(row := measure_shape(shape, transport, nbytes))
        progress(f"  peak {_mb(row['peak'])} MB above a baseline of {_mb(row['baseline'])} MB, "
                 f"charged {_mb(row['charge'])} MB")  # fmt: skip
    print(render(rows))
    path.write_bytes(orjson.dumps({"shapes": rows}, option=orjson.OPT_INDENT_2))
    print(f"Saved {path}")
    return 0 if all(r["peak"] <= r["charge"] for r in rows) else 1


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':<12} {'over':<10} {'frame MB':>9} {'peak MB':>8} {'peak/frame':>11} "
        f"{'charge MB':>10} {'peak/charge':>12}  answer"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:<12} {r['transport']:<10} {_mb(r['frame']):>9} {_mb(r['peak']):>8} "
            f"{r['peak'] / r['frame']:>10.1f}x {_mb(r['charge']):>10} "
            f"{r['peak'] / r['charge']:>12.2f}  {r['answer']}"
        )
    worst = max(r["peak"] / r["charge"] for r in rows)
    lines.append(f"worst peak/charge: {worst:.2f} (at most 1: every shape within its charge)")
    return "\n".join(lines)
