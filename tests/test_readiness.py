"""`/readyz` against `/healthz`: ready only while the store answers and the server is not
shutting down; a draining server says so at once yet still accepts for `drain_delay_s`."""

from __future__ import annotations

import signal
import subprocess
import sys
from functools import partial

import httpx
import pytest
import trio

from .helpers import CheckpointStore, StartServer, read_line


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
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    delay = 3.0
    running = await start_server(drain_delay_s=delay, shutdown_grace_s=1)
    root = running.address.http_url.removesuffix("/v1")
    with trio.fail_after(15):
        async with httpx.AsyncClient(base_url=root) as http:
            assert (await http.get("/readyz")).status_code == 200
            started = trio.current_time()
            stopped = trio.Event()

            async def stop() -> None:
                await running.server.shutdown()
                stopped.set()

            nursery.start_soon(stop)
            await trio.sleep(0.1)
            unready = await http.get("/readyz")
        # a new connection is still accepted and served while the delay lasts
        async with httpx.AsyncClient(base_url=root) as fresh:
            served = await fresh.post("/v1/responses", json={"model": "m", "input": "hi"})
            alive = await fresh.get("/healthz")
        assert not stopped.is_set()  # served while the delay lasted
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
