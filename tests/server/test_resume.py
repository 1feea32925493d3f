"""A suspended prototype Response survives its connection and its process: persisted at each
suspension, resumed by id (`response.append` with `response_id`) on a new connection, rebuilt
cold from the store, exactly once. The store's part on SQLite and PostgreSQL, the live part on
a server in the test, and on real `serve` processes (one SIGKILLed, another on its store)."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proto_server.engine.simulated import TimingModel
from proto_server.server.process.config import MiB
from proto_server.server.rollouts import resume
from proto_server.server.store import (
    SQLiteStore,
    StoredResponse,
    SuspendedResponse,
    SuspensionLost,
    SuspensionStore,
)
from proto_server.server.store.postgres import PostgresStore
from proto_server.testing import WireClient
from proto_server.testing.checker import StreamChecker, o200k_count
from proto_server.wire.items import FunctionCall, Message
from proto_server.wire.response import Response, Usage

from ..support.clients import connect
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS, answers, create
from ..support.servers import StartServer, serve_process
from ..support.stores import stored

# -- the store ------------------------------------------------------------------------------


def suspension(response_id: str, items: int, *, pending: tuple[str, ...] = ("call_1",)) -> Any:
    calls = tuple(
        FunctionCall(id=f"fc_{c}", call_id=c, name="exec", arguments="{}", status="completed")
        for c in pending
    )
    history = tuple(Message(role="user", content=f"item {i}") for i in range(items - len(calls)))
    return SuspendedResponse(
        response=Response(
            id=response_id, created_at=0, status="in_progress", model="m",
            usage=Usage(input_tokens=10, output_tokens=3, total_tokens=13),
        ),
        items=history + calls,
        first_output=1,
        instructions="be brief",
        pending=pending,
        segments=1,
        tool_calls=len(calls),
        owner="key:a",
    )  # fmt: skip


async def test_a_suspension_comes_back_whole_and_each_write_adds_only_its_new_items(
    store: Any,
) -> None:
    assert isinstance(store, SuspensionStore)
    first = suspension("resp_a", 3)
    await store.suspend(first, since=0, expected=0)
    got = await store.suspended("resp_a", owner="key:a")
    assert got is not None and (got.version, got.claimed) == (1, False)
    assert got.items == first.items and got.pending == ("call_1",)
    assert got.response.usage == first.response.usage and got.instructions == "be brief"
    # the next suspension: two more items; only they are sent, the whole comes back
    later = suspension("resp_a", 5, pending=("call_2",))
    await store.suspend(later, since=3, expected=1)
    got = await store.suspended("resp_a", owner="key:a")
    assert got is not None and got.version == 2
    assert got.items == first.items + later.items[3:] and got.pending == ("call_2",)
    # another owner finds nothing
    assert await store.suspended("resp_a", owner="key:b") is None


async def test_a_claim_whose_holder_went_silent_lapses_and_is_taken_over(store: Any) -> None:
    """A resumed Response whose process died mid-segment never suspends again nor ends: its
    claim lapses (the caller says before when: --suspend-timeout ago), and the next resume
    takes it over; the old holder, if it lives after all, is fenced off at its next write."""
    await store.suspend(suspension("resp_l", 2), since=0, expected=0)
    assert await store.claim("resp_l", owner="key:a", version=1)  # stamped now
    recent = time.time() - 60  # a claim taken within the last minute has not lapsed
    assert not await store.claim("resp_l", owner="key:a", version=2, lapsed_before=recent)
    lapsed = time.time() + 1  # every claim taken before this has
    assert await store.claim("resp_l", owner="key:a", version=2, lapsed_before=lapsed)
    got = await store.suspended("resp_l", owner="key:a")
    assert got is not None and (got.version, got.claimed) == (3, True)
    with pytest.raises(SuspensionLost):  # the silent holder wrote at version 2
        await store.suspend(suspension("resp_l", 4), since=2, expected=2)


async def test_of_two_racing_claims_one_wins_and_a_stale_writer_is_fenced_off(store: Any) -> None:
    await store.suspend(suspension("resp_b", 2), since=0, expected=0)
    results: list[bool] = []

    async def claim() -> None:
        results.append(await store.claim("resp_b", owner="key:a", version=1))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(claim)
    assert sorted(results) == [False, False, False, True]
    got = await store.suspended("resp_b", owner="key:a")
    assert got is not None and (got.version, got.claimed) == (2, True)
    assert not await store.claim("resp_b", owner="key:a", version=2)  # claimed: nobody else
    # the copy that wrote version 1 (its connection still open) is fenced off, both ways
    with pytest.raises(SuspensionLost):
        await store.suspend(suspension("resp_b", 4), since=2, expected=1)
    ended = StoredResponse(response=suspension("resp_b", 2).response, items=(), owner="key:a")
    with pytest.raises(SuspensionLost):
        await store.put(ended, ends_suspension=1)
    assert await store.get("resp_b", owner="key:a") is None  # nothing of it was written
    # the holder lets its claim go (its connection went away): it can be claimed again
    await store.release("resp_b", version=2)
    assert await store.claim("resp_b", owner="key:a", version=2)
    # and the holder ends it: stored as ended, the suspension gone in the same transaction
    await store.put(ended, ends_suspension=3)
    assert await store.suspended("resp_b", owner="key:a") is None
    assert await store.get("resp_b", owner="key:a") is not None


@pytest.mark.postgres
async def test_claims_are_exactly_once_across_stores_of_separate_processes(
    pg_url: str,
) -> None:
    """Two PostgresStores (two pools, as two processes have) race for one suspension."""
    stores = [await trio.to_thread.run_sync(PostgresStore, pg_url) for _ in range(2)]
    try:
        for round_ in range(10):
            rid = f"resp_race_{round_}"
            await stores[0].suspend(suspension(rid, 2), since=0, expected=0)
            won: list[bool] = []

            async def claim(store: PostgresStore, rid: str, won: list[bool]) -> None:
                won.append(await store.claim(rid, owner="key:a", version=1))

            async with trio.open_nursery() as nursery:
                for one in stores * 2:
                    nursery.start_soon(claim, one, rid, won)
            assert sorted(won) == [False, False, False, True], round_
    finally:
        for one in stores:
            await one.aclose()


async def test_a_file_from_before_suspensions_is_migrated_and_keeps_its_responses(
    tmp_path: Path,
) -> None:
    """A file at user_version 1 (as the servers before this one left it) gains the suspension
    tables when opened; what it stored stays."""
    from proto_server.server.store import sqlite as sqlite_module

    path = tmp_path / "v1.sqlite3"
    db = sqlite3.connect(path)
    for statement in sqlite_module._SCHEMA:
        db.execute(statement)
    db.execute(sqlite_module._MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    old = SQLiteStore(path)
    await old.put(stored("resp_old"))
    await old.aclose()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE suspended")
    db.execute("DROP TABLE suspended_items")
    db.execute("DROP TABLE response_items")  # a version 1 file had none of the later tables
    db.execute("DROP TABLE admission_peers")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    migrated = SQLiteStore(path)
    assert await migrated.get("resp_old") is not None
    await migrated.suspend(suspension("resp_s", 2), since=0, expected=0)
    assert await migrated.suspended("resp_s", owner="key:a") is not None
    await migrated.aclose()


@pytest.mark.postgres
async def test_a_database_from_before_suspensions_is_migrated_and_keeps_its_secret(
    pg_url: str,
) -> None:
    """A database at schema version 3 gains the suspension tables at start-up (and the item
    index and the processes' loads after them: version 10)."""
    import psycopg

    from proto_server.server.store import postgres

    url = pg_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE proto_server_schema (version integer NOT NULL)")
        for statement in postgres._MIGRATIONS[:3]:
            conn.execute(statement)
        conn.execute("INSERT INTO proto_server_schema VALUES (3)")
        conn.execute("INSERT INTO proto_server_secret VALUES (1, %s)", (b"s" * 32,))
    store = await trio.to_thread.run_sync(PostgresStore, url)
    try:
        await store.put(stored("resp_old"))
        await store.suspend(suspension("resp_s", 2), since=0, expected=0)
        assert await store.suspended("resp_s", owner="key:a") is not None
        assert store.secret == b"s" * 32
    finally:
        await store.aclose()
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version FROM proto_server_schema").fetchone()
    assert row == (postgres.SCHEMA_VERSION,) == (10,)


# -- live: a connection that drops ----------------------------------------------------------


def checked(response: dict[str, Any] | None = None) -> StreamChecker:
    checker = StreamChecker(dialect="prototype", count_tokens=o200k_count)
    if response is not None:
        checker.resuming(response)
    return checker


async def exchange(client: WireClient, checker: StreamChecker, frame: dict[str, Any]) -> list[Any]:
    checker.sent(frame)
    await client.send(frame)
    events = await client.segment()
    for event in events:
        checker.received(event)
    return events


class StoppedWall:
    """The wall clock claims are stamped with (the store's) and judged by (resume.py's),
    stopped: a claim is as old as the test makes it, however slow the machine is meanwhile."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


async def test_a_resumed_response_whose_holder_died_is_resumed_again_once_its_claim_lapses(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process that resumed a Response dies mid-segment (played here by a claim that no
    server holds): the next resume is refused while the claim is fresh, and takes it over once
    --suspend-timeout has passed since the claim."""
    wall = StoppedWall()
    monkeypatch.setattr(resume, "time", wall)
    store = SQLiteStore(tmp_path / "s.sqlite3", clock=wall.time)
    running = await start_server(THREE_SEGMENTS, store=store, suspend_timeout_s=60)
    url = running.prototype_url
    with trio.fail_after(20):
        first = checked()
        async with connect(url) as client:
            events = await exchange(client, first, create())
            await client.vanish()
        done = events[-1]["response"]
        rid, outputs = done["id"], answers(events)
        await running.server.wait_idle()
        found = await store.suspended(rid)
        assert found is not None
        assert await store.claim(rid, owner=found.owner, version=found.version)  # it died
        wall.now += 60  # as old as --suspend-timeout: still fresh
        frame = {"type": "response.append", "response_id": rid, "input": outputs}
        async with connect(url) as client:
            refused = await exchange(client, checked(done), frame)
        assert refused[-1]["error"]["code"] == "response_already_resumed"
        assert "--suspend-timeout" in refused[-1]["error"]["message"]
        wall.now += 1  # past the timeout since the claim: it has lapsed
        again = checked(done)
        async with connect(url) as client:
            resumed = await exchange(client, again, frame)
            assert resumed[0]["type"] == "response.in_progress", resumed[-1]
            assert resumed[-1]["type"] == "response.done"
            final = await exchange(
                client, again, {"type": "response.append", "input": answers(resumed)}
            )
        assert final[-1]["type"] == "response.completed" and final[-1]["response"]["id"] == rid
        again.finish()


async def test_a_dropped_connection_resumes_by_id_on_a_new_one_cold_and_exactly_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    # the winner's next segment takes a while (0.1 s a token): the loser must find the
    # suspension claimed, not already suspended again past the outputs it brings
    slow = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10)
    store = SQLiteStore(tmp_path / "s.sqlite3")
    running = await start_server(THREE_SEGMENTS, store=store, timing=slow)
    url = running.prototype_url
    with trio.fail_after(30):
        first = checked()
        async with connect(url) as client:
            events = await exchange(client, first, create())
            assert events[-1]["type"] == "response.done"
            await client.vanish()  # the TCP goes, with no close frame
        done = events[-1]["response"]
        rid, outputs = done["id"], answers(events)
        first.finish(closed=True)
        # the first Response's connection is gone: the server let go of its rollout
        with trio.fail_after(5):
            await running.server.wait_idle()

        # two new connections race to resume it: exactly one wins
        results: dict[str, list[dict[str, Any]]] = {}
        checkers: dict[str, StreamChecker] = {}

        async def resume(name: str, client: WireClient) -> None:
            checkers[name] = checked(done)
            frame = {"type": "response.append", "response_id": rid, "input": outputs}
            results[name] = await exchange(client, checkers[name], frame)

        async with connect(url) as one, connect(url) as two:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(resume, "one", one)
                nursery.start_soon(resume, "two", two)
            ends = sorted(results[name][-1]["type"] for name in results)
            assert ends == ["error", "response.done"], ends
            winner = next(n for n in results if results[n][-1]["type"] == "response.done")
            loser = "two" if winner == "one" else "one"
            refusal = results[loser][-1]
            assert refusal["error"]["code"] == "response_already_resumed", refusal
            assert refusal["status"] == 409 and refusal["sequence_number"] == 0
            resumed = results[winner]
            # the same Response, its events numbered from 0 on the new connection, its output
            # indices going on from the first connection's
            assert resumed[0]["type"] == "response.in_progress"
            assert resumed[0]["sequence_number"] == 0 and resumed[0]["response"]["id"] == rid
            indices = sorted({e["output_index"] for e in resumed if "output_index" in e})
            assert indices[0] == len(done["output"]), (indices, done["output"])
            # cold: the whole prompt was read again, and none of it counts as cached
            usage, before = resumed[-1]["response"]["usage"], done["usage"]
            segment = usage["input_tokens"] - before["input_tokens"]
            assert segment > before["input_tokens"]
            assert usage["input_tokens_details"]["cached_tokens"] == 0
            # the rest of the rollout runs warm on the winner's connection
            client = one if winner == "one" else two
            frame = {"type": "response.append", "input": answers(resumed)}
            final = await exchange(client, checkers[winner], frame)
            assert final[-1]["type"] == "response.completed"
            assert final[-1]["response"]["id"] == rid
            for checker in checkers.values():
                checker.finish()
    assert [t.source for t in running.server.responses.turns if t.response_id == rid] == ["store"]
    async with httpx.AsyncClient(timeout=5) as http:
        got = await http.get(f"{running.address.http_url}/responses/{rid}")
    assert got.status_code == 200 and got.json()["status"] == "completed"
    kinds = [item["type"] for item in got.json()["output"]]
    assert kinds == ["message", "function_call", "function_call", "function_call", "message"]


