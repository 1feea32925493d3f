"""The test client and the suite's deadline: every wait ends, and says what it waited for."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected

from proto_server.testing.client import EventTimeout, connect_checked

from ..support.clients import connect
from ..support.deadline import under_deadline
from ..support.frames import THREE_SEGMENTS, create
from ..support.servers import StartServer
from ..support.stores import CheckpointStore


async def test_a_wait_for_an_event_that_never_comes_fails_naming_it(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(THREE_SEGMENTS, store=CheckpointStore())
    async with connect_checked(running.prototype_url) as client:
        await client.send(create())
        await client.segment()  # suspended: the server now waits for the client
        start = trio.current_time()
        with pytest.raises(EventTimeout, match=r"waited 10 s for response.completed; had \d+"):
            await client.until("response.completed")
        assert trio.current_time() - start == pytest.approx(10)
        await client.send({"type": "response.cancel"})
        await client.until("response.cancelled")


async def test_an_error_in_the_test_comes_out_as_itself(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(10), pytest.raises(KeyError, match="missing"):
        async with connect(running.prototype_url):
            raise KeyError("missing")


async def test_a_refused_handshake_raises_connection_rejected(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",))
    with trio.fail_after(10):
        with pytest.raises(ConnectionRejected) as refused:
            async with connect(running.prototype_url):
                pass
        assert refused.value.status_code == 401
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            await client.send(create())
            assert (await client.segment())[-1]["type"] == "response.done"


async def test_a_client_that_vanishes_leaves_the_server_nothing_to_wait_for(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(10):
        async with connect_checked(running.prototype_url) as client:
            await client.send(create())
            await client.segment()
            await client.vanish()  # no close frame; the checker is told the stream was cut
        await running.server.wait_idle()
    assert running.server.open_connections == 0


async def test_a_test_past_its_deadline_fails_saying_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def waits_forever() -> None:
        await trio.Event().wait()

    bounded = under_deadline(waits_forever, 30, "test_waits_forever")
    with pytest.raises(pytest.fail.Exception, match="test_waits_forever ran past its 30 s"):
        await bounded()
    assert trio.current_time() == pytest.approx(30)
