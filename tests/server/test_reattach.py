"""Reattach to a Response in flight (`--reattach-grace`): a client that went away mid-stream
gets every event after the last it saw, then the live rest, as one gapless stream."""

from __future__ import annotations

from typing import Any

import attrs
import h11
import httpx
import orjson
import pytest
import trio
import trio.testing

from proto_server.core.request import response_template
from proto_server.engine.simulated import TimingModel
from proto_server.server.process.offload import INLINE_BYTES
from proto_server.server.rollouts import kept as kept_module
from proto_server.server.rollouts.kept import kept_bytes
from proto_server.server.transport.writer import echoed_bytes
from proto_server.testing import LaneChecker, StreamChecker, o200k_count
from proto_server.wire.converter import encode_server_event_bytes
from proto_server.wire.events import ResponseCompleted, ResponseCreate
from proto_server.wire.tools import FunctionTool

from ..support.clients import connect, parse_sse
from ..support.frames import EXEC_COMMAND, answers, body, create
from ..support.servers import StartServer
from ..support.stores import CheckpointStore

SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50)
#: 8 s of text at 50 tokens/s.
LONG_TEXT = {"segments": [{"text": "word " * 400}]}
#: Some text, then a call whose arguments stream for 8 s.
LONG_ARGUMENTS = {
    "segments": [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo " + "a " * 400}}],
        },
        {"text": "Done."},
    ]
}
KEYS = ("k1", "k2")


def payload(**fields: Any) -> dict[str, Any]:
    return {**body(tools=[EXEC_COMMAND]), "stream": True, **fields}


async def stream_until(
    port: int,
    create: dict[str, Any] | None,
    leave_at: str,
    count: int,
    key: str = "k1",
    target: str = "/v1/responses",
) -> list[dict[str, Any]]:
    """POST `create` (None: GET `target`) and read its SSE stream until `count` events of type
    `leave_at` came, then close the socket without a word: the events this client saw, whole."""
    data = b"" if create is None else orjson.dumps(create)
    conn = h11.Connection(h11.CLIENT)
    head = [("host", "x"), ("authorization", f"Bearer {key}")]
    if create is not None:
        head += [("content-type", "application/json"), ("content-length", str(len(data)))]
    method = "GET" if create is None else "POST"
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(conn.send(h11.Request(method=method, target=target, headers=head)) + data)
    text, seen = "", 0
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some())
                continue
            if isinstance(event, h11.Data):
                text += bytes(event.data).decode()
                whole = text[: text.rfind("\n\n") + 2]
                seen = sum(e["type"] == leave_at for e in parse_sse(whole))
                if seen >= count:
                    return parse_sse(whole)
            assert not isinstance(event, h11.EndOfMessage), "the stream ended first"
    finally:
        await stream.aclose()


async def reattach(
    port: int, response_id: str, after: int, key: str = "k1"
) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None]:
    """`GET ...?stream=true&starting_after=after`: its status, its events, or its error."""
    url = f"http://127.0.0.1:{port}/v1/responses/{response_id}"
    params = {"stream": "true", "starting_after": str(after)}
    headers = {"authorization": f"Bearer {key}"}
    async with (
        httpx.AsyncClient() as http,
        http.stream("GET", url, params=params, headers=headers) as answer,
    ):
        raw = "".join([chunk async for chunk in answer.aiter_text()])
        if answer.status_code != 200:
            return answer.status_code, [], orjson.loads(raw)["error"]
        assert answer.headers["content-type"] == "text/event-stream"
    return 200, parse_sse(raw), None


