"""A store that cannot answer ends the Response, never the connection (finding 7 of issue 10).

The store file is write-locked by another process (`BEGIN EXCLUSIVE`): reads do not wait
behind a write waiting for the lock; with a store timeout of 2 s, a `store: true` Response ends
with `response.failed` (`store_unavailable`), an SSE stream ends with that terminal event,
`store: false` traffic goes on, and once the lock is gone the store works again by itself. The
store is given 2 s only while its writes are to fail: a call that can succeed has all the time
a busy machine needs (`ANSWERING_S`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proto_server.server.store import (
    PUT_FAILED,
    SQLiteStore,
    StoredResponse,
    StoreRetention,
    StoreUnavailable,
)
from proto_server.testing.checker import StreamChecker, o200k_count

from ..support.clients import END, connect, sse, turn
from ..support.frames import answers, body, create, forged, launched_create
from ..support.servers import StartServer, serve_process
from ..support.stores import ANSWERING_S, Locker, timing_out, write_under_way

TEXT = {"segments": [{"text": "Done."}]}


async def locked_store_server(
    start_server: StartServer, tmp_path: Path
) -> tuple[str, str, SQLiteStore]:
    path = tmp_path / "responses.sqlite3"
    store = SQLiteStore(path, retention=StoreRetention(timeout_s=ANSWERING_S))
    running = await start_server(TEXT, store=store)
    return running.address.ws_url, running.address.http_url, store


async def test_a_locked_store_fails_the_websocket_response_not_the_connection(
    start_server: StartServer, tmp_path: Path
) -> None:
    ws_url, http_url, store = await locked_store_server(start_server, tmp_path)
    with trio.fail_after(30):
        async with connect(ws_url) as client, httpx.AsyncClient() as http:
            kept = await turn(client, launched_create(store=True, tools=[]))
            assert kept[-1]["type"] == "response.completed"
            kept_url = f"{http_url}/responses/{kept[-1]['response']['id']}"
            assert (await http.get(kept_url)).status_code == 200  # its reader's process started
            with Locker(Path(store.path)):
                await client.send(launched_create(store=True, tools=[]))
                await write_under_way(store)  # its write now waits for the lock
                # the read does not queue behind the blocked write: it is answered while the
                # write still waits (the lock is held until this block ends)
                assert (await http.get(kept_url)).status_code == 200
            waited = await client.until("response.completed", "response.failed")
            assert waited[-1]["type"] == "response.completed"  # the lock gone, it was stored
            with Locker(Path(store.path)), timing_out(store, 2):
                failed = await turn(client, launched_create(store=True, tools=[]))
                assert failed[-1]["type"] == "response.failed"
                error = failed[-1]["response"]["error"]
                assert error["code"] == "store_unavailable"
                assert "store: false" in error["message"]
                # its output streamed; only the promise that it is stored is withdrawn
                assert failed[-1]["response"]["output"][0]["content"][0]["text"] == "Done."
                unstored = await turn(client, launched_create(store=False, tools=[]))
                assert unstored[-1]["type"] == "response.completed"
            # the lock is gone: the same connection stores again
            again = await turn(client, launched_create(store=True, tools=[]))
            assert again[-1]["type"] == "response.completed"
            failed_id = failed[-1]["response"]["id"]
            assert (await http.get(f"{http_url}/responses/{failed_id}")).status_code == 404
            again_id = again[-1]["response"]["id"]
            assert (await http.get(f"{http_url}/responses/{again_id}")).status_code == 200


async def test_a_locked_store_ends_an_sse_stream_with_response_failed(
    start_server: StartServer, tmp_path: Path
) -> None:
    _, http_url, store = await locked_store_server(start_server, tmp_path)
    with trio.fail_after(30):
        async with httpx.AsyncClient() as http:
            with Locker(Path(store.path)), timing_out(store, 2):
                events = await sse(http, f"{http_url}/responses", body(store=True, tools=[]))
                as_json = await http.post(f"{http_url}/responses", json=body(store=True))
                health = await http.get(f"{http_url.removesuffix('/v1')}/healthz")
            after = await http.post(f"{http_url}/responses", json=body(store=True))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "store_unavailable"
    assert as_json.status_code == 200 and as_json.json()["status"] == "failed"
    assert health.status_code == 200
    assert after.json()["status"] == "completed"


class UnreadableStore:
    """A store whose every lookup fails, as a broken disk would."""

    async def put(self, stored: StoredResponse) -> None:
        raise StoreUnavailable("The response store failed (disk I/O error), so it was lost.")

    async def get(self, response_id: str, *, owner: str = "") -> StoredResponse | None:
        raise StoreUnavailable(f"The response store failed, so {response_id!r} could not be read.")

    async def chain(self, response_id: str, *, owner: str = "") -> list[StoredResponse] | None:
        raise StoreUnavailable("The response store failed, so retry shortly.")

    async def aclose(self) -> None:
        pass


async def test_a_lookup_the_store_cannot_answer_is_refused_and_the_connection_lives(
    start_server: StartServer,
) -> None:
    running = await start_server(TEXT, store=UnreadableStore())
    http_url = running.address.http_url
    with trio.fail_after(10):
        async with connect(running.address.ws_url) as client:
            (refused,) = await turn(
                client, launched_create(store=True, previous_response_id="resp_x")
            )
            assert (refused["type"], refused["status"]) == ("error", 503)
            assert refused["error"]["code"] == "store_unavailable"
            served = await turn(client, launched_create(store=False, tools=[]))
            assert served[-1]["type"] == "response.completed"
        async with httpx.AsyncClient() as http:
            got = await http.get(f"{http_url}/responses/resp_x")
            chained = await http.post(
                f"{http_url}/responses", json=body(previous_response_id="resp_x")
            )
            health = await http.get(f"{http_url.removesuffix('/v1')}/healthz")
    assert (got.status_code, got.json()["error"]["code"]) == (503, "store_unavailable")
    assert (chained.status_code, chained.json()["error"]["code"]) == (503, "store_unavailable")
    assert health.status_code == 200
    assert running.server.crashed_connections == 0


class UnwritableStore(UnreadableStore):
    """A store whose every write fails, as one whose file another process holds locked: its
    lookups answer (they find nothing)."""

    async def put(self, stored: StoredResponse) -> None:
        raise StoreUnavailable(
            "The response store did not answer within 2 s (--store-timeout): another writer "
            f"holds its lock, so {PUT_FAILED}."
        )

    async def get(self, response_id: str, *, owner: str = "") -> StoredResponse | None:
        return None

    async def chain(self, response_id: str, *, owner: str = "") -> list[StoredResponse] | None:
        return None


def outcome(event: dict[str, Any]) -> tuple[str, str | None]:
    if event["type"] == "error":
        return "error", event["error"]["code"]
    error = event["response"]["error"]
    return event["type"], None if error is None else error["code"]


async def test_the_stream_checker_accepts_what_a_failing_store_makes_the_server_say(
    start_server: StartServer,
) -> None:
    """`response.failed` after a whole output, `store_unavailable` for a lookup, and a refused
    forged compaction item keep every invariant of the stream checker."""
    locked = await start_server(TEXT, store=UnwritableStore())
    unreadable = await start_server(TEXT, store=UnreadableStore())
    frames = [
        launched_create(store=True, tools=[]),
        launched_create(store=True, tools=[], previous_response_id="resp_x"),
        launched_create(store=False, tools=[], input=[forged()]),
        launched_create(store=False, tools=[]),
    ]
    expected = {
        "locked": ("previous_response_not_found", "resp_x is simply not there"),
        "unreadable": ("store_unavailable", "the lookup itself failed"),
    }
    with trio.fail_after(10):
        for name, running in (("locked", locked), ("unreadable", unreadable)):
            checker = StreamChecker(dialect="launched", count_tokens=o200k_count)
            outcomes = []
            async with connect(running.address.ws_url) as client:
                for frame in frames:
                    checker.sent(frame)
                    await client.send(frame)
                    events = await client.until(*END)
                    for event in events:
                        checker.received(event)
                    outcomes.append(outcome(events[-1]))
            checker.finish()
            assert outcomes == [
                ("response.failed", "store_unavailable"),
                ("error", expected[name][0]),
                ("error", "invalid_field"),
                ("response.completed", None),
            ], expected[name][1]


# -- a fault of the WAL index's mapping (the `-shm` file SQLite maps into memory) -------------

#: A call, then an answer: the Response suspends once, and its end is stored.
CALL_THEN_TEXT = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"text": "Done."},
    ]
}


async def exchange(client: Any, frame: dict[str, Any], *kinds: str) -> list[dict[str, Any]]:
    await client.send(frame)
    events: list[dict[str, Any]] = await client.until(*kinds, "error")
    return events


def chattr_works(directory: Path) -> bool:
    """Whether `chattr +i` works here (root, and a file system with the attribute)."""
    probe = directory / "probe"
    probe.touch()
    if shutil.which("chattr") is None or os.geteuid() != 0:
        return False
    made = subprocess.run(["chattr", "+i", probe], capture_output=True).returncode == 0
    subprocess.run(["chattr", "-i", probe], capture_output=True)
    return made


@pytest.mark.parametrize("fault", ["immutable", "truncated"])
async def test_a_faulting_wal_index_fails_the_response_not_the_process(
    nursery: trio.Nursery, tmp_path: Path, fault: str
) -> None:
    """Made immutable (`chattr +i`) or truncated under its mapping, the `-shm` file makes the
    next access of its mapping a SIGBUS: only the store's connection process dies. The
    suspended Response fails `store_unavailable`; the server, a connection opened before and
    one opened after live on."""
    if fault == "immutable" and not chattr_works(tmp_path):
        pytest.skip("chattr +i needs root and a file system that has the attribute")
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps(CALL_THEN_TEXT))
    path = tmp_path / "s.sqlite3"
    shm = tmp_path / "s.sqlite3-shm"
    with trio.fail_after(60):
        process, url = await serve_process(nursery, str(path), script)
        try:
            async with connect(url) as client, connect(url) as other:
                suspended = await exchange(client, create(), "response.done")
                assert suspended[-1]["response"]["status"] == "in_progress"  # stored, waiting
                assert shm.stat().st_size > 0
                if fault == "immutable":
                    await trio.run_process(["chattr", "+i", shm])
                else:
                    os.truncate(shm, 0)
                append = {"type": "response.append", "input": answers(suspended)}
                ended = await exchange(client, append, "response.completed", "response.failed")
                assert ended[-1]["type"] == "response.failed"
                error = ended[-1]["response"]["error"]
                assert error["code"] == "store_unavailable", error
                assert "SIGBUS" in error["message"], error
                assert process.returncode is None  # the server lives
                # so do its connections: the one opened before, and a new one, whose
                # suspension a new connection process stores (or, while the file stays
                # immutable, leaves unstored: resumable on its connection only)
                served = await exchange(other, create(store=False), "response.done")
                assert served[-1]["response"]["error"] is None
                async with connect(url) as fresh:
                    served = await exchange(fresh, create(), "response.done")
                    assert served[-1]["response"]["error"] is None
                    append = {"type": "response.append", "input": answers(served)}
                    again = await exchange(fresh, append, "response.completed", "response.failed")
                    assert again[-1]["response"]["output"][-1]["content"][0]["text"] == "Done."
            assert process.returncode is None
        finally:
            with trio.CancelScope(shield=True):  # tmp_path must stay removable
                if fault == "immutable":
                    await trio.run_process(["chattr", "-i", shm], check=False)
                process.terminate()
                await process.wait()