async def test_a_resume_that_cannot_be_served_is_a_typed_error_and_changes_nothing(
    start_server: StartServer, tmp_path: Path
) -> None:
    running = await start_server(THREE_SEGMENTS, store=SQLiteStore(tmp_path / "s.sqlite3"))
    url = running.prototype_url
    with trio.fail_after(20):
        async with connect(url) as client:
            events = await exchange(client, checked(), create())
        done = events[-1]["response"]
        rid = done["id"]
        with trio.fail_after(5):
            await running.server.wait_idle()
        async with connect(url) as client:
            checker = checked(done)
            wrong = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
            refused = await exchange(
                client, checker, {"type": "response.append", "response_id": rid, "input": wrong}
            )
            assert refused[-1]["error"]["code"] == "unknown_call_id"
            unknown = await exchange(
                client, checker, {"type": "response.append", "response_id": "resp_nope",
                                    "input": answers(events)},
            )  # fmt: skip
            assert unknown[-1]["error"]["code"] == "response_not_found"
            # nothing changed: the right outputs resume it, to the end
            frame = {"type": "response.append", "response_id": rid, "input": answers(events)}
            resumed = await exchange(client, checker, frame)
            assert resumed[-1]["type"] == "response.done"
            final = await exchange(
                client, checker, {"type": "response.append", "input": answers(resumed)}
            )
            assert final[-1]["type"] == "response.completed"
            again = await exchange(client, checker, frame)
            assert again[-1]["error"]["code"] == "response_already_completed"
            checker.finish()


