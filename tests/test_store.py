"""The persisted store: chains come back whole, retention is enforced, crashes corrupt nothing."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from proto_server.server.store import SQLiteStore, StoredResponse, chain_items
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message
from proto_server.wire.response import Response


def stored(response_id: str, previous: str | None = None, text: str = "x") -> StoredResponse:
    return StoredResponse(
        response=Response(
            id=response_id,
            created_at=0,
            status="completed",
            model="m",
            previous_response_id=previous,
            output=(Message(role="assistant", content=text),),
        ),
        items=(
            Message(role="user", content=f"q {response_id}"),
            Message(role="assistant", content=text),
        ),
    )


async def test_a_chain_comes_back_in_order() -> None:
    store = SQLiteStore()
    call = FunctionCall(id="fc_1", call_id="call_1", name="f", arguments="{}", status="completed")
    await store.put(
        StoredResponse(
            response=stored("resp_1").response, items=(Message(role="user", content="a"), call)
        )
    )
    await store.put(
        StoredResponse(
            response=stored("resp_2", "resp_1").response,
            items=(FunctionCallOutput(call_id="call_1", output="ok"),),
        )
    )
    chain = await store.chain("resp_2")
    assert chain is not None
    assert [s.response.id for s in chain] == ["resp_1", "resp_2"]
    assert chain_items(chain) == [
        Message(role="user", content="a"), call, FunctionCallOutput(call_id="call_1", output="ok")
    ]  # fmt: skip
    assert await store.get("resp_1") == chain[0]
    assert await store.chain("resp_unknown") is None
    await store.aclose()


async def test_a_broken_chain_is_a_miss() -> None:
    store = SQLiteStore()
    await store.put(stored("resp_2", "resp_1"))
    assert await store.chain("resp_2") is None


async def test_retention_by_count_and_by_age() -> None:
    now = [1000.0]
    store = SQLiteStore(max_responses=2, max_age_s=100, clock=lambda: now[0])
    for i in range(3):
        await store.put(stored(f"resp_{i}"))
        now[0] += 1
    assert store.count() == 2
    assert await store.get("resp_0") is None
    now[0] += 1000
    await store.put(stored("resp_new"))
    assert store.count() == 1


WRITER = """
import sys, trio
from proto_server.server.store import SQLiteStore
sys.path.insert(0, {tests!r})
from test_store import stored

async def main():
    store = SQLiteStore({path!r})
    i = 0
    while True:
        await store.put(stored(f"resp_{{i}}", text="x" * 20000))
        print(i, flush=True)
        i += 1

trio.run(main)
"""


def write_until_killed(path: Path) -> int:
    """Run a writer process, SIGKILL it mid-stream; return the last write it confirmed."""
    code = WRITER.format(path=str(path), tests=str(Path(__file__).parent))
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    for line in writer.stdout:
        if int(line) >= 20:
            break
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    return int(line)


async def test_a_crash_in_the_middle_of_writes_corrupts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    confirmed = await trio.to_thread.run_sync(write_until_killed, path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    store = SQLiteStore(path)
    assert store.count() >= confirmed + 1
    for i in range(confirmed + 1):
        again = await store.get(f"resp_{i}")
        assert (
            again is not None
            and again.response.output == stored("x", text="x" * 20000).response.output
        )


@pytest.mark.parametrize("bad", ["/proc/no/such/dir/x.sqlite3"])
def test_an_unusable_path_fails_loudly(bad: str) -> None:
    with pytest.raises(sqlite3.OperationalError):
        SQLiteStore(bad)
