"""A bounded load test on loopback: many suspended rollouts held at once, streams beside them.

    python -m proto_server.testing.load --connections 500 --streams 50

Starts `proto-server serve` in a child process on 127.0.0.1 (port 0), then, from this process:

1. opens `--connections` WebSockets, each holding a suspended rollout (create, read to
   `response.done`, and wait), and reads the server's resident memory before and after;
2. while they wait, runs `--streams` clients at once, each through `--rollouts` whole
   rollouts, and counts the events they receive per second;
3. answers every suspended rollout so it completes, and stops the server with SIGTERM.

`StreamChecker` follows every connection, so no event may be lost, reordered or malformed; a
violation is counted and reported. The whole run stops after `--timeout` seconds at the latest.
The simulated GPU runs unpaced (its modelled time is ~0), so throughput measures the server
and this client on this machine, together.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from proto_server.testing.checker import InvariantViolation
from proto_server.testing.client import connect_checked

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
#: Connections opened at once while setting up (a burst of thousands of SYNs helps no one).
OPENING_AT_ONCE = 50
FILES_PER_CONNECTION = 2  # this process's socket, and the server's


@attrs.frozen(kw_only=True)
class LoadResult:
    connections: int
    streams: int
    rollouts_per_stream: int
    rss_before_bytes: int | None
    rss_suspended_bytes: int | None
    stream_events: int
    stream_seconds: float
    streams_checked: int
    violations: tuple[str, ...]
    exit_code: int | None

    @property
    def bytes_per_suspended_rollout(self) -> float | None:
        if self.rss_before_bytes is None or self.rss_suspended_bytes is None:
            return None
        return (self.rss_suspended_bytes - self.rss_before_bytes) / max(self.connections, 1)

    @property
    def events_per_second(self) -> float:
        return self.stream_events / self.stream_seconds if self.stream_seconds else 0.0

    def table(self) -> str:
        def mib(value: float | None) -> str:
            return "n/a" if value is None else f"{value / 2**20:.1f} MiB"

        per = self.bytes_per_suspended_rollout
        rows = [
            ("connections, each holding a suspended rollout", f"{self.connections}"),
            ("server memory (RSS) before / with them", f"{mib(self.rss_before_bytes)} / "
             f"{mib(self.rss_suspended_bytes)}"),
            ("memory per suspended rollout", "n/a" if per is None else f"{per / 1024:.1f} KiB"),
            ("concurrent streaming rollouts", f"{self.streams} x {self.rollouts_per_stream}"),
            ("events streamed", f"{self.stream_events} in {self.stream_seconds:.2f} s"),
            ("event throughput (measured)", f"{self.events_per_second:,.0f} events/s"),
            ("streams checked / invariant violations",
             f"{self.streams_checked} / {len(self.violations)}"),
            ("server exit code after SIGTERM", f"{self.exit_code}"),
        ]  # fmt: skip
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'measure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
        return "\n".join(lines)


def raise_file_limit(needed: int) -> None:
    """Raise the soft limit on open files to `needed` (the server child inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(
            f"load: {needed} open files are needed but the hard limit is {hard}; raise it "
            "(ulimit -Hn) or ask for fewer --connections"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory, from /proc (None where there is no /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def script(text_tokens: int) -> dict[str, Any]:
    """A rollout: some text and one tool call (a suspension), then a short answer."""
    first = {
        "text": "word " * text_tokens,
        "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}],
    }
    return {"segments": [first, {"text": "done"}]}  # fmt: skip


def create() -> dict[str, Any]:
    return {
        "type": "response.create",
        "model": "load",
        "input": "go",
        "tools": [EXEC_COMMAND],
        "store": False,
    }


def answers(events: list[dict[str, Any]]) -> dict[str, Any]:
    outputs = [
        {"type": "function_call_output", "call_id": e["item"]["call_id"], "output": "ok"}
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]
    return {"type": "response.append", "input": outputs}


class Countdown:
    """Set once `count` tasks have said they are ready (or gave up trying)."""

    def __init__(self, count: int) -> None:
        self.remaining = count
        self.event = trio.Event()
        if count <= 0:
            self.event.set()

    def done(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.event.set()


class Load:
    """The clients. A client whose stream breaks an invariant is counted, not fatal."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.violations: list[str] = []
        self.checked = 0
        self.stream_events = 0

    async def suspended(
        self, limiter: trio.CapacityLimiter, ready: Countdown, release: trio.Event
    ) -> None:
        """Hold one suspended rollout until `release`, then finish it."""
        try:
            async with connect_checked(self.url) as client:
                try:
                    async with limiter:
                        await client.send(create())
                        first = await client.segment()
                finally:
                    ready.done()
                await release.wait()
                await client.send(answers(first))
                await client.segment()
            self.checked += 1
        except* InvariantViolation as group:
            self.violations.extend(str(e) for e in group.exceptions)

    async def stream(self, rollouts: int, *, counted: bool = True) -> None:
        try:
            async with connect_checked(self.url) as client:
                for _ in range(rollouts):
                    await client.send(create())
                    events = await client.segment()
                    await client.send(answers(events))
                    await client.segment()
            self.checked += 1
            if counted:
                self.stream_events += len(client.received)
        except* InvariantViolation as group:
            self.violations.extend(str(e) for e in group.exceptions)


async def run_load(
    *,
    connections: int,
    streams: int,
    rollouts: int = 20,
    text_tokens: int = 200,
    timeout_s: float = 300.0,
) -> LoadResult:
    raise_file_limit(FILES_PER_CONNECTION * (connections + streams) + 256)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "script.json"
        path.write_text(json.dumps(script(text_tokens)))
        command = [
            *(sys.executable, "-m", "proto_server", "serve", "--host", "127.0.0.1"),
            *("--port", "0", "--store", ":memory:", "--script", str(path)),
            *("--decode-rate", "1e9", "--prefill-rate", "1e12", "--log-level", "error"),
            *("--max-suspended-rollouts", str(max(connections, 1) * 2)),
        ]
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                server: trio.Process = await nursery.start(
                    partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
                )
                result = await _measure(server, connections, streams, rollouts)
                server.send_signal(signal.SIGTERM)
                code = await server.wait()
        return attrs.evolve(result, exit_code=code)


async def _measure(
    server: trio.Process, connections: int, streams: int, rollouts: int
) -> LoadResult:
    assert server.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        chunk = await server.stdout.receive_some()
        if not chunk:
            raise RuntimeError("the server exited before it said where it listens")
        line += chunk
    url = line.decode().split("WebSocket ")[1].split(";")[0] + "?dialect=prototype"
    load = Load(url)
    await load.stream(1, counted=False)  # warm the server up before measuring it
    rss_before = resident_bytes(server.pid)
    ready = Countdown(connections)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(OPENING_AT_ONCE)
        for _ in range(connections):
            nursery.start_soon(load.suspended, limiter, ready, release)
        await ready.event.wait()
        rss_suspended = resident_bytes(server.pid)
        started = time.perf_counter()
        async with trio.open_nursery() as streaming:
            for _ in range(streams):
                streaming.start_soon(load.stream, rollouts)
        seconds = time.perf_counter() - started
        release.set()
    return LoadResult(
        connections=connections,
        streams=streams,
        rollouts_per_stream=rollouts,
        rss_before_bytes=rss_before,
        rss_suspended_bytes=rss_suspended,
        stream_events=load.stream_events,
        stream_seconds=seconds,
        streams_checked=load.checked,
        violations=tuple(load.violations),
        exit_code=None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proto_server.testing.load",
        description="A bounded load test of proto-server on loopback; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--connections", type=int, default=500,
                        help="connections, each holding a suspended rollout")  # fmt: skip
    parser.add_argument("--streams", type=int, default=50,
                        help="clients streaming rollouts at once, beside them")  # fmt: skip
    parser.add_argument("--rollouts", type=int, default=20,
                        help="whole rollouts each streaming client runs")  # fmt: skip
    parser.add_argument("--text-tokens", type=int, default=200,
                        help="tokens of text in each rollout's first segment")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds after which the run stops, finished or not")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        result = trio.run(
            lambda: run_load(
                connections=args.connections,
                streams=args.streams,
                rollouts=args.rollouts,
                text_tokens=args.text_tokens,
                timeout_s=args.timeout,
            )
        )
    except trio.TooSlowError:
        print(f"load: not done after {args.timeout:g} s; stopped", file=sys.stderr)
        return 1
    print(result.table())
    for violation in result.violations[:10]:
        print(f"violation: {violation}", file=sys.stderr)
    return 0 if not result.violations and result.exit_code == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
