"""proto-server in front of vLLM against vLLM's own `/v1/responses`, turn by turn, measured.

One agent loop (forced tool calls, a tool output of 300-500 tokens appended after each, a final
answer) runs through five paths on the same engine, interleaved turn by turn: proto-server's
prototype WebSocket (one Response, suspended on each call), its launched WebSocket (turns
chained by `previous_response_id`), its stateless HTTP (the whole history each turn), vLLM's
own `/v1/responses` with the whole history (`store: false`) and chained by
`previous_response_id` (the engine started with `VLLM_ENABLE_RESPONSES_API_STORE=1`).
proto-server runs as a process of its own so that its CPU, like that of vLLM's API server
process (its engine core is a child process and is not counted), is read from `/proc` (each
thread's scheduler time) at each turn's end. Whatever the model said, every path's client
appends the same tool output each turn: as the output of the model's call when it made one,
else as a user message (vLLM's own endpoint without a tool parser answers in text). Times are
wall-clock on the client: to the first output delta (TTFT) and to the terminal event; token
counts are what each path reports in `usage`. The paths' clients are paths.py's.

This module measures; `vllm_report` says what a run found (and holds the command). `Turn` is
what `run_paths` records at each turn's end (the engine's decode and both front ends' CPU read
around it) and what the report's table and plots read back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from proto_server_bench.paths import (
    ASK,
    INSTRUCTIONS,
    OURS,
    PATH_FAILURES,
    PATHS,
    Items,
    Send,
    calls,
    follow_up,
    open_path,
    start_proto_server,
    valid_call,
)

#: The engine's histograms (`/metrics`): its decode after the first token is their difference.
E2E, ENGINE_TTFT = "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"
PLOTS = ("ttft-per-turn.png", "cached-share-per-turn.png", "front-end-cpu-per-turn.png")
Progress = Callable[[str], None]


@attrs.frozen
class Turn:
    path: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    #: Whether the model called the tool this turn.
    called: bool
    #: Whether every call it made names the tool with arguments its schema allows.
    valid: bool
    #: To the first output event the client saw.
    ttft_s: float
    turn_s: float
    #: The engine's time from its first token to its last (its /metrics).
    engine_decode_s: float
    #: What the client sent for the turn: the frame or the request body.
    client_bytes: int
    #: CPU of proto-server's process and of vLLM's API server process over the turn.
    proto_cpu_ms: float
    api_server_cpu_ms: float

    @property
    def front_end_cpu_ms(self) -> float:
        """The CPU of the path's own front end: proto-server, or vLLM's API server."""
        return self.proto_cpu_ms if self.path in OURS else self.api_server_cpu_ms

    @property
    def first_token_s(self) -> float:
        """The turn less the engine's decode after its first token: when the first token was
        there, comparable on every path (whether the client saw it or not)."""
        return self.turn_s - self.engine_decode_s

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """The CPU time of each live thread of a process so far, in ns: the scheduler's own count
    (`/proc/PID/task/TID/schedstat`), not clock ticks, which are 10 ms, a turn's whole cost."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return times


class CpuMeter:
    """CPU of both front ends between consecutive marks (no CPU falls between two turns), summed
    over their threads; a thread that ends between two marks takes its last share with it."""

    def __init__(self, proto_pid: int, api_server_pid: int) -> None:
        self.pids = (proto_pid, api_server_pid)
        self.last = [thread_cpu_ns(pid) for pid in self.pids]

    def mark(self) -> tuple[float, float]:
        """The CPU of each front end since the last mark, in ms."""
        now = [thread_cpu_ns(pid) for pid in self.pids]
        proto, api = (
            sum(ns - last.get(tid, 0) for tid, ns in times.items()) / 1e6
            for times, last in zip(now, self.last, strict=True)
        )
        self.last = now
        return proto, api


