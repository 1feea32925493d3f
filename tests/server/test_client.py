"""The trio client against a real server on 127.0.0.1: stepping, appending, cancelling, timing."""

from __future__ import annotations

import itertools
import subprocess
import sys

import orjson
import pytest
import trio
from prometheus_client import REGISTRY

from proto_server.client import Dialect, Rollout, RolloutState, Sent, connect
from proto_server.client.dialects import rules
from proto_server.client.http import HttpWire
from proto_server.client.state import OutputsRefused
from proto_server.engine.simulated import TimingModel
from proto_server.wire.events import ErrorEvent, OutputTextDelta, ResponseCancelled

from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.servers import StartServer


async def test_a_prototype_rollout_steps_segment_by_segment_in_one_response(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect="prototype") as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        assert rollout.state is RolloutState.STREAMING
        seen = [received.event.type async for received in rollout.events()]
        assert seen[0] == "response.created" and seen[-1] == "response.done"
        assert rollout.state is RolloutState.SUSPENDED
        (first_call,) = rollout.pending_calls
        assert orjson.loads(first_call.arguments) == {"cmd": "ls"}

        await rollout.append({first_call.call_id: "a.py b.py"})
        second = await rollout.step()
        assert second.end == "response.done"
        assert [orjson.loads(c.arguments)["cmd"] for c in rollout.pending_calls] == [
            "cat a.py",
            "cat b.py",
        ]
        # The warm path: only the tool output was prefilled again.
        assert 0 < second.reprocessed_tokens < second.cached_tokens

        await rollout.append({call.call_id: "x = 1" for call in rollout.pending_calls})
        third = await rollout.step()
        assert third.end == "response.completed"
        assert rollout.state is RolloutState.COMPLETED
        assert rollout.response is not None and rollout.response.status == "completed"

    numbers = [received.sequence_number for received in rollout.received]
    assert numbers == list(range(len(numbers)))
    assert rollout.tracker.response_ids == [rollout.response.id]
    text = "".join(r.event.delta for r in rollout.received if isinstance(r.event, OutputTextDelta))
    assert text == "Let me look.Fixed: the loop was off by one."
    assert [item.type for item in rollout.output] == [
        "message",
        "function_call",
        "function_call",
        "function_call",
        "message",
    ]


async def test_bytes_sent_per_segment_are_the_frames_that_started_it(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url, dialect="prototype") as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        await rollout.step()
        await rollout.append({rollout.pending_calls[0].call_id: "a.py"})
        await rollout.step()
        a, b = (call.call_id for call in rollout.pending_calls)
        await rollout.append({a: "1"})  # partial: the server holds it, nothing streams
        assert rollout.state is RolloutState.SUSPENDED
        await rollout.append({b: "2"})
        await rollout.step()

    create = {"type": "response.create", "input": "fix it", "tools": [EXEC_COMMAND]}

    def append(call_id: str, output: str) -> dict[str, object]:
        item = {"type": "function_call_output", "call_id": call_id, "output": output}
        return {"type": "response.append", "input": [item]}

    sizes = [segment.sent_bytes for segment in rollout.segments]
    sent = [entry for entry in connection.transcript if isinstance(entry, Sent)]
    assert [entry.body["type"] for entry in sent] == ["response.create", *["response.append"] * 3]
    assert sum(entry.size for entry in sent) == sum(sizes)
    assert len(connection.transcript) == len(sent) + len(rollout.received)
    first_call = rollout.output[1].call_id  # type: ignore[union-attr]
    assert sizes == [
        len(orjson.dumps(create)),
        len(orjson.dumps(append(first_call, "a.py"))),
        len(orjson.dumps(append(a, "1"))) + len(orjson.dumps(append(b, "2"))),
    ]


@pytest.mark.parametrize("dialect", ["prototype", "launched", "http"])
async def test_a_tool_choice_given_to_append_goes_with_the_answer_that_resumes_and_stays(
    start_server: StartServer, dialect: Dialect
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect=dialect) as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND], tool_choice="auto")
        await rollout.step()
        await rollout.append({rollout.pending_calls[0].call_id: "a.py"}, tool_choice="required")
        await rollout.step()
        a, b = (call.call_id for call in rollout.pending_calls)
        await rollout.append({a: "1"}, tool_choice="none")  # held (prototype: partial) ...
        await rollout.append({b: "2"})  # ... until the answer that resumes carries it
        assert (await rollout.step()).end == "response.completed"

    sent = [
        entry.body.get("tool_choice") for entry in connection.transcript if isinstance(entry, Sent)
    ]
    if dialect == "prototype":  # the Response keeps a tool_choice for the rest by itself
        assert sent == ["auto", "required", None, "none"]
    else:  # a chain asks every later turn with it
        assert sent == ["auto", "required", "none"]


