"""A bystander: a process of its own that asks a server `GET /healthz` every 10 ms while
something else is sent to it, and says how long its worst wait was.

The server answers `/healthz` on its event loop at once, so the bystander's worst wait is how
long one request kept that loop from everyone else. It runs in a process of its own (`python -m
proto_server_bench.bystander HOST PORT INTERVAL_MS`), so that what the measuring client does
(encoding a frame, decoding a long stream) never holds up the bystander's own probes. It speaks
HTTP/1.1 on one kept-alive connection with plain blocking sockets: nothing between it and the
wait it measures. It prints `ready` once its first probe is answered; a line on its stdin stops
it, and it prints its figures as one JSON line: a probe still unanswered then counts as a wait
as long as it has been out (`unanswered_ms`).
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import trio

INTERVAL_S = 0.010
REQUEST = b"GET /healthz HTTP/1.1\r\nhost: bystander\r\n\r\n"
#: How often a blocked read looks whether it was told to stop.
POLL_S = 0.020
#: How long the parent waits for the first answer, or for the figures once it said stop.
READY_TIMEOUT_S = 30.0


def _answered(sock: socket.socket, stop: threading.Event) -> bool:
    """Read one HTTP answer (head and `content-length` body); False if told to stop first."""
    data = b""
    while True:
        head, found, body = data.partition(b"\r\n\r\n")
        if found:
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            if len(body) >= length:
                return True
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if stop.is_set():
                return False
            continue
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk


def watch(host: str, port: int, interval_s: float, stop: threading.Event) -> dict[str, Any]:
    """Probe until `stop` is set; the figures, in milliseconds."""
    waits: list[float] = []
    worst_gap = unanswered = 0.0
    failures = 0
    last: float | None = None
    sock: socket.socket | None = None
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=POLL_S)
            sock.sendall(REQUEST)
            answered = _answered(sock, stop)
        except OSError:
            failures += 1
            if sock is not None:
                sock.close()
            sock = None
            time.sleep(interval_s)
            continue
        now = time.perf_counter()
        if not answered:
            unanswered = now - sent
            break
        if not waits:
            print("ready", flush=True)
        waits.append(now - sent)
        worst_gap = max(worst_gap, now - (sent if last is None else last))
        last = now
        time.sleep(max(0.0, sent + interval_s - time.perf_counter()))
    if sock is not None:
        sock.close()
    ms = [wait * 1000 for wait in waits]
    return {
        "probes": len(waits),
        "worst_wait_ms": max([*ms, unanswered * 1000], default=0.0),
        "median_wait_ms": statistics.median(ms) if ms else 0.0,
        "worst_gap_ms": max(worst_gap, unanswered) * 1000,
        "unanswered_ms": unanswered * 1000,
        "failures": failures,
    }


def main(argv: list[str]) -> None:
    host, port, interval_ms = argv[0], int(argv[1]), float(argv[2])
    stop = threading.Event()

    def stopping() -> None:
        sys.stdin.readline()  # a line, or the parent gone
        stop.set()

    threading.Thread(target=stopping, daemon=True).start()
    print(json.dumps(watch(host, port, interval_ms / 1000, stop)), flush=True)


class Bystander:
    """The parent's handle: `stop()` gives the figures."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def line(self) -> str:
        assert self.process.stdout is not None
        with trio.fail_after(READY_TIMEOUT_S):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some()
                if not chunk:
                    raise RuntimeError("the bystander exited without a word")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    async def stop(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(b"stop\n")
        figures: dict[str, Any] = json.loads(await self.line())
        return figures


@asynccontextmanager
async def watching(base: str, interval_s: float = INTERVAL_S) -> AsyncIterator[Bystander]:
    """A bystander probing the server at `base` (`http://host:port`), once it was answered."""
    parts = urlsplit(base)
    command = [sys.executable, "-m", "proto_server_bench.bystander", str(parts.hostname),
               str(parts.port), str(interval_s * 1000)]  # fmt: skip
    process = await trio.lowlevel.open_process(command, stdin=-1, stdout=-1)
    try:
        bystander = Bystander(process)
        if (first := await bystander.line()) != "ready":
            raise RuntimeError(f"the bystander said {first!r}")
        yield bystander
    finally:
        process.kill()
        await process.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
