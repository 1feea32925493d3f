"""The persisted store: chains come back whole, retention is enforced, crashes corrupt nothing,
each response belongs to its owner, and a store that cannot answer says so in time."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import attrs
import orjson
import pytest
import trio

from proto_server.server.store import (
    SCHEMA_VERSION,
    SQLiteStore,
    StoreRetention,
    StoreUnavailable,
    owner_id,
    put_row,
    sqlite_host,
)
from proto_server.server.store import sqlite as sqlite_store
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError

from ..support.stores import (
    ANSWERING_S,
    Locker,
    identified,
    stored,
    timing_out,
    write_under_way,
    writer_free,
)

WRITER = """
import sys, trio
from proto_server.server.store import SQLiteStore
sys.path.insert(0, {tests!r})
from stores import stored

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
    code = WRITER.format(path=str(path), tests=str(Path(__file__).parents[1] / "support"))
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


OLD_SCHEMA = """
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    previous_response_id TEXT,
    created_at INTEGER NOT NULL,
    stored_at REAL NOT NULL,
    response BLOB NOT NULL,
    items BLOB NOT NULL
);
CREATE INDEX responses_stored_at ON responses (stored_at);
"""


async def test_a_file_from_before_owners_is_migrated_and_keeps_its_responses(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    old = stored("resp_old")
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute(
        "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
        ("resp_old", None, 0, 1e12, orjson.dumps(converter.unstructure(old.response)),
         orjson.dumps(converter.unstructure(old.items))),
    )  # fmt: skip
    db.commit()
    db.close()
    store = SQLiteStore(path)
    # what was stored before keys were tenants belongs to the anonymous owner
    assert await store.get("resp_old") == old
    assert await store.get("resp_old", owner=owner_id("k1")) is None
    await store.put(attrs.evolve(stored("resp_new", "resp_old")))
    assert store.count() == 2
    await store.aclose()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    db.close()
    SQLiteStore(path)  # and a migrated file opens again as it is


def test_a_file_from_a_newer_server_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    SQLiteStore(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(sqlite3.DatabaseError, match="newer proto-server"):
        SQLiteStore(path)


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_responses", 0), ("max_responses", -3), ("max_age_s", -1.0), ("max_age_s", 0.0),
     ("timeout_s", 0.0), ("timeout_s", float("inf"))],
)  # fmt: skip
def test_limits_that_would_delete_or_hang_are_refused(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        StoreRetention(**{option: value})  # type: ignore[arg-type]


async def test_a_locked_store_fails_writes_in_time_and_reads_do_not_wait(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SQLiteStore(path, retention=StoreRetention(timeout_s=ANSWERING_S))
    await store.put(stored("resp_1"))
    assert await store.get("resp_1") is not None  # its reader's process is started
    with trio.fail_after(20):
        with Locker(path), timing_out(store, 2):
            with pytest.raises(StoreUnavailable, match=r"did not answer within 2 s"):
                await store.put(stored("resp_2"))
            # SQLite itself gives up, by the call's deadline: its thread gives the writer back
            # while the lock is still held, so no thread is left behind waiting for it
            await writer_free(store)
        # the lock is gone: the store recovers by itself
        await store.put(stored("resp_3"))
        assert await store.get("resp_3") is not None
        # reads do not queue behind a write waiting for the lock, however long it waits
        written = trio.Event()

        async def blocked_write() -> None:
            await store.put(stored("resp_4"))
            written.set()

        async with trio.open_nursery() as nursery:
            with Locker(path):
                nursery.start_soon(blocked_write)
                await write_under_way(store)  # it now waits for the lock
                assert await store.get("resp_1") is not None
                assert await store.chain("resp_1") is not None
                assert not written.is_set()
            # the lock is gone: the write that waited for it lands
        assert await store.get("resp_4") is not None
        await store.aclose()


async def test_a_lock_sqlite_gives_up_on_is_said_to_be_another_writer_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where SQLite's refusal comes before the server stops waiting, the failure says why. It
    gives up a moment before the call's deadline, and on a busy machine may be late (its busy
    timeout counts the sleeps it asked for): here it is given 0.1 s of the 2, to come in time."""
    monkeypatch.setattr(sqlite_store, "_MARGIN_S", 1.9)
    path = tmp_path / "store.sqlite3"
    store = SQLiteStore(path, retention=StoreRetention(timeout_s=2))
    with trio.fail_after(20), Locker(path):
        lock = r"did not answer within 2 s \(--store-timeout\): another writer holds its lock"
        with pytest.raises(StoreUnavailable, match=lock):
            await store.put(stored("resp_1"))
    await store.aclose()


def test_a_write_that_comes_to_its_commit_past_its_deadline_is_rolled_back(tmp_path: Path) -> None:
    # SQLite's busy timeout counts the sleeps it asked for: on a busy machine it outwaits the
    # server, which has told the client by then that the write failed; so it must not land
    db = sqlite_host.connect(str(tmp_path / "s.sqlite3"), 2, writer=True)
    row = put_row(stored("resp_late"), 1.0)
    with pytest.raises(sqlite3.OperationalError, match="commit past its deadline") as late:
        sqlite_host.run(db, "put", time.monotonic() - 0.001, (row, [], None, 0.0, 10))
    assert late.value.sqlite_errorname == "SQLITE_BUSY"  # told as a lock held too long
    assert sqlite_host.run(db, "get", time.monotonic() + 2, ("resp_late", "")) is None
    sqlite_host.run(db, "put", time.monotonic() + 2, (row, [], None, 0.0, 10))
    assert sqlite_host.run(db, "get", time.monotonic() + 2, ("resp_late", "")) is not None
    db.close()


def test_a_claim_that_comes_to_its_commit_past_its_deadline_does_not_land(
    tmp_path: Path,
) -> None:
    db = sqlite_host.connect(str(tmp_path / "s.sqlite3"), 2, writer=True)
    soon = time.monotonic() + 2
    sqlite_host.run(db, "suspend", soon, ("resp_s", "", 1.0, b"{}", 0, 0, None, 0, 0.0, 10))
    with pytest.raises(sqlite3.OperationalError, match="commit past its deadline"):
        sqlite_host.run(db, "claim", time.monotonic() - 0.001, ("resp_s", "", 1, 2.0, 0.0))
    state = sqlite_host.run(db, "suspended", time.monotonic() + 2, ("resp_s", ""))
    assert state[1:3] == (1, False)  # its version and claim as before
    assert sqlite_host.run(db, "claim", time.monotonic() + 2, ("resp_s", "", 1, 2.0, 0.0))
    db.close()


async def test_a_failing_store_raises_its_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SQLiteStore(path)
    db = sqlite3.connect(path)
    db.execute("DROP TABLE responses")  # any sqlite3 failure, here a missing table
    db.close()
    with trio.fail_after(5):
        with pytest.raises(StoreUnavailable, match="failed") as failed:
            await store.put(stored("resp_1"))
        assert failed.value.detail.code == "store_unavailable"
        with pytest.raises(StoreUnavailable, match="retry shortly"):
            await store.get("resp_1")


async def test_a_pruned_response_takes_its_items_ids_with_it(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite3", retention=StoreRetention(max_responses=2))
    for i in range(3):
        await store.put(identified(f"resp_{i}"))
    assert list(await store.items(["a_resp_0", "a_resp_1", "a_resp_2"], owner="")) == [
        "a_resp_1", "a_resp_2",
    ]  # fmt: skip
    await store.aclose()
    db = sqlite3.connect(tmp_path / "s.sqlite3")
    assert db.execute("SELECT count(*) FROM response_items").fetchone() == (4,)
    db.close()


async def test_a_file_from_before_the_item_index_gets_its_items_ids(tmp_path: Path) -> None:
    path = tmp_path / "v4.sqlite3"
    old = SQLiteStore(path)
    await old.put(identified("resp_old"))
    await old.aclose()
    db = sqlite3.connect(path)  # as a version 4 file was: no index of item ids
    db.execute("DROP TABLE response_items")
    db.execute("DROP TABLE admission_peers")  # and none of what came after
    db.execute("PRAGMA user_version = 4")
    db.commit()
    db.close()
    migrated = SQLiteStore(path)
    assert list(await migrated.items(["a_resp_old", "q_resp_old"], owner="")) == [
        "a_resp_old", "q_resp_old",
    ]  # fmt: skip
    await migrated.aclose()


async def test_a_refused_lookup_gives_its_reader_back(tmp_path: Path) -> None:
    """A refusal is the store's answer, not its fault: the reader process that gave it is
    reused, so refused requests do not leave a process behind each."""
    store = SQLiteStore(tmp_path / "s.sqlite3")
    await store.put(identified("resp_0"))
    for _ in range(5):
        with pytest.raises(ProtocolError):
            await store.items(["a_resp_0"], owner="", max_bytes=1)
    assert len(store._all_readers) == 1
    assert await store.items(["a_resp_0"], owner="")
    assert len(store._all_readers) == 1
    await store.aclose()