async def test_outputs_for_unknown_calls_are_refused_before_anything_is_sent(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url) as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        await rollout.step()
        with pytest.raises(OutputsRefused, match="call_nope"):
            await rollout.append({"call_nope": "x"})
        with pytest.raises(RuntimeError, match="suspended"):
            await rollout.step()
        with pytest.raises(RuntimeError, match="still suspended"):
            await connection.create("another")
        await rollout.append({rollout.pending_calls[0].call_id: "ok"})
        segment = await rollout.step()
        assert not any(isinstance(r.event, ErrorEvent) for r in segment.events)


async def test_cancel_a_suspended_rollout_then_start_another(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url) as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        await rollout.step()
        await rollout.cancel()
        assert rollout.state is RolloutState.CANCELLED
        assert isinstance(rollout.received[-1].event, ResponseCancelled)
        assert rollout.segments[-1].sent_bytes == len(orjson.dumps({"type": "response.cancel"}))
        with pytest.raises(RuntimeError, match="already ended"):
            await rollout.cancel()
        again = await connection.create("fix it", tools=[EXEC_COMMAND])
        await again.step()
        assert again.state is RolloutState.SUSPENDED
        assert again.response_id != rollout.response_id


@pytest.mark.parametrize("dialect", ["prototype", "launched", "http"])
async def test_cancel_while_streaming(start_server: StartServer, dialect: Dialect) -> None:
    """HTTP cancels by dropping the stream: the server must shrug that off, not crash."""
    script = {"segments": [{"text": " word" * 2000}, {"text": "again"}]}
    running = await start_server(script, timing=TimingModel(decode_tokens_per_s=2_000))
    async with connect(running.address.http_url, dialect=dialect) as connection:
        rollout = await connection.create("talk")
        async for received in rollout.events():
            if isinstance(received.event, OutputTextDelta):
                break
        await rollout.cancel()
        assert rollout.state is RolloutState.CANCELLED
        if dialect != "http":  # a WebSocket Response is cancelled on the server and says so
            assert rollout.received[-1].event.type == "response.cancelled"
        again = await connection.create("talk")  # the connection lives on
        async for received in again.events():
            if isinstance(received.event, OutputTextDelta):
                break
        # the new Response streams from its start (deltas that piled up may come merged)
        assert received.event.delta.startswith(" word")


async def test_a_refused_create_fails_the_rollout_and_says_why(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url) as connection:
        rollout = await connection.create("x", previous_response_id="resp_nope")
        segment = await rollout.step()
        assert segment.end == "error"
        assert rollout.state is RolloutState.FAILED
        assert rollout.tracker.error is not None
        assert rollout.tracker.error.param == "previous_response_id"


async def test_measured_time_covers_the_modelled_gpu_time(start_server: StartServer) -> None:
    timing = TimingModel(prefill_tokens_per_s=20_000, decode_tokens_per_s=2_000)
    running = await start_server(THREE_SEGMENTS, timing=timing)
    async with connect(running.address.http_url) as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        while True:
            segment = await rollout.step()
            modelled = timing.segment_seconds(
                uncached_tokens=segment.reprocessed_tokens, output_tokens=segment.output_tokens
            )
            assert segment.time_to_end is not None and segment.time_to_end >= modelled
            assert segment.time_to_first_event is not None
            assert 0 < segment.time_to_first_event <= segment.time_to_end
            if rollout.state is not RolloutState.SUSPENDED:
                break
            await rollout.append({c.call_id: "ok" for c in rollout.pending_calls})
    assert rollout.state is RolloutState.COMPLETED


async def run_to_the_end(rollout: Rollout) -> None:
    """Step and answer every call (with its own arguments) until the rollout ends."""
    while not rollout.state.ended:
        if rollout.state is RolloutState.STREAMING:
            await rollout.step()
        else:
            outputs = {call.call_id: f"ran {call.arguments}" for call in rollout.pending_calls}
            await rollout.append(outputs)


