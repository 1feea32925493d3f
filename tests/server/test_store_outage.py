"""A store that goes away under live WebSocket connections: every store call a frame or a
Response makes fails with `store_unavailable` on the lane that made it, and the connection, its
other lanes and their open Responses live on. On SQLite the outage is the file deleted; on
PostgreSQL the cluster stopped."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import attrs
import pytest
import trio

from proto_server.engine.simulated import TimingModel
from proto_server.server.store import SQLiteStore, StoreRetention
from proto_server.testing import WireClient

from ..support.clients import connect, until_lane
from ..support.frames import THREE_SEGMENTS, USER, answers, create, launched_create
from ..support.postgres import Cluster
from ..support.servers import Running, StartServer
from ..support.stores import ANSWERING_S, OpenStore

#: A call, then an answer: a prototype Response suspends once, then completes.
CALL_THEN_TEXT = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"text": "Done."},
    ]
}
#: How long a store call may take before it fails (--store-timeout) once the store is gone:
#: short, the outage is sure. Until then it has all the time a busy machine needs.
TIMEOUT_S = 1.0
END = ("response.done", "response.completed", "response.failed", "error")


@attrs.define
class Outage:
    """A store, and how to take it away (`down`): its calls are then given `TIMEOUT_S`."""

    store: Any
    take_away: Callable[[], Awaitable[None]]

    async def down(self) -> None:
        self.store.timeout_s = TIMEOUT_S
        await self.take_away()


@pytest.fixture
async def outage(request: pytest.FixtureRequest, open_store: OpenStore) -> AsyncIterator[Outage]:
    """Requested before `start_server`, it is closed after the server stopped."""
    store = await open_store(retention=StoreRetention(timeout_s=ANSWERING_S))
    if isinstance(store, SQLiteStore):

        async def delete() -> None:
            os.remove(store.path)

        yield Outage(store, delete)
        return
    cluster: Cluster = request.getfixturevalue("postgres")
    stopped = False

    async def stop() -> None:
        nonlocal stopped
        stopped = True
        await trio.to_thread.run_sync(cluster.stop)

    try:
        yield Outage(store, stop)
    finally:
        if stopped:  # the session's cluster serves the tests after this one
            await trio.to_thread.run_sync(cluster.start)


class Heard(logging.Handler):
    """Sets `said` once the server logs `message` (its record kept)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message
        self.said = trio.Event()
        self.record: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == self.message:
            self.record = record
            self.said.set()

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        logger = logging.getLogger("proto_server")
        logger.addHandler(self)
        try:
            yield
        finally:
            logger.removeHandler(self)


async def on_lane(client: WireClient, frame: dict[str, Any]) -> list[dict[str, Any]]:
    """Send `frame`; its lane's events up to the answer (none of another lane is expected
    meanwhile)."""
    await client.send(frame)
    events = await until_lane(client, frame.get("stream_id"), *END)
    assert all(event.get("stream_id") == frame.get("stream_id") for event in events), events
    return events


