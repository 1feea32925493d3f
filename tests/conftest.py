"""Fixtures: a real server on 127.0.0.1 (port 0), started in the test's own nursery; and a
deadline on every async test, so that none can hang the suite."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import trio

from proto_server.engine.default_model import DefaultModel
from proto_server.engine.script import Planner, parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.store import ResponseStore

from .support.deadline import under_deadline
from .support.published import SchemaNet
from .support.servers import FAST, Running, StartServer

#: Every async test ends within this many seconds (`@pytest.mark.deadline(s)` for more).
DEADLINE_S = 120.0
#: On trio's virtual clock a test that waits on nothing jumps straight to its deadline.
VIRTUAL_DEADLINE_S = 24 * 3600.0
VIRTUAL_CLOCKS = {"autojump_clock", "mock_clock"}


#: The markers a test must carry to use each of these fixtures: `-m 'not postgres'` (and the
#: others) must deselect every test that needs what the marker names.
MARKED_FIXTURES = {
    "vllm_engine": ("engine", "model"),  # SmolLM2 as the project's loader converts it
    "postgres": ("postgres",),
    "pg_url": ("postgres",),
}


def unmarked(item: pytest.Item) -> list[str]:
    """The markers `item` lacks for the fixtures it asks for."""
    names = getattr(item, "fixturenames", ())
    needed = {m for fixture, marks in MARKED_FIXTURES.items() if fixture in names for m in marks}
    return sorted(m for m in needed if item.get_closest_marker(m) is None)


@pytest.hookimpl(trylast=True)  # after pytest-trio has marked the async tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    lying = [f"{item.nodeid}: {', '.join(lacks)}" for item in items if (lacks := unmarked(item))]
    if lying:
        raise pytest.UsageError("tests lacking the markers of their fixtures:\n" + "\n".join(lying))
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("trio") is None:
            continue
        marker = item.get_closest_marker("deadline")
        seconds = float(marker.args[0]) if marker is not None else DEADLINE_S
        if VIRTUAL_CLOCKS & set(item.fixturenames):
            seconds = VIRTUAL_DEADLINE_S
        search = getattr(item.obj, "hypothesis", None)
        if search is not None:  # a hypothesis test: each example under the deadline
            search.inner_test = under_deadline(search.inner_test, seconds, item.name)
        else:
            item.obj = under_deadline(item.obj, seconds, item.name)


@pytest.fixture(autouse=True, scope="session")
def data_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A `serve` given no --store opens the default store (under XDG_DATA_HOME, or
    ~/.local/share): the tests' own, in a folder of theirs, never the user's. (A user's store
    that a newer checkout had migrated made an older one's test refuse to start.)"""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data-home")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def published_schema(monkeypatch: pytest.MonkeyPatch) -> Iterator[SchemaNet]:
    """Every event and body the servers of a test send must validate against the published
    schema (tests/support/published.py); the test fails at teardown if one did not."""
    net = SchemaNet()
    net.install(monkeypatch)
    yield net
    net.verdict()


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
        store: ResponseStore | None = None,  # noqa: F811  (not the `store` fixture)
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


from .support.engine import vllm_engine  # noqa: E402, F401  (the session's vLLM, for `engine` tests)
from .support.postgres import pg_url, postgres  # noqa: E402, F401  (a throwaway PostgreSQL cluster)
from .support.stores import open_store, store  # noqa: E402, F401  (each kind of persisted store)
