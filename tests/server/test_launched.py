"""The launched dialect: `response.create` chained by `previous_response_id`, served warm from a
connection-local cache, cold from the store, and refused when neither has it."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, ConnectionRejected

from proto_server.engine.simulated import TimingModel

from ..support.clients import connect, turn
from ..support.frames import (
    EXEC_COMMAND,
    THREE_SEGMENTS,
    USER,
    answers,
    launched_create,
    prefix_tokens,
    tokens,
)
from ..support.servers import StartServer

SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=20)


async def test_chained_turns_render_only_the_new_items(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
        r1 = first[-1]["response"]
        assert (r1["status"], [i["type"] for i in r1["output"]]) == (
            "completed", ["message", "function_call"]
        )  # fmt: skip
        new_2 = answers(first)
        second = await turn(client, launched_create(previous_response_id=r1["id"], input=new_2))
        r2 = second[-1]["response"]
        assert r2["previous_response_id"] == r1["id"]
        assert [i["type"] for i in r2["output"]] == ["function_call", "function_call"]
        new_3 = answers(second)
        third = await turn(client, launched_create(previous_response_id=r2["id"], input=new_3))
        r3 = third[-1]["response"]
        assert r3["output"][0]["content"][0]["text"] == "Fixed: the loop was off by one."

    # one connection, sequence numbers run on across its Responses
    events = first + second + third
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e["response"]["id"] for e in events if "response" in e}) == 3

    t1, t2, t3 = running.server.responses.turns
    assert (t1.source, t2.source, t3.source) == ("fresh", "cache", "cache")
    # turn 1 renders everything; turns 2 and 3 render exactly their new items
    prompt_1 = prefix_tokens() + tokens([USER])
    assert t1.rendered_input_tokens == prompt_1
    assert t2.rendered_input_tokens == tokens(new_2)
    assert t3.rendered_input_tokens == tokens(new_3)
    # and the model re-reads nothing it already holds
    end_1 = prompt_1 + tokens(r1["output"])
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] == end_1
    assert r2["usage"]["input_tokens"] == end_1 + tokens(new_2)
    end_2 = r2["usage"]["input_tokens"] + tokens(r2["output"])
    assert r3["usage"]["input_tokens_details"]["cached_tokens"] == end_2
    assert r3["usage"]["input_tokens"] == end_2 + tokens(new_3)
    await running.server.wait_idle()


async def test_a_warm_up_says_nothing_and_the_next_turn_chains_from_it(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        warm = await turn(client, launched_create(generate=False))
        assert [e["type"] for e in warm] == [
            "response.created", "response.in_progress", "response.completed"
        ]  # fmt: skip
        warmed = warm[-1]["response"]
        assert warmed["output"] == []
        assert warmed["usage"]["output_tokens"] == 0
        nxt = await turn(client, launched_create(previous_response_id=warmed["id"], input=[]))
        usage = nxt[-1]["response"]["usage"]
        # the warm-up prefilled the prompt: nothing is re-read
        assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"]
        assert usage["input_tokens"] == warmed["usage"]["input_tokens"]
    assert running.server.responses.turns[-1].source == "cache"
    assert running.server.responses.turns[-1].rendered_input_tokens == 0


async def test_a_huge_unknown_previous_response_id_earns_a_small_error(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        huge = "resp_" + "x" * 100_000
        await client.send(launched_create(previous_response_id=huge, input=[]))
        frame = await client.ws.get_message()
    assert len(frame) < 1024 and "previous_response_not_found" in frame


async def test_a_miss_with_store_false_is_refused(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
        refused = await turn(client, launched_create(previous_response_id="resp_unknown", input=[]))
        assert refused[-1]["type"] == "error"
        assert refused[-1]["status"] == 400
        error = refused[-1]["error"]
        assert (error["code"], error["param"]) == (
            "previous_response_not_found", "previous_response_id"
        )  # fmt: skip
        # the miss did not disturb the cache: the real previous response still chains warm
        r1 = first[-1]["response"]
        ok = await turn(
            client, launched_create(previous_response_id=r1["id"], input=answers(first))
        )
        assert ok[-1]["type"] == "response.completed"
    assert running.server.responses.turns[-1].source == "cache"


async def test_a_miss_with_store_true_is_rebuilt_from_the_store(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create(store=True))
        r1 = first[-1]["response"]
        # written before response.completed was sent, not some time after
        assert await running.server.responses.store.get(r1["id"]) is not None
    new = answers(first)
    # a new connection has an empty cache: the chain comes back from the store, cold
    async with connect(running.address.ws_url) as client:
        second = await turn(
            client, launched_create(store=True, previous_response_id=r1["id"], input=new)
        )
    r2 = second[-1]["response"]
    assert [i["type"] for i in r2["output"]] == ["function_call", "function_call"]
    record = running.server.responses.turns[-1]
    assert record.source == "store"
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] == 0
    full = prefix_tokens() + tokens([USER]) + tokens(r1["output"]) + tokens(new)
    assert r2["usage"]["input_tokens"] == full
    assert record.rendered_input_tokens == full


async def test_a_failed_turn_evicts_what_it_chained_from(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proto_server")
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
        r1 = first[-1]["response"]
        # a request that offers no exec_command makes the scripted model fail
        failed = await turn(
            client,
            launched_create(previous_response_id=r1["id"], input=answers(first),
                   tools=[{**EXEC_COMMAND, "name": "other"}]),
        )  # fmt: skip
        assert failed[-1]["type"] == "response.failed"
        again = await turn(
            client, launched_create(previous_response_id=r1["id"], input=answers(first))
        )
        assert again[-1]["error"]["code"] == "previous_response_not_found"
    await running.server.wait_idle()
    # refused in its lane's task, said and logged where every refusal is (LaneSink.refuse)
    refused = [r for r in caplog.records if r.getMessage() == "client.refused"]
    assert [r.code for r in refused] == ["previous_response_not_found"]
    assert isinstance(refused[0].connection, int)


async def test_new_instructions_rebuild_the_prefix(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
        r1 = first[-1]["response"]
        second = await turn(
            client,
            launched_create(
                previous_response_id=r1["id"], input=answers(first), instructions="Be terse."
            ),
        )
        assert second[-1]["type"] == "response.completed"
    record = running.server.responses.turns[-1]
    assert record.source == "rebuilt"
    assert record.cached_tokens == 0


async def test_a_new_reasoning_effort_the_prefix_does_not_say_stays_warm(
    start_server: StartServer,
) -> None:
    """The effort is part of the prefix only where the model's format says it (harmony's
    system message: tests/server/test_harmony.py); the default model's does not, so a changed
    effort is served warm and echoed as asked."""
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create(reasoning={"effort": "low"}))
        r1 = first[-1]["response"]
        second = await turn(
            client,
            launched_create(
                previous_response_id=r1["id"], input=answers(first), reasoning={"effort": "low"}
            ),
        )
        r2 = second[-1]["response"]
        third = await turn(
            client,
            launched_create(
                previous_response_id=r2["id"], input=answers(second), reasoning={"effort": "high"}
            ),
        )
        assert third[-1]["type"] == "response.completed"
        assert third[-1]["response"]["reasoning"]["effort"] == "high"
    t1, t2, t3 = running.server.responses.turns
    assert (t1.source, t2.source, t3.source) == ("fresh", "cache", "cache")
    assert t3.cached_tokens > 0


async def test_a_full_history_without_previous_response_id_works(
    start_server: StartServer,
) -> None:
    """What a client that reconnects (or resumes a session) sends: everything, no id."""
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
    history = [USER, *first[-1]["response"]["output"], *answers(first)]
    async with connect(running.address.ws_url) as client:
        second = await turn(client, launched_create(input=history))
    # the script continues where the conversation was: the second segment
    assert [i["type"] for i in second[-1]["response"]["output"]] == [
        "function_call", "function_call"
    ]  # fmt: skip
    assert running.server.responses.turns[-1].source == "fresh"


async def test_creates_queue_in_order_behind_the_one_in_flight(start_server: StartServer) -> None:
    running = await start_server(
        {"segments": [{"text": "one two three four five"}]}, timing=SLOW, max_queued_requests=1
    )
    async with connect(running.address.ws_url) as client:
        await client.send(launched_create(tools=[]))
        await client.until("response.output_text.delta")
        await client.send(launched_create(tools=[], input="second"))  # waits in the queue
        await client.send(launched_create(tools=[], input="third"))  # the queue is full
        events = await client.until("error")
        assert events[-1]["error"]["code"] == "concurrent_request"
        events += await client.until("response.completed")
        events += await client.until("response.completed")
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    completed = [e["response"]["id"] for e in events if e["type"] == "response.completed"]
    assert len(created) == 1  # the first was created before we started collecting
    assert completed[1] == created[0]
    # the second Response began only after the first completed
    types = [e["type"] for e in events]
    assert types.index("response.created") > types.index("response.completed")


async def test_response_append_is_a_prototype_event(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url) as client:
        refused = await turn(client, {"type": "response.append", "input": []})
    assert refused[-1]["error"]["code"] == "unknown_event_type"
    assert "previous_response_id" in refused[-1]["error"]["message"]


async def test_the_connection_lifetime_is_capped(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(THREE_SEGMENTS, max_connection_lifetime_s=5.0)
    async with connect(running.address.ws_url) as client:
        first = await turn(client, launched_create())
        assert first[-1]["type"] == "response.completed"
        start = trio.current_time()
        limit = await client.receive()
        assert trio.current_time() - start == pytest.approx(5.0, abs=0.5)
        assert limit["type"] == "error"
        assert limit["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosed) as closed:
            await client.receive()
    assert closed.value.reason.code == 1000
    await running.server.wait_idle()


@pytest.mark.parametrize(
    ("headers", "accepted"),
    [
        ({}, False),
        ({"Authorization": "Bearer wrong"}, False),
        ({"Authorization": "Bearer k2"}, True),
    ],
)
async def test_api_keys_are_checked_at_the_handshake(
    start_server: StartServer, headers: dict[str, str], accepted: bool
) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1", "k2"))
    if not accepted:
        with pytest.raises(ConnectionRejected) as rejected:
            async with connect(running.address.ws_url, **headers):
                pass
        assert rejected.value.status_code == 401
        assert b"invalid_api_key" in (rejected.value.body or b"")
        return
    async with connect(running.address.ws_url, **headers) as client:
        done = await turn(client, launched_create())
    assert done[-1]["type"] == "response.completed"