def append(segment: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The append that answers the calls of `segment` (a suspended Response's events)."""
    return {"type": "response.append", "input": answers(segment), **fields}


def refused_for_the_store(events: list[dict[str, Any]], lane: str | None) -> None:
    (event,) = events
    assert event["type"] == "error", event
    assert (event["status"], event["error"]["code"]) == (503, "store_unavailable"), event
    assert event.get("stream_id") == lane, event


def failed_for_the_store(events: list[dict[str, Any]], lane: str) -> dict[str, Any]:
    ended = events[-1]
    assert (ended["type"], ended["stream_id"]) == ("response.failed", lane), ended
    assert ended["response"]["error"]["code"] == "store_unavailable", ended
    return ended


async def prototype_lane_open(client: WireClient, lane: str) -> list[dict[str, Any]]:
    """A `store: false` Response suspended on `lane`: it needs no store to go on."""
    segment = await on_lane(client, create(stream_id=lane, store=False))
    assert segment[-1]["type"] == "response.done", segment[-1]
    return segment


async def to_the_end(client: WireClient, segment: list[dict[str, Any]], lane: str) -> Any:
    """The Response suspended on `lane` answered until it ends: its terminal event."""
    while segment[-1]["type"] == "response.done":
        segment = await on_lane(client, append(segment, stream_id=lane))
    return segment[-1]


async def still_served(client: WireClient, suspended: list[dict[str, Any]], lane: str) -> None:
    """The Response suspended on `lane` before the outage goes on to its end, and a new lane
    serves a whole rollout: the connection lost nothing."""
    ended = await to_the_end(client, suspended, lane)
    assert ended["type"] == "response.completed", ended
    assert ended["response"]["id"] == suspended[-1]["response"]["id"]
    fresh = await prototype_lane_open(client, "after")
    assert (await to_the_end(client, fresh, "after"))["type"] == "response.completed"


async def stored_suspension(running: Running) -> list[dict[str, Any]]:
    """A `store: true` Response suspended on a connection that then went away: its first
    segment's events (the suspension is in the store, no rollout holds it)."""
    async with connect(running.prototype_url) as first:
        suspended = await on_lane(first, create())
    await running.server.wait_idle()
    return suspended


# -- the prototype dialect: lookups a frame makes ----------------------------------------------


async def test_a_resume_by_id_the_store_cannot_answer_is_refused_on_its_lane(
    outage: Outage, start_server: StartServer
) -> None:
    """The append that resumes a stored suspension looks it up and claims it in the store:
    with the store gone it is `store_unavailable` on its lane, and the connection keeps the
    Response open on another lane."""
    running = await start_server(CALL_THEN_TEXT, store=outage.store)
    url = running.prototype_url
    with trio.fail_after(30):
        suspended = await stored_suspension(running)
        async with connect(url) as client:
            kept = await prototype_lane_open(client, "kept")
            await outage.down()
            rid = suspended[-1]["response"]["id"]
            resume = append(suspended, stream_id="resumed", response_id=rid)
            refused_for_the_store(await on_lane(client, resume), "resumed")
            await still_served(client, kept, "kept")
    assert running.server.crashed_connections == 0


async def test_an_item_reference_the_store_cannot_look_up_is_refused_on_its_lane(
    outage: Outage, start_server: StartServer
) -> None:
    """A create naming an item its conversation does not hold looks it up in the store."""
    running = await start_server(CALL_THEN_TEXT, store=outage.store)
    with trio.fail_after(30):
        async with connect(running.prototype_url) as client:
            kept = await prototype_lane_open(client, "kept")
            await outage.down()
            reference = {"type": "item_reference", "id": "msg_elsewhere"}
            frame = create(stream_id="referring", store=False, input=[USER, reference])
            refused_for_the_store(await on_lane(client, frame), "referring")
            await still_served(client, kept, "kept")
    assert running.server.crashed_connections == 0


# -- what a Response writes as it goes (the rollout's own task) ----------------------------------


async def test_a_prototype_response_the_store_cannot_keep_fails_on_its_lane(
    outage: Outage, start_server: StartServer
) -> None:
    """Its suspension cannot be stored: it stays resumable on this connection (a warning is
    logged, `response.done` says nothing of it); its end cannot be stored: it ends
    `response.failed` (`store_unavailable`) with its output, on its lane."""
    running = await start_server(CALL_THEN_TEXT, store=outage.store)
    with trio.fail_after(30):
        async with connect(running.prototype_url) as client:
            kept = await prototype_lane_open(client, "kept")
            await outage.down()
            suspended = await on_lane(client, create(stream_id="stored", store=True))
            done = suspended[-1]
            assert done["type"] == "response.done" and done["response"]["error"] is None, done
            ended = await on_lane(client, append(suspended, stream_id="stored"))
            failed = failed_for_the_store(ended, "stored")
            assert failed["response"]["output"][-1]["content"][0]["text"] == "Done."
            await still_served(client, kept, "kept")
    assert running.server.crashed_connections == 0


async def test_a_resumed_response_whose_store_goes_away_fails_and_its_connection_lives(
    outage: Outage, start_server: StartServer
) -> None:
    """Resumed by id on a second connection (claimed in the store) and suspended again, then
    the store goes: its end, which deletes the stored suspension, fails `store_unavailable`."""
    running = await start_server(THREE_SEGMENTS, store=outage.store)
    url = running.prototype_url
    with trio.fail_after(30):
        suspended = await stored_suspension(running)
        async with connect(url) as client:
            kept = await prototype_lane_open(client, "kept")
            rid = suspended[-1]["response"]["id"]
            again = await on_lane(client, append(suspended, stream_id="resumed", response_id=rid))
            assert again[-1]["type"] == "response.done", again[-1]
            await outage.down()
            failed_for_the_store(
                await on_lane(client, append(again, stream_id="resumed")), "resumed"
            )
            await still_served(client, kept, "kept")
    assert running.server.crashed_connections == 0


#: A call, then a long segment (seconds at `SLOW`) before the next.
LONG_SECOND_SEGMENT = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"text": "word " * 300, "tool_calls": [{"name": "exec_command", "arguments": {}}]},
        {"text": "Done."},
    ]
}
SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=100)