async def test_a_resume_whose_append_does_not_fit_frees_its_rollout_and_stays_resumable(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The rebuilt history fits the connection's budget, the append does not: refused with
    `connection_memory_limit`, and nothing is kept: no rollout left open (the server goes
    idle), the claim let go, so the right append resumes it after."""
    running = await start_server(
        THREE_SEGMENTS, store=SQLiteStore(tmp_path / "s.sqlite3"), max_connection_memory_bytes=MiB
    )
    url = running.prototype_url
    with trio.fail_after(20):
        async with connect(url) as client:
            events = await exchange(client, checked(), create())
        done = events[-1]["response"]
        await running.server.wait_idle()
        async with connect(url) as client:
            checker = checked(done)
            (call_id,) = [a["call_id"] for a in answers(events)]
            big = [{"type": "function_call_output", "call_id": call_id, "output": "x " * 400_000}]
            frame = {"type": "response.append", "response_id": done["id"], "input": big}
            refused = await exchange(client, checker, frame)
            assert refused[-1]["error"]["code"] == "connection_memory_limit"
        await running.server.wait_idle()  # the rebuilt rollout was closed, not left open
        async with connect(url) as client:
            frame = {"type": "response.append", "response_id": done["id"], "input": answers(events)}
            resumed = await exchange(client, checked(done), frame)
            assert resumed[-1]["type"] == "response.done"


async def test_store_false_and_another_key_cannot_resume(
    start_server: StartServer, tmp_path: Path
) -> None:
    running = await start_server(
        THREE_SEGMENTS, store=SQLiteStore(tmp_path / "s.sqlite3"), api_keys=("sk-a", "sk-b")
    )
    url = running.prototype_url
    with trio.fail_after(20):
        for store, key, code in ((False, "sk-a", "response_not_found"),
                                 (True, "sk-b", "response_not_found")):  # fmt: skip
            async with connect(url, authorization="Bearer sk-a") as client:
                events = await exchange(client, checked(), create(store=store))
            async with connect(url, authorization=f"Bearer {key}") as client:
                frame = {"type": "response.append", "response_id": events[-1]["response"]["id"],
                         "input": answers(events)}  # fmt: skip
                refused = await exchange(client, checked(), frame)
            assert refused[-1]["error"]["code"] == code, refused[-1]


# -- real processes: one SIGKILLed, the next on its store -----------------------------------


POSTGRESQL = pytest.param("postgresql", marks=pytest.mark.postgres)


@pytest.mark.parametrize("backend", ["sqlite", POSTGRESQL])
async def test_a_suspended_response_survives_a_sigkilled_process(
    nursery: trio.Nursery, tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps(THREE_SEGMENTS))
    sqlite = str(tmp_path / "s.sqlite3")
    store = sqlite if backend == "sqlite" else request.getfixturevalue("pg_url")
    with trio.fail_after(60):
        victim, url = await serve_process(nursery, store, script)
        first = checked()
        async with connect(url) as client:
            events = await exchange(client, first, create())
            assert events[-1]["type"] == "response.done"
            victim.send_signal(signal.SIGKILL)
            assert await victim.wait() == -signal.SIGKILL
        first.finish(closed=True)
        done = events[-1]["response"]
        heir, url = await serve_process(nursery, store, script)
        checker = checked(done)
        async with connect(url) as client:
            frame = {"type": "response.append", "response_id": done["id"], "input": answers(events)}
            resumed = await exchange(client, checker, frame)
            assert resumed[0]["sequence_number"] == 0 and resumed[-1]["type"] == "response.done"
            final = await exchange(
                client, checker, {"type": "response.append", "input": answers(resumed)}
            )
        checker.finish()
        assert final[-1]["type"] == "response.completed"
        response = final[-1]["response"]
        assert response["id"] == done["id"]
        assert [item["id"] for item in response["output"][: len(done["output"])]] == [
            item["id"] for item in done["output"]
        ]
        assert len(response["output"]) == 5
        heir.send_signal(signal.SIGTERM)
        assert await heir.wait() == 0


async def test_the_client_library_resumes_a_rollout_by_id_on_a_new_connection(
    start_server: StartServer, tmp_path: Path
) -> None:
    from proto_server.client import RolloutState
    from proto_server.client import connect as client_connect

    running = await start_server(THREE_SEGMENTS, store=SQLiteStore(tmp_path / "s.sqlite3"))
    url = running.address.http_url
    with trio.fail_after(20):
        async with client_connect(url, dialect="prototype") as connection:
            rollout = await connection.create("fix it", model="m", tools=[EXEC_COMMAND])
            await rollout.step()
            assert rollout.state is RolloutState.SUSPENDED
            rid, calls = rollout.response_id, rollout.pending_calls
            seen = len(rollout.output)
        await running.server.wait_idle()  # the connection closed: nothing of it stays warm
        async with client_connect(url, dialect="prototype") as connection:
            assert rid is not None
            resumed = await connection.resume(rid, {call.call_id: "ok" for call in calls})
            segment = await resumed.step()
            assert resumed.state is RolloutState.SUSPENDED and resumed.response_id == rid
            assert segment.cached_tokens == 0 and segment.input_tokens > 0
            first = segment.events[0].event
            assert first.type == "response.in_progress" and segment.events[0].sequence_number == 0
            assert len(resumed.response.output) == seen + 2  # type: ignore[union-attr]
            await resumed.append({call.call_id: "ok" for call in resumed.pending_calls})
            await resumed.step()
            assert resumed.state is RolloutState.COMPLETED and resumed.response_id == rid
            refused = await connection.resume(rid, {"call_x": "late"})
            await refused.step()
            assert refused.state is RolloutState.FAILED
            assert refused.tracker.error is not None
            assert refused.tracker.error.code == "response_already_completed"


async def test_a_copy_that_was_resumed_elsewhere_is_fenced_off_at_its_next_write(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The first connection was not dead after all: its copy goes on warm until it next
    writes, and then fails; only the resumed copy is stored."""
    running = await start_server(THREE_SEGMENTS, store=SQLiteStore(tmp_path / "s.sqlite3"))
    url = running.prototype_url
    with trio.fail_after(20):
        async with connect(url) as old, connect(url) as new:
            stale = checked()
            events = await exchange(old, stale, create())
            done = events[-1]["response"]
            moved = checked(done)
            frame = {"type": "response.append", "response_id": done["id"], "input": answers(events)}
            resumed = await exchange(new, moved, frame)
            assert resumed[-1]["type"] == "response.done"
            late = await exchange(old, stale, {"type": "response.append", "input": answers(events)})
            assert late[-1]["type"] == "response.failed", late[-1]
            assert late[-1]["response"]["error"]["code"] == "response_resumed_elsewhere"
            rest = {"type": "response.append", "input": answers(resumed)}
            final = await exchange(new, moved, rest)
            assert final[-1]["type"] == "response.completed"
            stale.finish()
            moved.finish()
    async with httpx.AsyncClient(timeout=5) as http:
        got = await http.get(f"{running.address.http_url}/responses/{done['id']}")
    assert got.json()["status"] == "completed"
    assert got.json()["output"] == final[-1]["response"]["output"]
