"""What the prototype dialect says to a client that gets it wrong, and what it keeps intact.

Every refused frame gets exactly one `error` event with a precise code and `param`; the Response
it aimed at is unharmed and the same connection goes on to finish a rollout.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from proto_server.engine.simulated import TimingModel
from proto_server.testing import WireClient

from ..support.clients import connect
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS, answers, create
from ..support.generators import RecordingGenerator
from ..support.servers import StartServer, server_tasks

#: Slow enough that a segment is surely still streaming while the test acts.
SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=5)

ONE_CALL = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"text": "done"},
    ]
}
LONG_TEXT = {"segments": [{"text": "word " * 500}]}


async def refused(client: WireClient, frame: dict[str, Any] | str | bytes) -> dict[str, Any]:
    """Send a frame and return the `error` it earns; nothing else may arrive first."""
    if isinstance(frame, dict):
        await client.send(frame)
    else:
        await client.ws.send_message(frame)
    event = await client.receive()
    assert event["type"] == "error", event
    assert event["status"] == 400
    assert event["error"]["type"] == "invalid_request_error"
    assert event["error"]["message"]
    return event["error"]


async def finish_rollout(client: WireClient, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Answer suspensions until the Response completes; return the last segment."""
    while events[-1]["type"] == "response.done":
        await client.send({"type": "response.append", "input": answers(events)})
        events = await client.segment()
    assert events[-1]["type"] == "response.completed", events[-1]
    return events


async def test_unknown_call_id_is_refused_and_the_response_is_unharmed(
    start_server: StartServer,
) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        events = await client.segment()
        bogus = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}
        error = await refused(client, {"type": "response.append", "input": [bogus]})
        assert error["code"] == "unknown_call_id"
        assert error["param"] == "input[0].call_id"
        assert "call_nope" in error["message"]
        await finish_rollout(client, events)


async def test_a_call_answered_twice_is_a_duplicate(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        first = await client.segment()
        answer = answers(first)
        error = await refused(client, {"type": "response.append", "input": answer + answer})
        assert (error["code"], error["param"]) == ("duplicate_call_id", "input[1].call_id")
        # the refused frame changed nothing: the same answer is still welcome once
        await client.send({"type": "response.append", "input": answer})
        second = await client.segment()
        assert second[0]["type"] == "response.in_progress"
        error = await refused(client, {"type": "response.append", "input": answer})
        assert error["code"] == "duplicate_call_id"
        await finish_rollout(client, second)


async def test_answering_some_calls_keeps_the_response_suspended(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        first = await client.segment()
        await client.send({"type": "response.append", "input": answers(first)})
        second = await client.segment()
        one, two = answers(second)
        await client.send({"type": "response.append", "input": [one]})
        # still suspended: a second create is refused rather than silently queued...
        error = await refused(client, create())
        assert error["code"] == "concurrent_request"
        # ...and the last answer resumes it
        await client.send({"type": "response.append", "input": [two]})
        third = await client.segment()
        assert third[0]["type"] == "response.in_progress"
        assert third[-1]["type"] == "response.completed"


async def test_append_with_nothing_open_or_after_the_end(start_server: StartServer) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        late = {"type": "function_call_output", "call_id": "call_x", "output": "x"}
        error = await refused(client, {"type": "response.append", "input": [late]})
        assert error["code"] == "no_open_response"
        await client.send(create())
        events = await finish_rollout(client, await client.segment())
        error = await refused(
            client,
            {
                "type": "response.append",
                "input": [{"type": "message", "role": "user", "content": "one more thing"}],
            },
        )
        assert error["code"] == "no_open_response"
        assert events[-1]["response"]["id"] in error["message"]


async def test_append_while_streaming_is_refused(start_server: StartServer) -> None:
    running = await start_server(LONG_TEXT, timing=SLOW)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        await client.until("response.output_text.delta")
        msg = {"type": "message", "role": "user", "content": "hurry"}
        await client.send({"type": "response.append", "input": [msg]})
        error = (await client.until("error"))[-1]["error"]
        assert error["code"] == "response_in_progress"
        await client.send({"type": "response.cancel"})
        tail = await client.until("response.cancelled")
        # the message that was streaming is closed, not left dangling
        assert [e["type"] for e in tail[-4:]] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.cancelled",
        ]
        assert tail[-2]["item"]["status"] == "incomplete"
        assert tail[-1]["response"]["status"] == "cancelled"


async def test_a_new_user_message_resumes_the_response(start_server: StartServer) -> None:
    """A second user turn in the same Response: outputs and the message in one append."""
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        events = await client.segment()
        msg = {"type": "message", "role": "user", "content": "also check b.py"}
        error = await refused(client, {"type": "response.append", "input": [msg]})
        assert error["code"] == "missing_tool_output"
        await client.send({"type": "response.append", "input": [*answers(events), msg]})
        final = await client.segment()
        assert final[-1]["type"] == "response.completed"


async def test_append_takes_only_outputs_and_messages(start_server: StartServer) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        events = await client.segment()
        replay = {
            "type": "function_call",
            "call_id": "c",
            "name": "exec_command",
            "arguments": "{}",
        }
        error = await refused(client, {"type": "response.append", "input": [replay]})
        assert (error["code"], error["param"]) == ("invalid_field", "input[0].type")
        error = await refused(client, {"type": "response.append", "input": []})
        assert (error["code"], error["param"]) == ("invalid_field", "input")
        await finish_rollout(client, events)


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        ({"model": "m"}, "invalid_field", "type"),
        ({"type": "response.frobnicate"}, "unknown_event_type", "type"),
        ({"type": "response.create", "input": 5}, "invalid_field", "input"),
        ({"type": "response.create", "model": 7}, "invalid_field", "model"),
        ({"type": "response.create", "tools": [{"type": "function", "name": 3}]},
         "invalid_field", "tools[0].name"),
        ({"type": "response.create", "input": [{"type": "message", "role": "user"}]},
         "invalid_field", "input[0].content"),
        ({"type": "response.create", "parallel_tool_calls": "yes"},
         "invalid_field", "parallel_tool_calls"),
        ({"type": "response.append", "input": [{"type": "function_call_output", "call_id": 1,
                                                "output": "x"}]},
         "invalid_field", "input[0].call_id"),
        ({"type": "response.create", "previous_response_id": "resp_1"},
         "invalid_field", "previous_response_id"),
        ({"type": "response.create", "background": True}, "invalid_field", "background"),
        ({"type": "response.cancel"}, "no_open_response", None),
        (b"\x00binary", "invalid_frame", None),
    ],
)  # fmt: skip
async def test_malformed_frames_get_a_precise_error_and_the_connection_lives(
    start_server: StartServer, frame: dict[str, Any] | str | bytes, code: str, param: str | None
) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        error = await refused(client, frame)
        assert (error["code"], error["param"]) == (code, param)
        await client.send(create())
        final = await finish_rollout(client, await client.segment())
        assert [e["sequence_number"] for e in client.received] == list(range(len(client.received)))
        assert final[-1]["response"]["output"][-1]["content"][0]["text"] == "done"