async def test_a_resumed_response_whose_client_vanishes_with_the_store_gone_ends_quietly(
    outage: Outage, start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Its connection gone mid-segment, a resumed Response lets its claim go; the store being
    gone too, the claim is kept (it lapses after --suspend-timeout), and that is logged: no
    other connection notices."""
    caplog.set_level(logging.WARNING, logger="proto_server")
    kept = Heard("response.claim_kept")
    running = await start_server(LONG_SECOND_SEGMENT, store=outage.store, timing=SLOW)
    url = running.prototype_url
    with trio.fail_after(30), kept.listening():
        suspended = await stored_suspension(running)
        async with connect(running.address.ws_url) as other:
            async with connect(url) as client:
                rid = suspended[-1]["response"]["id"]
                await client.send(append(suspended, response_id=rid))
                await client.until("response.in_progress")
                await outage.down()
                await client.vanish()
            await kept.said.wait()
            assert kept.record is not None and kept.record.response == rid
            served = await on_lane(other, launched_create(stream_id="other"))
            assert served[-1]["type"] == "response.completed", served[-1]
    assert running.server.crashed_connections == 0


# -- the launched dialect: a lane's turn --------------------------------------------------------


async def test_every_store_call_of_a_launched_turn_fails_on_its_lane_only(
    outage: Outage, start_server: StartServer
) -> None:
    """A referenced item and a previous Response looked up, a Response stored: each fails with
    `store_unavailable` on its own lane; a `store: false` turn on another lane is served."""
    running = await start_server({"segments": [{"text": "Done."}]}, store=outage.store)
    with trio.fail_after(30):
        async with connect(running.address.ws_url) as client:
            await outage.down()
            reference = {"type": "item_reference", "id": "msg_elsewhere"}
            frame = launched_create(stream_id="referring", input=[USER, reference], tools=[])
            refused_for_the_store(await on_lane(client, frame), "referring")
            frame = launched_create(stream_id="chained", store=True, previous_response_id="resp_x")
            refused_for_the_store(await on_lane(client, frame), "chained")
            stored = await on_lane(client, launched_create(stream_id="stored", store=True))
            failed_for_the_store(stored, "stored")
            served = await on_lane(client, launched_create(stream_id="other", tools=[]))
            assert served[-1]["type"] == "response.completed", served[-1]
    assert running.server.crashed_connections == 0


# -- the server's own use of the store ------------------------------------------------------------


async def test_shared_admission_admits_by_what_it_last_knew_while_the_store_is_gone(
    outage: Outage, start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The loads the processes share go through the store: while it is gone this process
    admits by the loads it last read (and says so), and its connections are served."""
    caplog.set_level(logging.WARNING, logger="proto_server")
    unknown = Heard("admission.loads_unknown")
    running = await start_server(
        {"segments": [{"text": "Done."}]},
        store=outage.store,
        kv_capacity_tokens=100_000,
        admission_shared=True,
        admission_sync_interval_s=0.05,
    )
    with trio.fail_after(30), unknown.listening():
        async with connect(running.address.ws_url) as client:
            await outage.down()
            await unknown.said.wait()
            served = await on_lane(client, launched_create(tools=[]))
            assert served[-1]["type"] == "response.completed", served[-1]
    assert running.server.crashed_connections == 0
