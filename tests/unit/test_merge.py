"""Merged deltas: a writer that falls behind sends the deltas that piled up as one frame."""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import orjson
import trio
import trio.lowlevel
import trio.testing

from proto_server.core.merge import merge_deltas
from proto_server.server.process.memory import MemoryBudget, MiB
from proto_server.server.process.offload import Offload
from proto_server.server.transport.connection import Connection
from proto_server.server.transport.outbox import Outbox, Outgoing
from proto_server.wire.events import (
    ClientEvent,
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    OutputTextDone,
    ServerEvent,
)
from proto_server.wire.items import Logprob


def text(delta: str, item: str = "msg_1", index: int = 0) -> OutputTextDelta:
    return OutputTextDelta(item_id=item, output_index=index, content_index=0, delta=delta)


def done(item: str = "msg_1") -> OutputTextDone:
    return OutputTextDone(item_id=item, output_index=0, content_index=0, text="")


def arguments(delta: str, item: str = "fc_1") -> FunctionCallArgumentsDelta:
    return FunctionCallArgumentsDelta(item_id=item, output_index=1, delta=delta)


def test_deltas_of_one_item_merge_and_nothing_else_does() -> None:
    assert merge_deltas(text("Hel"), text("lo")) == text("Hello")
    assert merge_deltas(arguments('{"a"'), arguments(":1}")) == arguments('{"a":1}')
    assert merge_deltas(text("a"), text("b", item="msg_2")) is None
    assert merge_deltas(text("a"), text("b", index=1)) is None
    assert merge_deltas(text("a"), arguments("b")) is None
    assert merge_deltas(text("a"), done()) is None


def test_merged_text_deltas_carry_each_tokens_logprobs_in_order() -> None:
    def said(delta: str) -> OutputTextDelta:
        logprob = Logprob(token=delta, logprob=-1.0, bytes=tuple(delta.encode()))
        return attrs.evolve(text(delta), logprobs=(logprob,))

    merged = merge_deltas(said("a"), said("b"))
    assert isinstance(merged, OutputTextDelta) and merged.delta == "ab"
    assert [entry.token for entry in merged.logprobs] == ["a", "b"]


async def drain(
    events: list[ServerEvent], merge: bool, limit: int = 64
) -> list[list[tuple[ServerEvent, int]]]:
    """The batches a writer takes from a channel that already holds `events`."""
    send, receive = trio.open_memory_channel[Outgoing](len(events))
    for event in events:
        send.send_nowait(Outgoing(event))
    send.close()
    outbox = Outbox(receive, merge=merge)
    batches = []
    while batch := await outbox.batch(limit):
        assert 1 <= len(batch) <= limit
        batches.append([(outgoing.event, merged) for outgoing, merged in batch])
    return batches


async def test_an_outbox_merges_runs_of_pending_deltas_and_keeps_order() -> None:
    pending = [text("a"), text("b"), text("c"), done(), text("x", "msg_2"), arguments("{")]
    assert await drain(pending, merge=True) == [[
        (text("abc"), 3), (done(), 1), (text("x", "msg_2"), 1), (arguments("{"), 1)
    ]]  # fmt: skip
    assert await drain(pending, merge=False) == [[(event, 1) for event in pending]]


async def test_the_batch_limit_cuts_writes_not_what_they_carry() -> None:
    """A pile bigger than one write goes out in several: the same events, merged the same way."""
    pending = [text("a"), text("b"), done(), text("x", "msg_2"), arguments("{"), arguments("}")]
    for merge in (True, False):
        in_pairs = await drain(pending, merge=merge, limit=2)
        assert [e for b in in_pairs for e in b] == [
            e for b in await drain(pending, merge) for e in b
        ]


async def test_a_writer_that_waited_writes_what_came_together_unmerged() -> None:
    """Tokens a generator releases together reach a writer that was waiting for them: it is
    keeping up, so each goes in its own frame; what piles up while it writes is merged."""
    send, receive = trio.open_memory_channel[Outgoing](16)
    outbox = Outbox(receive, merge=True)
    batches: list[list[tuple[ServerEvent, int]]] = []

    async def writer() -> None:
        while batch := await outbox.batch(64):
            batches.append([(outgoing.event, merged) for outgoing, merged in batch])
            if len(batches) == 1:
                for delta in "de":  # arrive while the first batch is written
                    send.send_nowait(Outgoing(text(delta)))
                await trio.lowlevel.checkpoint()

    with trio.fail_after(5):  # waits: the writer draining what it is given
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            for delta in "abc":  # in one go, while the writer waits
                send.send_nowait(Outgoing(text(delta)))
            await trio.testing.wait_all_tasks_blocked()
            send.close()
    assert batches == [[(text("a"), 1), (text("b"), 1), (text("c"), 1)], [(text("de"), 2)]]


class GatedWebSocket:
    """Stands in for a client socket that takes nothing until `gate` opens."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.frames: list[dict[str, Any]] = []

    async def send_message(self, message: str) -> None:
        await self.gate.wait()
        self.frames.append(orjson.loads(message))

    async def get_message(self) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        pass


class NoDialect:
    async def handle(self, event: ClientEvent, frame_bytes: int) -> None:
        raise AssertionError("no client events in this test")

    async def drain(self) -> None:
        pass


class Sent:
    def __init__(self) -> None:
        self.merged: list[int] = []

    def sent(self, event: ServerEvent, merged: int) -> None:
        self.merged.append(merged)


async def test_a_connection_writer_that_fell_behind_sends_one_frame_for_what_piled_up() -> None:
    ws = GatedWebSocket()
    observer = Sent()
    connection = Connection(
        ws,  # type: ignore[arg-type]
        budget=MemoryBudget(MiB, flag="--max-connection-memory", name="connection"),
        offload=Offload(threads=1),
        queue_events=64,
        observer=observer,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(connection.run, nursery, NoDialect(), lifetime_s=1e9))
        connection.events.send_nowait(text("The "))
        await trio.testing.wait_all_tasks_blocked()  # the writer holds it, the socket is shut
        for word in ("quick ", "brown ", "fox"):
            connection.events.send_nowait(text(word))
        connection.events.send_nowait(done())
        ws.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [(f["type"], f.get("delta")) for f in ws.frames] == [
        ("response.output_text.delta", "The "),
        ("response.output_text.delta", "quick brown fox"),
        ("response.output_text.done", None),
    ]
    assert [f["sequence_number"] for f in ws.frames] == [0, 1, 2]
    assert observer.merged == [1, 3, 1]