async def test_a_script_calling_a_tool_the_request_did_not_offer_fails_the_response(
    start_server: StartServer,
) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        await client.send(create(tools=[{**EXEC_COMMAND, "name": "run"}]))
        events = await client.segment()
        failed = events[-1]
        assert failed["type"] == "response.failed"
        error = failed["response"]["error"]
        assert error["code"] == "script_error"
        assert "'exec_command'" in error["message"] and "offered 'run';" in error["message"]
        # the connection lives: the next Response is served
        await client.send(create())
        assert (await client.segment())[-1]["type"] == "response.done"


async def test_a_frame_over_the_size_limit_closes_with_1009(start_server: StartServer) -> None:
    running = await start_server(max_message_bytes=1024)
    async with connect(running.prototype_url) as client:
        await client.send(create(instructions="x" * 2000))
        with pytest.raises(ConnectionClosed) as closed:
            await client.receive()
    assert closed.value.reason.code == 1009
    assert "1024" in closed.value.reason.reason


async def test_cancel_while_suspended(start_server: StartServer) -> None:
    running = await start_server(ONE_CALL)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        await client.segment()
        await client.send({"type": "response.cancel"})
        cancelled = await client.receive()
        assert cancelled["type"] == "response.cancelled"
        assert cancelled["response"]["status"] == "cancelled"
        error = await refused(client, {"type": "response.cancel"})
        assert error["code"] == "no_open_response"
    await running.server.wait_idle()


# -- disconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["streaming", "suspended"])
async def test_a_vanished_client_leaves_nothing_behind(
    start_server: StartServer, when: str
) -> None:
    if when == "streaming":
        running = await start_server(LONG_TEXT, timing=SLOW)
    else:
        running = await start_server(ONE_CALL)
    generator = RecordingGenerator(running.server.responses.generator)
    running.server.responses.generator = generator
    async with connect(running.prototype_url) as client:
        await client.send(create())
        await client.until("response.output_text.delta" if when == "streaming" else "response.done")
        assert running.server.open_rollouts == 1
        assert server_tasks()
        # no close handshake: the TCP connection just drops, as Codex does at exit
        await client.vanish()
    await running.server.wait_idle()
    await trio.testing.wait_all_tasks_blocked()  # let the handler task itself return
    assert running.server.open_rollouts == 0
    assert running.server.open_connections == 0
    assert [session.closed for session in generator.sessions] == [True]
    assert server_tasks() == []
