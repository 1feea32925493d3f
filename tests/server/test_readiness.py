"""`/readyz` against `/healthz`: ready only while the store answers and the server is not
shutting down; a draining server says so at once yet still accepts for `drain_delay_s`."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest
import trio
import trio.testing

from ..support.metrics import scrape
from ..support.servers import StartServer, read_line, serve_process
from ..support.stores import CheckpointStore


class DownStore(CheckpointStore):
    """A store whose database does not answer (a ProbedStore)."""

    def __init__(self) -> None:
        super().__init__()
        self.problem: str | None = "the database at 127.0.0.1:1 refused the connection"

    async def readiness(self) -> str | None:
        await trio.lowlevel.checkpoint()
        return self.problem


async def test_a_store_that_does_not_answer_makes_the_server_unready_not_dead(
    start_server: StartServer,
) -> None:
    store = DownStore()
    running = await start_server(store=store)
    root = running.address.http_url.removesuffix("/v1")
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=root) as http:
            unready, alive = await http.get("/readyz"), await http.get("/healthz")
            store.problem = None
            ready = await http.get("/readyz")
    assert unready.status_code == 503
    error = unready.json()["error"]
    assert error["code"] == "store_unavailable" and "refused the connection" in error["message"]
    assert alive.status_code == 200 and alive.json() == {"status": "ok"}
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


async def test_a_draining_server_is_unready_at_once_and_accepts_until_its_delay_is_over(
    start_server: StartServer, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """On the virtual clock: the delay lasts while a client is served, however slow the
    machine, and the port closes once it is over (a store without a thread, which the clock
    would jump past)."""
    delay = 3.0
    running = await start_server(drain_delay_s=delay, shutdown_grace_s=1, store=CheckpointStore())
    root = running.address.http_url.removesuffix("/v1")
    with trio.fail_after(15):
        async with httpx.AsyncClient(base_url=root) as http:
            assert (await http.get("/readyz")).status_code == 200
            started = trio.current_time()
            stopped = trio.Event()

            async def stop(task_status: trio.TaskStatus[None]) -> None:
                await running.server.shutdown(task_status=task_status)
                stopped.set()

            await nursery.start(stop)  # started once /readyz says 503
            unready = await http.get("/readyz")
        # a new connection is still accepted and served while the delay lasts
        async with httpx.AsyncClient(base_url=root) as fresh:
            served = await fresh.post("/v1/responses", json={"model": "m", "input": "hi"})
            alive = await fresh.get("/healthz")
        assert not stopped.is_set()  # served while the delay lasted
        assert trio.current_time() - started < delay
        await stopped.wait()
        assert trio.current_time() - started >= delay
        with pytest.raises(OSError):  # the port is closed now
            await trio.open_tcp_stream(running.address.host, running.address.port)
    assert unready.status_code == 503
    assert unready.json()["error"]["code"] == "server_shutting_down"
    assert served.status_code == 200 and served.json()["status"] == "completed"
    assert alive.status_code == 200


async def test_serve_drains_on_sigterm_and_a_second_signal_stops_it_at_once(
    nursery: trio.Nursery,
) -> None:
    """`--drain-delay`: after SIGTERM `/readyz` is 503 and the port still open; a second signal
    during the delay does not wait it out."""
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:",
               "--drain-delay", "60"]  # fmt: skip
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    check=False)
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        root = (await read_line(process.stdout)).split("listening on ")[1].split(" ")[0]
        root = root.removesuffix("/v1")
        async with httpx.AsyncClient(base_url=root, timeout=5) as http:
            assert (await http.get("/readyz")).status_code == 200
            process.send_signal(signal.SIGTERM)
            err = await read_line(process.stderr)
            unready = await http.get("/readyz")
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0  # within the deadline: the 60 s delay is not waited out
    assert "SIGTERM, stopping: no new connections after 60 s, not ready meanwhile" in err
    assert unready.status_code == 503
    assert unready.json()["error"]["code"] == "server_shutting_down"


@pytest.mark.parametrize("change", ["deleted", "replaced"])
async def test_a_store_file_deleted_or_replaced_under_the_server_makes_it_unready(
    nursery: trio.Nursery, tmp_path: Path, change: str
) -> None:
    """The file at `--store` is no longer the one the server has open: the next `/readyz`
    says 503 naming the file, the log says so once, `/metrics` shows it, and a write fails
    `store_unavailable` instead of landing in a file a restart would not find."""
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps({"segments": [{"text": "Done."}]}))
    path = tmp_path / "s.sqlite3"
    hi = {"model": "m", "input": "hi"}
    with trio.fail_after(60):
        process, url = await serve_process(nursery, str(path), script, stderr=subprocess.PIPE)
        root = url.split("/v1/")[0].replace("ws://", "http://", 1)
        try:
            async with httpx.AsyncClient(base_url=root, timeout=10) as http:
                assert (await http.get("/readyz")).status_code == 200
                kept = (await http.post("/v1/responses", json=hi)).json()
                assert kept["status"] == "completed"
                assert (await scrape(http, root))[("proto_server_store_file_lost", ())] == 0
                if change == "deleted":
                    path.unlink()
                else:
                    other = tmp_path / "other.sqlite3"
                    sqlite3.connect(other).close()
                    os.replace(other, path)
                unready, again = await http.get("/readyz"), await http.get("/readyz")
                refused = (await http.post("/v1/responses", json=hi)).json()
                looked_up = await http.get(f"/v1/responses/{kept['id']}")
                lost = (await scrape(http, root))[("proto_server_store_file_lost", ())]
                alive = await http.get("/healthz")
        finally:
            process.terminate()
            await process.wait()
        assert process.stderr is not None
        log = b""
        while chunk := await process.stderr.receive_some():
            log += chunk
    assert unready.status_code == again.status_code == 503
    error = unready.json()["error"]
    assert error["code"] == "store_unavailable"
    assert str(path) in error["message"] and change in error["message"], error
    assert refused["status"] == "failed"
    assert (
        refused["error"]["code"] == "store_unavailable" and str(path) in refused["error"]["message"]
    )
    assert looked_up.status_code == 503
    assert lost == 1
    assert alive.status_code == 200
    assert log.decode().count("store.file_lost") == 1, log.decode()
