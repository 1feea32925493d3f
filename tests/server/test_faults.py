"""Faults: a generator that raises, a client that stops reading or vanishes, suspensions that
outstay their welcome, too many of them, and a server told to stop. Every stream is checked.

Time-outs run on trio's autojump clock; clients that must wait for the server's own timers read
without a deadline of their own (the clock jumps to the earliest deadline in the process).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tracemalloc
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from proto_server.core.conversation import Conversation
from proto_server.engine.chunks import Chunk, ToolCallEnd
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.simulated import SimulatedGenerator, SimulatedSession, TimingModel
from proto_server.testing import WireClient, connect_checked, o200k_count

from ..support.frames import THREE_SEGMENTS, answers, create
from ..support.generators import RecordingGenerator
from ..support.servers import Running, StartServer, read_line, server_tasks
from ..support.stores import CheckpointStore

LS = {"name": "exec_command", "arguments": {"cmd": "ls"}}
ONE_CALL = {"segments": [{"text": "Let me look.", "tool_calls": [LS]}, {"text": "done"}]}
TWO_CALLS = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": c}} for c in ("a", "b")]},
        {"text": "done"},
    ]
}


async def suspended(
    running: Running, stack: AsyncExitStack
) -> tuple[WireClient, list[dict[str, Any]]]:
    """A client whose Response is suspended, open until `stack` closes."""
    client = await stack.enter_async_context(connect_checked(running.prototype_url))
    await client.send(create())
    events = await client.segment()
    assert events[-1]["type"] == "response.done"
    return client, events


# -- the generator raises -------------------------------------------------------------------------


class FaultyGenerator:
    """A simulated generator whose sessions raise after `after` chunks of a segment."""

    forces_tool_calls = True

    def __init__(self, inner: SimulatedGenerator, after: int) -> None:
        self.inner = inner
        self.after = after

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> FaultySession:
        return FaultySession(
            self.inner.open_session(conversation, cache_salt=cache_salt), self.after
        )


class FaultySession:
    def __init__(self, inner: SimulatedSession, after: int) -> None:
        self.inner = inner
        self.after = after

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        proxy_send, proxy_receive = trio.open_memory_channel[Chunk](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.inner.generate, proxy_send, limits)
            count = 0
            async for chunk in proxy_receive:
                if count == self.after:
                    nursery.cancel_scope.cancel()
                    raise RuntimeError(f"the GPU fell over after {count} chunks")
                await send.send(chunk)
                count += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# before the prefill, before the text, mid text, mid arguments, before the segment's end
@pytest.mark.parametrize("after", [0, 1, 3, 8, 12])
async def test_a_generator_raising_mid_segment_fails_the_response_not_the_connection(
    start_server: StartServer, after: int
) -> None:
    running = await start_server(ONE_CALL)
    healthy = running.server.responses.generator
    running.server.responses.generator = FaultyGenerator(healthy, after)  # type: ignore[assignment]
    async with connect_checked(running.prototype_url) as client:
        await client.send(create())
        events = await client.segment()
        failed = events[-1]
        assert failed["type"] == "response.failed"
        error = failed["response"]["error"]
        assert (error["type"], error["code"]) == ("server_error", "generator_error")
        assert f"the GPU fell over after {after} chunks" in error["message"]
        statuses = [i["status"] for i in failed["response"]["output"]]
        assert "in_progress" not in statuses  # whatever was streaming was closed
        running.server.responses.generator = healthy
        await client.send(create())
        assert (await client.segment())[-1]["type"] == "response.done"


class MisbehavingSession:
    """Ends a tool call it never began, before it reports its prefill: no chunk it sends could
    make a segment."""

    def __init__(self, inner: SimulatedSession) -> None:
        self.inner = inner
        self.segments = 0

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        self.segments += 1
        await send.send(ToolCallEnd())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MisbehavingGenerator:
    forces_tool_calls = True

    def __init__(self, inner: SimulatedGenerator) -> None:
        self.inner = inner
        self.sessions: list[MisbehavingSession] = []

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> MisbehavingSession:
        session = MisbehavingSession(self.inner.open_session(conversation, cache_salt=cache_salt))
        self.sessions.append(session)
        return session


async def test_a_generator_misbehaving_before_its_prefill_fails_the_response_once(
    start_server: StartServer,
) -> None:
    # before the core decided the loop's next step, such a segment counted as ended and the
    # loop ran another, and another: the Response now fails at the first
    running = await start_server(ONE_CALL)
    healthy = running.server.responses.generator
    misbehaving = MisbehavingGenerator(healthy)
    running.server.responses.generator = misbehaving  # type: ignore[assignment]
    async with connect_checked(running.prototype_url) as client:
        await client.send(create())
        failed = (await client.segment())[-1]
        assert failed["type"] == "response.failed"
        error = failed["response"]["error"]
        assert error["code"] == "generator_error"
        assert "generator misbehaved" in error["message"]
        assert [session.segments for session in misbehaving.sessions] == [1]
        running.server.responses.generator = healthy
        await client.send(create())
        assert (await client.segment())[-1]["type"] == "response.done"


# -- a client that stops reading ----------------------------------------------------------------


class CountingGenerator:
    """Counts the chunks its sessions managed to hand to the sampling loop."""

    forces_tool_calls = True

    def __init__(self, inner: SimulatedGenerator) -> None:
        self.inner = inner
        self.chunks = 0

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> Any:
        generator = self
        session = self.inner.open_session(conversation, cache_salt=cache_salt)

        class Counting:
            async def generate(
                self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits
            ) -> None:
                class Send:
                    async def send(self, chunk: Chunk) -> None:
                        await send.send(chunk)
                        generator.chunks += 1

                    def send_nowait(self, chunk: Chunk) -> None:
                        send.send_nowait(chunk)  # raises WouldBlock, and then nothing counts
                        generator.chunks += 1

                await session.generate(Send(), limits)  # type: ignore[arg-type]

            def __getattr__(self, name: str) -> Any:
                return getattr(session, name)

        return Counting()


async def test_a_client_that_stops_reading_holds_back_the_model_and_memory_stays_bounded(
    start_server: StartServer,
) -> None:
    """Backpressure: a reader that stalls stalls the generator; what waits is bounded."""
    tokens = 12_000
    running = await start_server(
        {"segments": [{"text": "word " * tokens}]},
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1e9),
        client_queue_events=64,
        # a frame per token, so the socket's buffers fill as a long stream's would: merged, the
        # writer (which takes every ready event at once) packs these 60 KB into a few frames,
        # all of which fit in loopback's buffers, and nothing would need holding back
        merge_deltas=False,
    )
    counting = CountingGenerator(running.server.responses.generator)
    running.server.responses.generator = counting  # type: ignore[assignment]
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        # waits: the stall, then the whole stream once the client reads again
        with trio.fail_after(60):
            async with connect_checked(running.prototype_url) as client:
                await client.send(create(tools=[]))
                assert (await client.receive())["type"] == "response.created"
                # stop reading: wait until nothing moves any more
                seen = -1
                while counting.chunks != seen:
                    seen = counting.chunks
                    await trio.testing.wait_all_tasks_blocked(0.05)
                held = tracemalloc.get_traced_memory()[1] - baseline
                tracemalloc.stop()
                print(f"stalled after {seen} of {tokens} tokens, holding {held / 2**20:.2f} MiB")
                assert seen < tokens / 3, "the generator ran ahead of a client that does not read"
                assert held < 6 * 2**20
                # the stream is whole once the client reads again
                events = await client.until("response.completed")
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == "word " * tokens
            assert counting.chunks == 2 + o200k_count(text)  # Prefilled, each token, SegmentEnd
    finally:
        tracemalloc.stop()


# -- a client that vanishes at any moment ---------------------------------------------------------


async def test_a_client_that_vanishes_at_any_moment_leaves_nothing_behind(
    start_server: StartServer,
) -> None:
    # at once, without a grace to reattach in (test_reattach: a grace that lapses cuts it too)
    running = await start_server(THREE_SEGMENTS, reattach_grace_s=0)
    generator = RecordingGenerator(running.server.responses.generator)
    running.server.responses.generator = generator  # type: ignore[assignment]
    whole = await whole_rollout(running)
    for point in range(len(whole) + 1):  # before the first event, after each one
        with trio.fail_after(5):
            async with connect_checked(running.prototype_url) as client:
                await client.send(create())
                segment = []
                for _ in range(point):
                    segment.append(await client.receive())
                    if segment[-1]["type"] == "response.done":  # answered at once: it goes on
                        await client.send({"type": "response.append", "input": answers(segment)})
                        segment = []
                    if segment and segment[-1]["type"] == "response.completed":
                        break  # a writer that fell behind merged deltas: fewer events this time
                await client.vanish()  # the TCP drops: no close frame
        with trio.fail_after(5):
            await running.server.wait_idle()
        await trio.testing.wait_all_tasks_blocked()
        assert all(session.closed for session in generator.sessions)
        assert server_tasks() == [], f"left behind by a client gone after event {point}"
    assert [e["type"] for e in whole].count("response.done") == 2


async def whole_rollout(running: Running) -> list[dict[str, Any]]:
    async with connect_checked(running.prototype_url) as client:
        await client.send(create())
        events = await client.segment()
        while events[-1]["type"] == "response.done":
            await client.send({"type": "response.append", "input": answers(events)})
            events = await client.segment()
        return client.received


# -- suspensions that last too long, and too many of them -----------------------------------------


async def test_an_idle_suspension_ends_incomplete_and_a_partial_answer_restarts_its_clock(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(TWO_CALLS, store=CheckpointStore(), suspend_timeout_s=60)
    # on the virtual clock: the client outwaits the server's 60 s timeout
    async with connect_checked(running.prototype_url, event_timeout_s=600) as client:
        await client.send(create())
        first, second = answers(await client.segment())
        await trio.sleep(50)
        await client.send({"type": "response.append", "input": [first]})  # alive
        await trio.sleep(50)  # 100 s since the suspension, 50 since the client spoke
        await client.send({"type": "response.append", "input": [second]})
        resumed = await client.segment()
        assert resumed[0]["type"] == "response.in_progress"
        assert resumed[-1]["type"] == "response.completed"

        await client.send(create())
        await client.segment()
        start = trio.current_time()
        expired = await client.receive()  # nothing is sent until the server gives up
        assert trio.current_time() - start == pytest.approx(60)
        assert expired["type"] == "response.incomplete"
        assert expired["response"]["incomplete_details"] == {"reason": "suspend_timeout"}
        await client.send({"type": "response.append", "input": answers(client.received)})
        assert (await client.receive())["error"]["code"] == "no_open_response"
    await running.server.wait_idle()


async def test_past_the_cap_the_idlest_suspension_is_evicted_and_says_why(
    start_server: StartServer,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = await start_server(TWO_CALLS, store=CheckpointStore(), max_suspended_rollouts=2)
    caplog.set_level(logging.WARNING, logger="proto_server")
    async with AsyncExitStack() as stack:
        await evictions(running, stack, caplog)
    assert running.server.responses.suspensions.evicted == 2


async def evictions(
    running: Running, stack: AsyncExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    a, a_events = await suspended(running, stack)
    await trio.sleep(1)
    b, b_events = await suspended(running, stack)
    await trio.sleep(1)
    c, _ = await suspended(running, stack)  # one too many: a, idle longest, goes
    evicted = await a.receive()
    assert evicted["type"] == "response.incomplete"
    assert evicted["response"]["incomplete_details"] == {"reason": "suspended_rollout_limit"}
    [record] = [r for r in caplog.records if r.getMessage() == "rollout.evicted"]
    assert record.response == a_events[0]["response"]["id"]  # type: ignore[attr-defined]
    assert (record.limit, record.idle_s) == (2, 2.0)  # type: ignore[attr-defined]

    # b answers one call: now c is the idlest, and the next suspension evicts c, not b
    await b.send({"type": "response.append", "input": answers(b_events)[:1]})
    await trio.testing.wait_all_tasks_blocked()
    d, _ = await suspended(running, stack)
    assert (await c.receive())["response"]["incomplete_details"]["reason"] == (
        "suspended_rollout_limit"
    )
    await b.send({"type": "response.append", "input": answers(b_events)[1:]})
    assert (await b.segment())[-1]["type"] == "response.completed"
    await d.send({"type": "response.cancel"})
    assert (await d.receive())["type"] == "response.cancelled"


# -- a server told to stop ----------------------------------------------------------------------


async def test_a_stopping_server_lets_segments_finish_and_tells_suspended_clients(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    # 10 tokens/s: the streaming segment takes about 3 s, well within the 10 s grace
    running = await start_server(
        ONE_CALL,
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10),
        store=CheckpointStore(),
    )
    async with AsyncExitStack() as stack:
        waiting, _ = await suspended(running, stack)
        streaming = await stack.enter_async_context(connect_checked(running.prototype_url))
        await streaming.send(create())
        await streaming.until("response.output_text.delta")
        idle = await stack.enter_async_context(connect_checked(running.prototype_url))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(running.server.shutdown, 10)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(OSError):  # no new connections
                await trio.open_tcp_stream(running.address.host, running.address.port)
            for client in (waiting, streaming, idle):
                events = []
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        events.append(await client.receive())
                assert closed.value.reason.code == 1001
                assert "reconnect" in (closed.value.reason.reason or "")
                if client is streaming:  # its segment finished before the end was announced
                    assert [e["type"] for e in events][-2] == "response.done"
                if client is not idle:
                    assert events[-1]["type"] == "response.incomplete"
                    reason = events[-1]["response"]["incomplete_details"]["reason"]
                    assert reason == "server_shutdown"
    assert running.server.open_connections == 0


async def test_a_segment_longer_than_the_grace_period_is_cut(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        {"segments": [{"text": "word " * 1000}]},
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=10),
        store=CheckpointStore(),
    )
    async with connect_checked(running.prototype_url) as client, trio.open_nursery() as nursery:
        await client.send(create(tools=[]))
        await client.until("response.output_text.delta")
        start = trio.current_time()
        nursery.start_soon(running.server.shutdown, 5)
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                events.append(await client.receive())
    assert closed.value.reason.code == 1001
    assert trio.current_time() - start == pytest.approx(5, abs=0.5)
    assert [e["type"] for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[-2]["item"]["status"] == "incomplete"


async def test_sigterm_lets_a_real_server_finish_its_segments_and_exit_0(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    slow = {"text": "word " * 30, "tool_calls": [LS]}  # 30 tokens at 40/s: under a second
    script.write_text(json.dumps({"segments": [slow, {"text": "done"}]}))
    command = [
        *(sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:"),
        *("--script", str(script), "--decode-rate", "40", "--shutdown-grace", "5"),
    ]
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    check=False)
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        url = (await read_line(process.stdout)).split("WebSocket ")[1].split(";")[0]
        async with AsyncExitStack() as stack:
            url = f"{url}?dialect=prototype"
            waiting = await stack.enter_async_context(connect_checked(url))
            await waiting.send(create())
            await waiting.segment()
            streaming = await stack.enter_async_context(connect_checked(url))
            await streaming.send(create())
            await streaming.until("response.output_text.delta")
            process.send_signal(signal.SIGTERM)
            for client in (streaming, waiting):
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await client.receive()
                assert closed.value.reason.code == 1001
            # the streaming segment ran to its end before the Response was ended
            kinds = [e["type"] for e in streaming.received]
            assert kinds[-2:] == ["response.done", "response.incomplete"]
        assert await process.wait() == 0
        err = (await process.stderr.receive_some()).decode()
        assert "SIGTERM, stopping" in err