async def engine_decode_total(http: httpx.AsyncClient) -> tuple[float, float]:
    """The engine's finished requests and their summed decode time after the first token."""
    sums = {f"{E2E}_count": 0.0, f"{E2E}_sum": 0.0, f"{ENGINE_TTFT}_sum": 0.0}
    for line in (await http.get("/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums[f"{E2E}_count"], sums[f"{E2E}_sum"] - sums[f"{ENGINE_TTFT}_sum"]


async def engine_decode_after(http: httpx.AsyncClient, finished: float) -> tuple[float, float]:
    """As `engine_decode_total`, once the engine has counted more than `finished` requests (it
    records a request a moment after its stream ends)."""
    for _ in range(100):
        count, decode = await engine_decode_total(http)
        if count > finished:
            break
        await trio.sleep(0.02)
    return count, decode


def tool_output(turn: int, tokens: int, tokenizer: Any) -> str:
    """A deterministic, turn-specific tool output of about `tokens` of the model's tokens."""
    lines: list[str] = []
    line = 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(f"tests/test_{turn}_{line}.py::test_case_{line} PASSED [{line % 100}%]")
        line += 1
    return "\n".join(lines)


def output_sizes(turns: int, tokens: int) -> list[int]:
    """Turn 2..N's tool output sizes: 0.75x to 1.25x `tokens` (300-500 for 400), varied."""
    return [round(tokens * (0.75 + 0.125 * ((turn * 3) % 5))) for turn in range(2, turns + 1)]


@attrs.frozen
class Setup:
    """Where the front ends are and what the loop is."""

    proto_url: str
    proto_pid: int
    engine_url: str
    engine_pid: int
    model: str
    turns: int
    answer_tokens: int


async def run_paths(
    setup: Setup, outputs: Sequence[str], nonce: str, progress: Progress
) -> dict[str, list[Turn] | str]:
    """Every path's loop, interleaved turn by turn (turn 1 on each path, then turn 2, ...), so
    that whatever else this machine does falls on all of them alike. Turn 1 asks, each later
    turn adds a tool output; every turn but the last forces a call, the last answers
    (`tool_choice: none`). A path that fails keeps why, and the others go on."""
    results: dict[str, list[Turn] | str] = {}
    sends: dict[str, Send] = {}
    root = setup.engine_url.removesuffix("/v1")
    with contextlib.suppress(*PATH_FAILURES):  # closing a path that failed
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(httpx.AsyncClient(base_url=root, timeout=30))
            for path in PATHS:
                # the path's own instructions: nothing of its prompts is in the cache from another
                instructions = f"[{nonce} {path}] {INSTRUCTIONS}"
                opened = open_path(path, setup.proto_url, setup.engine_url, setup.model,
                                   instructions, setup.answer_tokens)  # fmt: skip
                try:
                    sends[path] = await stack.enter_async_context(opened)
                except PATH_FAILURES as exc:
                    results[path] = f"{exc.__class__.__name__}: {exc}"
            new: dict[str, Items] = {path: [{"role": "user", "content": ASK}] for path in sends}
            turns: dict[str, list[Turn]] = {path: [] for path in sends}
            finished, decoded = await engine_decode_total(engine)
            meter = CpuMeter(setup.proto_pid, setup.engine_pid)
            for turn in range(1, setup.turns + 1):
                for path, send in list(sends.items()):
                    try:
                        said = await send(new[path], "required" if turn < setup.turns else "none")
                    except PATH_FAILURES as exc:
                        results[path] = f"{exc.__class__.__name__}: {exc}"
                        progress(f"{path} failed: {results[path]}")
                        del sends[path]
                        continue
                    proto_cpu, api_cpu = meter.mark()
                    before = decoded
                    finished, decoded = await engine_decode_after(engine, finished)
                    meter.mark()  # the API server's answer to /metrics is no turn's
                    made = calls(said.output)
                    result = Turn(path, turn, *said.usage, bool(made),
                                  all(valid_call(call) for call in made), said.ttft_s,
                                  said.turn_s, decoded - before, said.client_bytes, proto_cpu,
                                  api_cpu)  # fmt: skip
                    turns[path].append(result)
                    progress(
                        f"turn {turn}/{setup.turns}, {path}: prompt {result.prompt_tokens}, "
                        f"cached {result.cached_tokens}, TTFT {result.ttft_s * 1e3:.0f} ms, "
                        f"front-end CPU {result.front_end_cpu_ms:.1f} ms"
                    )
                    if turn < setup.turns:
                        new[path] = follow_up(said.output, outputs[turn - 1])
            results.update({path: turns[path] for path in sends})
    return {path: results[path] for path in PATHS if path in results}


async def measure(
    *,
    engine_url: str,
    engine_pid: int,
    model: str,
    tokenizer: Any,
    turns: int,
    tool_output_tokens: int,
    answer_tokens: int,
    nonce: str,
    progress: Progress = lambda line: None,
) -> dict[str, list[Turn] | str]:
    """Every path's turns (or why it failed), interleaved on the same engine."""
    outputs = [
        tool_output(turn, size, tokenizer)
        for turn, size in enumerate(output_sizes(turns, tool_output_tokens), 2)
    ]
    process, proto_url = await start_proto_server(engine_url, answer_tokens)
    setup = Setup(proto_url, process.pid, engine_url, engine_pid, model, turns, answer_tokens)
    try:
        return await run_paths(setup, outputs, nonce, progress)
    finally:
        process.terminate()
        with trio.move_on_after(30):
            await process.wait()
