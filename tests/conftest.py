"""Fixtures: a real server on 127.0.0.1 (port 0), started in the test's own nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import trio

from proto_server.engine.default_model import DefaultModel
from proto_server.engine.script import Planner, parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.app import BoundAddress, ProtoServer
from proto_server.server.config import ServerConfig
from proto_server.server.store import ANONYMOUS, ResponseStore, StoredResponse

from .published import SchemaNet


@pytest.fixture(autouse=True)
def published_schema(monkeypatch: pytest.MonkeyPatch) -> Iterator[SchemaNet]:
    """Every event and body the servers of a test send must validate against the published
    schema (tests/published.py); the test fails at teardown if one did not."""
    net = SchemaNet()
    net.install(monkeypatch)
    yield net
    net.verdict()


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


class CheckpointStore:
    """A store in a dict that yields once per call, as a real one would, without a thread
    (a worker thread would look idle to `wait_all_tasks_blocked` and end `quiet()` early)."""

    def __init__(self) -> None:
        self.responses: dict[str, StoredResponse] = {}

    async def put(self, stored: StoredResponse) -> None:
        await trio.lowlevel.checkpoint()
        self.responses[stored.response.id] = stored

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        await trio.lowlevel.checkpoint()
        stored = self.responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        stored = await self.get(response_id, owner=owner)
        return None if stored is None else [stored]

    async def aclose(self) -> None:
        pass


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
    """`await start_server(script=..., **config)` -> a running server in this test's nursery.

    On the autojump clock pass `store=CheckpointStore()`: SQLite's worker thread looks idle to
    trio, which would jump the clock past every deadline while a Response is being stored."""

    async def start(
        script: dict[str, Any] | None = None,
        *,
        planner: Planner | None = None,
        timing: TimingModel = FAST,
        store: ResponseStore | None = None,
        **config: Any,
    ) -> Running:
        if planner is None:
            planner = parse_script(script) if script is not None else DefaultModel()
        server = ProtoServer(
            SimulatedGenerator(planner, timing), ServerConfig(port=0, **config), store=store
        )
        address = await nursery.start(server.serve)
        return Running(server, address)

    yield start


from .engine import vllm_engine  # noqa: E402, F401  (the session's vLLM, for `engine` tests)
from .postgres import pg_url, postgres  # noqa: E402, F401  (a throwaway PostgreSQL cluster)