async def test_launched_turns_chain_by_previous_response_id_and_send_only_new_items(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect="launched") as connection:
        rollout = await connection.create("fix it", model="m", tools=[EXEC_COMMAND])
        await rollout.step()
        assert rollout.state is RolloutState.SUSPENDED  # the turn completed; calls await output
        (call,) = rollout.pending_calls
        first_id = rollout.response_id
        await rollout.append({call.call_id: "a.py"})
        second = await rollout.step()
        assert second.sent_bytes == len(
            orjson.dumps(
                {
                    "type": "response.create",
                    "model": "m",
                    "tools": [EXEC_COMMAND],
                    "previous_response_id": first_id,
                    "input": [
                        {"type": "function_call_output", "call_id": call.call_id, "output": "a.py"}
                    ],
                }
            )
        )
        assert rollout.response is not None
        assert rollout.response.previous_response_id == first_id
        assert second.cached_tokens > 0  # served from the connection's warm cache
        await run_to_the_end(rollout)
        assert rollout.state is RolloutState.COMPLETED
        ids = rollout.tracker.response_ids
        assert len(ids) == 3 and len(set(ids)) == 3
        assert connection.last_response_id == ids[-1]


async def test_a_launched_warm_up_is_a_completed_rollout_the_next_one_chains_onto(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect="launched") as connection:
        warm = await connection.create([], model="m", tools=[EXEC_COMMAND], generate=False)
        segment = await warm.step()
        assert warm.state is RolloutState.COMPLETED and warm.output == []
        assert segment.output_tokens == 0
        rollout = await connection.create(
            "fix it", model="m", tools=[EXEC_COMMAND], previous_response_id=warm.response_id
        )
        first = await rollout.step()
        assert rollout.state is RolloutState.SUSPENDED
        assert first.cached_tokens > 0  # the tools and instructions were prefilled by the warm-up


async def test_http_turns_resend_the_whole_history_and_reprocess_it(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect="http") as connection:
        rollout = await connection.create("fix it", model="m", tools=[EXEC_COMMAND])
        await run_to_the_end(rollout)
    assert rollout.state is RolloutState.COMPLETED
    bodies = [entry.body for entry in connection.transcript if isinstance(entry, Sent)]
    # Each turn's body is the history as it was then: the message, what the model said, outputs.
    assert bodies[0]["input"] == "fix it"
    assert [len(body["input"]) for body in bodies[1:]] == [1 + 2 + 1, 4 + 2 + 2]
    segments = rollout.segments
    assert len(segments) == 3
    assert all(segment.cached_tokens == 0 for segment in segments)  # stateless: all cold
    for before, after in itertools.pairwise(segments):
        assert after.sent_bytes > before.sent_bytes
        assert after.reprocessed_tokens > before.input_tokens + before.output_tokens
    text = "".join(r.event.delta for r in rollout.received if isinstance(r.event, OutputTextDelta))
    assert text == "Let me look.Fixed: the loop was off by one."


def open_connections() -> float:
    return REGISTRY.get_sample_value("proto_server_connections_open") or 0.0


async def test_an_http_connection_the_server_closed_while_idle_is_not_reused(
    start_server: StartServer,
) -> None:
    # the server ends a kept-alive connection idle past its handshake timeout; a request sent
    # on it would meet the close instead of an answer (what bench vllm's http path met)
    running = await start_server(THREE_SEGMENTS, handshake_timeout_s=0.2)
    before = open_connections()
    async with connect(running.address.http_url, dialect="http") as connection:
        rollout = await connection.create("fix it", tools=[EXEC_COMMAND])
        await rollout.step()
        wire = connection._wire
        assert isinstance(wire, HttpWire) and wire._stream is not None
        idle = wire._stream
        with trio.fail_after(10):
            while open_connections() > before:  # noqa: ASYNC110 (a gauge: nothing to wait on)
                await trio.sleep(0.05)  # until the server has closed it
        await rollout.append({rollout.pending_calls[0].call_id: "a.py"})
        await rollout.step()
        assert rollout.state is RolloutState.SUSPENDED  # on the next calls
        assert wire._stream is not idle  # a new connection carried it


async def test_an_http_refusal_is_an_error_event(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.http_url, dialect="http") as connection:
        rollout = await connection.create("x", background=True, store=False)
        segment = await rollout.step()
        assert segment.end == "error"
        assert rollout.state is RolloutState.FAILED
        assert rollout.tracker.error is not None and rollout.tracker.error.param == "store"
        again = await connection.create("fix it", tools=[EXEC_COMMAND])  # the connection lives on
        await again.step()
        assert again.state is RolloutState.SUSPENDED


def test_the_client_stands_on_the_wire_alone() -> None:
    """The client (trio and blocking) imports the wire types and nothing of the server or the
    engine; hosting a server in-process is `proto_server.hosted`, above both."""
    probe = (
        "import sys, proto_server.client, proto_server.client.facade\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('proto_server.'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert {name.split(".")[1] for name in loaded} == {"client", "wire"}, loaded


def test_an_unknown_dialect_is_refused_naming_the_three() -> None:
    with pytest.raises(ValueError, match="use one of prototype, launched, http"):
        rules("websocket")
