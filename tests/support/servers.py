"""Servers for the tests: one running in the test (`start_server`'s), a real `serve` process,
free ports, and what a server's tasks are doing."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio
import trio.testing

from proto_server.engine.simulated import TimingModel
from proto_server.server.listener.app import BoundAddress, ProtoServer

#: Fast enough that a live test spends its time on sockets, not on modelled GPU time.
FAST = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1e6)


class Running:
    def __init__(self, server: ProtoServer, address: BoundAddress) -> None:
        self.server = server
        self.address = address

    @property
    def prototype_url(self) -> str:
        return f"{self.address.ws_url}?dialect=prototype"


StartServer = Callable[..., Any]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def read_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some()
        assert chunk, "the server exited before printing its address"
        data += chunk
    return data.decode()


async def serve_process(
    nursery: trio.Nursery, store: str, script: Path, *flags: str, stderr: int | None = None
) -> tuple[trio.Process, str]:
    """A real `serve` process on `store`, playing `script`: it and its prototype-dialect URL
    (`stderr`: `subprocess.PIPE` to read its log)."""
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", store,
               "--script", str(script), "--no-prefix-cache", *flags]  # fmt: skip
    process: trio.Process = await nursery.start(
        partial(trio.run_process, command, stdout=subprocess.PIPE, stderr=stderr, check=False)
    )
    assert process.stdout is not None
    line = await read_line(process.stdout)
    http = line.split("listening on ")[1].split(" ")[0]
    return process, http.replace("http://", "ws://", 1) + "/responses?dialect=prototype"


SETTLE_S = 0.005  # how long every task must stay blocked for the connection to count as quiet


async def quiet() -> None:
    await trio.testing.wait_all_tasks_blocked(SETTLE_S)


def live_task_names() -> list[str]:
    names: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        names.append(task.name)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return names


def server_tasks() -> list[str]:
    parts = ("rollout", "connection", "Connection", "_handle", "_generate", "trio_websocket")
    return [n for n in live_task_names() if any(p in n for p in parts)]
