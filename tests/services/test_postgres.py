"""The PostgreSQL store against a real PostgreSQL: the same contract as the SQLite store, shared
by separate stores as separate processes would share it, and a database that goes away and
comes back; then two `proto-server serve` processes continuing each other's chains."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from functools import partial

import httpx
import psycopg
import pytest
import trio

from proto_server.server.store import (
    StoreError,
    StoreRetention,
    StoreUnavailable,
    put_row,
    sql,
)
from proto_server.server.store.postgres import SCHEMA_VERSION, PostgresStore, _Postgres

from ..support.clients import connect
from ..support.postgres import Cluster
from ..support.servers import read_line
from ..support.stores import identified, stored

pytestmark = pytest.mark.postgres


def test_a_write_that_comes_to_its_commit_past_its_deadline_is_rolled_back(pg_url: str) -> None:
    # the server has told the client by then that it failed: it must not land afterwards
    PostgresStore(pg_url)._pool.close()  # the schema is there
    row = put_row(stored("resp_late"), 1.0)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with pytest.raises(trio.TooSlowError):
            sql.put(_Postgres(conn, time.monotonic() - 0.001), row, [], None, 0.0, 10)
        assert sql.get(_Postgres(conn, time.monotonic() + 5), "resp_late", "") is None
        sql.put(_Postgres(conn, time.monotonic() + 5), row, [], None, 0.0, 10)
        assert sql.get(_Postgres(conn, time.monotonic() + 5), "resp_late", "") is not None


async def test_a_pruned_response_takes_its_items_ids_with_it(pg_url: str) -> None:
    store = PostgresStore(pg_url, retention=StoreRetention(max_responses=2))
    for i in range(3):
        await store.put(identified(f"resp_{i}"))
    found = await store.items(["a_resp_0", "a_resp_1", "a_resp_2"], owner="")
    assert sorted(found) == ["a_resp_1", "a_resp_2"]
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM proto_server_response_items").fetchone()
    assert row == (4,)
    await store.aclose()


async def test_a_database_from_before_the_item_index_gets_its_items_ids(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.put(identified("resp_old"))
    await store.aclose()
    with psycopg.connect(pg_url, autocommit=True) as conn:  # as a version 6 database was
        conn.execute("DROP TABLE proto_server_response_items")
        conn.execute("DROP TABLE proto_server_admission_peers")  # and none of what came after
        conn.execute("UPDATE proto_server_schema SET version = 6")
    migrated = await trio.to_thread.run_sync(PostgresStore, pg_url)
    found = await migrated.items(["a_resp_old", "q_resp_old"], owner="")
    assert sorted(found) == ["a_resp_old", "q_resp_old"]
    await migrated.aclose()


async def test_stores_of_two_processes_share_responses_schema_and_secret(pg_url: str) -> None:
    first, second = PostgresStore(pg_url), PostgresStore(pg_url)  # the second migrates nothing
    await first.put(stored("resp_1"))
    await second.put(stored("resp_2", "resp_1"))
    chain = await first.chain("resp_2")
    assert chain is not None and len(chain) == 2
    assert first.secret == second.secret and len(first.secret) == 32
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT version FROM proto_server_schema").fetchall() == [
            (SCHEMA_VERSION,)
        ]
        conn.execute("UPDATE proto_server_schema SET version = version + 1")
    with pytest.raises(StoreError, match="newer proto-server"):
        PostgresStore(pg_url)
    await first.aclose()
    await second.aclose()


async def test_a_database_that_goes_away_fails_in_time_and_is_used_again_when_back(
    pg_url: str, postgres: Cluster
) -> None:
    store = PostgresStore(pg_url, retention=StoreRetention(timeout_s=2.0))
    await store.put(stored("resp_1"))
    await trio.to_thread.run_sync(postgres.stop)
    try:
        with trio.fail_after(10):
            with pytest.raises(StoreUnavailable) as refused:
                await store.put(stored("resp_2", "resp_1"))
            with pytest.raises(StoreUnavailable):
                await store.get("resp_1")
        assert refused.value.detail.code == "store_unavailable"
        assert "store: false" in str(refused.value)
    finally:
        await trio.to_thread.run_sync(postgres.start)
    with trio.fail_after(20):  # the pool reconnects by itself
        for _ in range(100):
            try:
                await store.put(stored("resp_2", "resp_1"))
                break
            except StoreUnavailable:
                await trio.sleep(0.2)
    chain = await store.chain("resp_2")
    assert chain is not None and len(chain) == 2
    await store.aclose()


# -- two server processes on one database ---------------------------------------------------------


async def serve(nursery: trio.Nursery, pg_url: str, *flags: str) -> tuple[trio.Process, str]:
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", pg_url,
               "--store-timeout", "2", *flags]  # fmt: skip
    process: trio.Process = await nursery.start(
        partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
    )
    assert process.stdout is not None
    line = await read_line(process.stdout)
    return process, line.split("listening on ")[1].split(" ")[0]


@pytest.fixture
async def two_servers(nursery: trio.Nursery, pg_url: str) -> AsyncIterator[tuple[str, str]]:
    with trio.fail_after(60):
        (one, one_url), (two, two_url) = [await serve(nursery, pg_url) for _ in range(2)]
    yield one_url, two_url
    for process in (one, two):
        process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        assert [await process.wait() for process in (one, two)] == [0, 0]


async def test_servers_on_two_hosts_share_the_engines_room_through_the_database(
    nursery: trio.Nursery, pg_url: str
) -> None:
    """--admission-shared over PostgreSQL, as two hosts behind HAProxy run it: each server
    sees the other's load; one that stops withdraws, and the other has the room alone."""
    shared = ("--kv-capacity-tokens", "1000", "--admission-shared",
              "--admission-sync-interval", "0.1")  # fmt: skip

    async def peers(http: httpx.AsyncClient, url: str, count: int) -> None:
        for _ in range(300):
            metrics = (await http.get(url.removesuffix("/v1") + "/metrics")).text
            if f"proto_server_admission_peers {count:.1f}" in metrics:
                return
            await trio.sleep(0.1)
        raise AssertionError(f"{url} never saw {count} processes:\n{metrics}")

    with trio.fail_after(90):
        (one, one_url), (two, two_url) = [await serve(nursery, pg_url, *shared) for _ in "12"]
        async with httpx.AsyncClient(timeout=10) as http:
            await peers(http, one_url, 2)
            await peers(http, two_url, 2)
            one.send_signal(signal.SIGTERM)
            assert await one.wait() == 0
            with psycopg.connect(pg_url) as conn:  # it withdrew as it stopped: not left to lapse
                rows = conn.execute("SELECT count(*) FROM proto_server_admission_peers")
                assert rows.fetchone() == (1,)
            await peers(http, two_url, 1)
        two.send_signal(signal.SIGTERM)
        assert await two.wait() == 0


