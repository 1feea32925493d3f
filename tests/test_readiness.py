"""`/readyz` against `/healthz`: ready only while the store answers and the server is not
shutting down; a draining server says so at once yet still accepts for `drain_delay_s`."""

from __future__ import annotations

import httpx
import pytest
import trio

from .conftest import CheckpointStore, StartServer


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
    delay = 1.5
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
        assert trio.current_time() - started < delay
        await stopped.wait()
        assert trio.current_time() - started >= delay
        with pytest.raises(OSError):  # the port is closed now
            await trio.open_tcp_stream(running.address.host, running.address.port)
    assert unready.status_code == 503
    assert unready.json()["error"]["code"] == "server_shutting_down"
    assert served.status_code == 200 and served.json()["status"] == "completed"
    assert alive.status_code == 200
