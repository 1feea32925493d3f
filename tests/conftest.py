"""Fixtures: a real server on 127.0.0.1 (port 0), started in the test's own nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio

from proto_server.engine.default_model import DefaultModel
from proto_server.engine.script import Planner, parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.app import BoundAddress, ProtoServer
from proto_server.server.config import ServerConfig

#: Fast enough that a live test spends its time on sockets, not on modelled GPU time.
FAST = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1e6)

THREE_SEGMENTS = {
    "segments": [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}],
        },
        {
            "tool_calls": [
                {"name": "exec_command", "arguments": {"cmd": "cat a.py"}},
                {"name": "exec_command", "arguments": {"cmd": "cat b.py"}},
            ]
        },
        {"text": "Fixed: the loop was off by one."},
    ]
}

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
    "strict": False,
}


class Running:
    def __init__(self, server: ProtoServer, address: BoundAddress) -> None:
        self.server = server
        self.address = address

    @property
    def prototype_url(self) -> str:
        return f"{self.address.ws_url}?dialect=prototype"


StartServer = Callable[..., Any]


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> AsyncIterator[StartServer]:
    """`await start_server(script=..., **config)` -> a running server in this test's nursery."""

    async def start(
        script: dict[str, Any] | None = None,
        *,
        planner: Planner | None = None,
        timing: TimingModel = FAST,
        **config: Any,
    ) -> Running:
        if planner is None:
            planner = parse_script(script) if script is not None else DefaultModel()
        server = ProtoServer(SimulatedGenerator(planner, timing), ServerConfig(port=0, **config))
        address = await nursery.start(server.serve)
        return Running(server, address)

    yield start