async def test_a_chain_started_on_one_process_continues_on_another(
    two_servers: tuple[str, str],
) -> None:
    one, two = two_servers
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(30):
            first = await http.post(
                f"{one}/responses", json={"model": "m", "input": "Remember the word teal."}
            )
            assert first.status_code == 200, first.text
            second = await http.post(
                f"{two}/responses",
                json={"model": "m", "input": "What was it?", "previous_response_id":
                      first.json()["id"]},
            )  # fmt: skip
            assert second.status_code == 200, second.text
            got = await http.get(f"{one}/responses/{second.json()['id']}")
    assert got.status_code == 200 and got.json()["id"] == second.json()["id"]
    # cold on the second process, and the whole history was there
    assert second.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
    ws_url = two.replace("http://", "ws://", 1) + "/responses"
    with trio.fail_after(30):
        async with connect(ws_url) as client:
            await client.send({"type": "response.create", "model": "m", "input": "Again?",
                               "previous_response_id": second.json()["id"]})  # fmt: skip
            events = await client.until("response.completed", "response.failed", "error")
    assert events[-1]["type"] == "response.completed", events[-1]
    assert events[-1]["response"]["previous_response_id"] == second.json()["id"]


@pytest.mark.slow
async def test_with_the_database_down_store_true_is_refused_and_store_false_served(
    two_servers: tuple[str, str], postgres: Cluster
) -> None:
    """A Response that cannot be stored fails with `store_unavailable` (its output still in it,
    as for any failure once generation began); a lookup is refused with a 503."""
    one, _ = two_servers
    async with httpx.AsyncClient(timeout=15) as http:
        with trio.fail_after(30):
            kept = await http.post(f"{one}/responses", json={"model": "m", "input": "hi"})
    await trio.to_thread.run_sync(postgres.stop)
    try:
        async with httpx.AsyncClient(timeout=15) as http:
            with trio.fail_after(30):
                served = await http.post(
                    f"{one}/responses", json={"model": "m", "input": "hi", "store": False}
                )
                failed = await http.post(f"{one}/responses", json={"model": "m", "input": "hi"})
                lookup = await http.get(f"{one}/responses/{kept.json()['id']}")
    finally:
        await trio.to_thread.run_sync(postgres.start)
    assert served.status_code == 200 and served.json()["status"] == "completed", served.text
    assert failed.json()["status"] == "failed", failed.text
    assert failed.json()["error"]["code"] == "store_unavailable"
    assert lookup.status_code == 503, lookup.text
    assert lookup.json()["error"]["code"] == "store_unavailable"
    async with httpx.AsyncClient(timeout=15) as http:
        with trio.fail_after(30):
            for _ in range(100):  # the pool reconnects by itself
                again = await http.post(f"{one}/responses", json={"model": "m", "input": "hi"})
                if again.json()["status"] != "failed":
                    break
                await trio.sleep(0.2)
    assert again.status_code == 200 and again.json()["status"] == "completed", again.text


async def test_readyz_says_store_unavailable_while_the_database_is_down(
    two_servers: tuple[str, str], postgres: Cluster
) -> None:
    """A balancer's check (`/readyz`) takes a process whose database is gone out of rotation;
    `/healthz` (liveness) still answers, and readiness comes back with the database."""
    root = two_servers[0].removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=10) as http:
        with trio.fail_after(10):
            assert (await http.get("/readyz")).status_code == 200
        await trio.to_thread.run_sync(postgres.stop)
        try:
            with trio.fail_after(10):
                started = trio.current_time()
                down = await http.get("/readyz")
                waited = trio.current_time() - started
                alive = await http.get("/healthz")
        finally:
            await trio.to_thread.run_sync(postgres.start)
        with trio.fail_after(30):
            for _ in range(100):  # the pool reconnects by itself
                back = await http.get("/readyz")
                if back.status_code == 200:
                    break
                await trio.sleep(0.2)
    assert down.status_code == 503, down.text
    assert down.json()["error"]["code"] == "store_unavailable"
    assert waited < 2 + 1  # PROBE_TIMEOUT_S (--store-timeout 2 here), not the balancer's patience
    assert alive.status_code == 200
    assert back.status_code == 200 and back.json() == {"status": "ready"}