def checked(create: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """`events`, as one stream answering `create`, pass the stream checker."""
    checker = StreamChecker(dialect="launched", count_tokens=o200k_count)
    checker.sent({"type": "response.create", **create})
    for event in events:
        checker.received(event)
    checker.finish()


async def killed_and_reattached(
    start_server: StartServer, script: dict[str, Any], leave_at: str
) -> None:
    running = await start_server(script, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    port = running.address.port
    create = payload()
    with trio.fail_after(60):
        seen = await stream_until(port, create, leave_at, 5)
        response_id = seen[0]["response"]["id"]
        await trio.sleep(1)  # the Response runs on meanwhile
        assert running.server.open_rollouts == 1
        status, rest, _ = await reattach(port, response_id, seen[-1]["sequence_number"])
    assert status == 200
    assert rest[0]["sequence_number"] == seen[-1]["sequence_number"] + 1
    assert rest[-1]["type"] == "response.completed"
    checked(create, seen + rest)
    (turn,) = running.server.responses.turns  # generated once, to its end
    assert turn.status == "completed"


async def test_connections_left_only_for_kept_responses_leave_room_for_new_clients(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """Clients that dropped their streams (SSE and WebSocket alike) leave their connections
    open only for what is kept for a reattach: those do not fill --max-connections."""
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, max_connections=4
    )
    port = running.address.port
    with trio.fail_after(60):
        for _ in range(3):
            await stream_until(port, payload(), "response.output_text.delta", 2)
        for _ in range(3):
            await vanished_at(running.prototype_url, create(), "response.output_text.delta", 2,
                              LaneChecker(dialect="prototype"))  # fmt: skip
        await trio.sleep(1)
        assert running.server.open_connections == 6  # each still runs its kept Response
        assert running.server.responses.detached.holding == 6
        seen = await stream_until(port, payload(), "response.output_text.delta", 2)
        status, rest, _ = await reattach(port, seen[0]["response"]["id"], -1)
    assert status == 200 and rest[-1]["type"] == "response.completed"
    await running.server.wait_idle()  # each ran to its end, then let go
    assert running.server.responses.detached.holding == 0


async def test_a_client_killed_mid_text_reattaches_over_sse(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    await killed_and_reattached(start_server, LONG_TEXT, "response.output_text.delta")


async def test_a_client_killed_mid_arguments_reattaches_over_sse(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    await killed_and_reattached(
        start_server, LONG_ARGUMENTS, "response.function_call_arguments.delta"
    )


async def test_a_reattach_from_the_start_replays_every_event_and_one_after_the_end_too(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    port = running.address.port
    create = payload()
    with trio.fail_after(60):
        seen = await stream_until(port, create, "response.output_text.delta", 3)
        await trio.sleep(20)  # it ended meanwhile (8 s), and is kept for the grace (30 s)
        status, rest, _ = await reattach(port, seen[0]["response"]["id"], -1)
    assert status == 200
    assert [e["sequence_number"] for e in rest] == list(range(len(rest)))
    assert rest[: len(seen)] == seen
    checked(create, rest)


async def test_a_reattached_client_that_drops_again_reattaches_again(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_grace_s=3
    )
    port = running.address.port
    create = payload()
    delta = "response.output_text.delta"
    with trio.fail_after(60):
        first = await stream_until(port, create, delta, 5)
        response_id, last = first[0]["response"]["id"], first[-1]["sequence_number"]
        await trio.sleep(2)  # within the grace
        target = f"/v1/responses/{response_id}?stream=true&starting_after={last}"
        second = await stream_until(port, None, delta, 150, target=target)  # 3 s of it, read
        await trio.sleep(2)  # the clock starts again at this drop: 2 s < 3 s
        status, rest, _ = await reattach(port, response_id, second[-1]["sequence_number"])
    assert status == 200
    checked(create, first + second + rest)
    (turn,) = running.server.responses.turns
    assert turn.status == "completed"


async def test_another_key_cannot_reattach(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    port = running.address.port
    with trio.fail_after(60):
        seen = await stream_until(port, payload(), "response.output_text.delta", 3)
        response_id = seen[0]["response"]["id"]
        status, _, error = await reattach(port, response_id, 0, key="k2")
        assert status == 404 and error is not None and error["code"] == "response_not_found"
        status, rest, _ = await reattach(port, response_id, seen[-1]["sequence_number"])
    assert status == 200 and rest[-1]["type"] == "response.completed"


async def test_a_reattach_after_events_past_the_bound_is_told_what_was_lost(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_keep_bytes=4096
    )
    port = running.address.port
    with trio.fail_after(60):
        seen = await stream_until(port, payload(), "response.output_text.delta", 3)
        await trio.sleep(4)  # 200 deltas, far past 4 KiB
        status, _, error = await reattach(port, seen[0]["response"]["id"], 1)
    assert status == 410 and error is not None
    assert error["code"] == "reattach_events_lost"
    assert error["param"] == "starting_after"
    assert "the first kept is" in error["message"]
    assert running.server.responses.memory.used < 4096 + 8192  # kept events are charged, bounded


async def test_the_grace_lapses_without_a_reattach_and_the_response_is_cancelled(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_grace_s=2
    )
    port = running.address.port
    with trio.fail_after(60):
        seen = await stream_until(port, payload(), "response.output_text.delta", 3)
        await running.server.wait_idle()
        assert trio.current_time() < 8  # cut after its grace, long before its end
        status, _, error = await reattach(port, seen[0]["response"]["id"], 0)
    assert status == 404 and error is not None
    assert not running.server.responses.turns  # it never ran to its end
    assert running.server.responses.memory.used == 0


async def test_grace_0_cancels_a_response_whose_client_left_at_once(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_grace_s=0
    )
    port = running.address.port
    with trio.fail_after(60):
        seen = await stream_until(port, payload(), "response.output_text.delta", 3)
        await running.server.wait_idle()
        assert trio.current_time() < 1
        status, _, error = await reattach(port, seen[0]["response"]["id"], 0)
    assert status == 404 and error is not None and error["code"] == "response_not_found"
    assert not running.server.responses.turns


# -- over the prototype WebSocket dialect ---------------------------------------------------


async def vanished_at(
    url: str, frame: dict[str, Any], leave_at: str, count: int, checker: LaneChecker
) -> list[dict[str, Any]]:
    """Send `frame`, read until `count` events of type `leave_at` came, then drop the TCP
    connection without a close frame: the events this client saw."""
    seen: list[dict[str, Any]] = []
    async with connect(url, Authorization="Bearer k1") as client:
        checker.sent(frame)
        await client.send(frame)
        while sum(e["type"] == leave_at for e in seen) < count:
            seen.append(await client.receive())
            checker.received(seen[-1])
        await client.vanish()
    return seen


async def killed_and_reattached_over_websocket(
    start_server: StartServer, script: dict[str, Any], leave_at: str
) -> None:
    running = await start_server(script, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        seen = await vanished_at(running.prototype_url, create(), leave_at, 5, checker)
        response_id = seen[0]["response"]["id"]
        await trio.sleep(1)  # the Response runs on meanwhile
        reattach = {"type": "response.reattach", "response_id": response_id,
                    "starting_after": seen[-1]["sequence_number"]}  # fmt: skip
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            await client.send(reattach)
            rest = await client.until("response.done", "response.completed", "error")
            for event in rest:
                checker.received(event)
            assert rest[0]["sequence_number"] == seen[-1]["sequence_number"] + 1
            if rest[-1]["type"] == "response.done":  # then appended to as usual
                append = {"type": "response.append", "input": answers(seen + rest)}
                checker.sent(append)
                await client.send(append)
                for event in await client.until("response.completed"):
                    checker.received(event)
    checker.finish()
    (turn,) = running.server.responses.turns  # generated once, to its end
    assert turn.status == "completed"


async def test_a_client_killed_mid_text_reattaches_over_the_prototype_websocket(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    await killed_and_reattached_over_websocket(
        start_server, LONG_TEXT, "response.output_text.delta"
    )


async def test_a_client_killed_mid_arguments_reattaches_over_the_prototype_websocket(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    await killed_and_reattached_over_websocket(
        start_server, LONG_ARGUMENTS, "response.function_call_arguments.delta"
    )


async def test_a_steers_answer_is_kept_with_the_events_it_came_between(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """What answers a client's frame mid-stream (here `response.steer.accepted`) is numbered
    among the Response's events: a replay across it has no gap."""
    script = {"segments": [{"text": "word " * 400}, {"text": "Tabs it is."}]}
    running = await start_server(script, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            checker.sent(create())
            await client.send(create())
            seen = await client.until("response.output_text.delta")
            steer = {"type": "response.steer", "previous_response_id": seen[0]["response"]["id"],
                     "input": "Use tabs."}  # fmt: skip
            checker.sent(steer)
            await client.send(steer)
            seen += await client.until("response.steer.accepted")
            seen += [await client.receive() for _ in range(3)]
            for event in seen:
                checker.received(event)
            await client.vanish()
        before_steer = next(e for e in seen if e["type"] == "response.steer.accepted")
        after = before_steer["sequence_number"] - 1
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            response_id = seen[0]["response"]["id"]
            reattach = {"type": "response.reattach", "response_id": response_id}
            await client.send({**reattach, "starting_after": after})
            rest = await client.until("response.completed")
    numbers = [e["sequence_number"] for e in rest]
    assert numbers == list(range(after + 1, after + 1 + len(numbers)))  # no gap
    assert rest[0]["type"] == "response.steer.accepted"
    for event in rest[len(seen) - after - 1 :]:
        checker.received(event)
    checker.finish()


async def test_a_reattach_ahead_of_the_old_connections_end_waits_for_it(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """A client may reattach before the server has seen its old connection end (it closed it,
    and the new connection came first): the reattach waits for that end, up to 2 s, then
    replays; while the old connection still streams after that, it is refused."""
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        async with connect(running.prototype_url, Authorization="Bearer k1") as old:
            checker.sent(create())
            await old.send(create())
            seen = await old.until("response.output_text.delta")
            response_id = seen[0]["response"]["id"]
            reattach = {"type": "response.reattach", "response_id": response_id,
                        "starting_after": seen[-1]["sequence_number"]}  # fmt: skip
            async with connect(running.prototype_url, Authorization="Bearer k1") as early:
                await early.send(reattach)
                refused = await early.receive()  # the old connection streams on: not gone
                assert refused["type"] == "error"
                assert refused["error"]["code"] == "response_in_progress"
            async with connect(running.prototype_url, Authorization="Bearer k1") as new:
                await new.send(reattach)
                await trio.sleep(0.5)
                await old.vanish()  # its end comes after the reattach
                rest = await new.until("response.completed")
    for event in seen + rest:
        checker.received(event)
    checker.finish()
    assert rest[0]["sequence_number"] == seen[-1]["sequence_number"] + 1


async def test_a_reattach_with_nothing_left_to_replay_goes_on_with_the_responses_numbers(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """A client that saw every event kept so far (it reattached at once) is sent the rest
    numbered on from them, not from its new lane's 0."""
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    responses = running.server.responses
    with trio.fail_after(60):
        seen = await vanished_at(running.prototype_url, create(), "response.output_text.delta",
                                 5, LaneChecker(dialect="prototype"))  # fmt: skip
        response_id = seen[0]["response"]["id"]
        await trio.testing.wait_all_tasks_blocked()  # the server saw the drop
        assert responses.detached.holding == 1
        owner = responses.tenants.owner("Bearer k1")
        assert owner is not None
        kept = responses.detached.find(response_id, owner)
        assert kept is not None
        last = kept.next - 1  # every event kept so far: nothing to replay after it
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            await client.send({"type": "response.reattach", "response_id": response_id,
                               "starting_after": last})  # fmt: skip
            rest = await client.until("response.completed")
    assert [e["sequence_number"] for e in rest] == list(range(last + 1, last + 1 + len(rest)))


async def test_another_key_cannot_reattach_over_the_websocket(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    checker = LaneChecker(dialect="prototype")
    delta = "response.output_text.delta"
    with trio.fail_after(60):
        seen = await vanished_at(running.prototype_url, create(), delta, 3, checker)
        await trio.sleep(1)
        reattach = {"type": "response.reattach", "response_id": seen[0]["response"]["id"]}
        async with connect(running.prototype_url, Authorization="Bearer k2") as client:
            await client.send(reattach)
            (error,) = await client.until("error")
    assert error["error"]["code"] == "response_not_found"


async def test_grace_0_cancels_a_websocket_response_at_once(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_grace_s=0
    )
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        await vanished_at(running.prototype_url, create(), "response.output_text.delta", 3, checker)
        await running.server.wait_idle()
        assert trio.current_time() < 1
    assert not running.server.responses.turns


async def test_a_websocket_reattach_past_the_bound_is_told_what_was_lost(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_keep_bytes=4096
    )
    checker = LaneChecker(dialect="prototype")
    delta = "response.output_text.delta"
    with trio.fail_after(60):
        seen = await vanished_at(running.prototype_url, create(), delta, 3, checker)
        await trio.sleep(4)  # 200 deltas, far past 4 KiB
        reattach = {"type": "response.reattach", "response_id": seen[0]["response"]["id"],
                    "starting_after": 1}  # fmt: skip
        async with connect(running.prototype_url, Authorization="Bearer k1") as client:
            await client.send(reattach)
            (error,) = await client.until("error")
    assert error["error"]["code"] == "reattach_events_lost"
    assert "the first kept is" in error["error"]["message"]


async def test_a_websocket_response_not_reattached_is_cut_when_its_grace_lapses(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, reattach_grace_s=2
    )
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        await vanished_at(running.prototype_url, create(), "response.output_text.delta", 3, checker)
        await running.server.wait_idle()
        assert 2 <= trio.current_time() < 8  # cut after its grace, long before its end
    assert not running.server.responses.turns
    assert running.server.responses.memory.used == 0


async def test_a_stopping_server_does_not_wait_for_a_reattach(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS)
    checker = LaneChecker(dialect="prototype")
    with trio.fail_after(60):
        await vanished_at(running.prototype_url, create(), "response.output_text.delta", 3, checker)
        await trio.sleep(0.5)
        await running.server.shutdown(grace_s=1)
        await running.server.wait_idle()
    assert trio.current_time() < 8  # neither its grace (30 s) nor its end (8 s) was waited for
    assert not running.server.responses.turns


def test_what_is_kept_is_sized_without_encoding_a_large_event_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a small event is charged its JSON exactly; one that echoes many tools (the writer encodes
    # such an event off the loop) is charged the least its JSON takes, and is not encoded here
    template = response_template(
        ResponseCreate(input="hi"), response_id="r", created_at=0, default_model="m"
    )
    small = ResponseCompleted(response=template)
    assert kept_bytes(small, 7) == len(encode_server_event_bytes(small, 7))
    tools = tuple(FunctionTool(name=f"t{i}") for i in range(2_000))
    large = ResponseCompleted(response=attrs.evolve(template, tools=tools))

    def encoded_on_the_loop(*_: object) -> bytes:
        raise AssertionError("a large event was encoded on the event loop to be sized")

    monkeypatch.setattr(kept_module, "encode_server_event_bytes", encoded_on_the_loop)
    assert kept_bytes(large, 7) == echoed_bytes(large) > INLINE_BYTES
