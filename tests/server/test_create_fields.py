"""More of today's `response.create`: `prompt_cache_options.prewarm` is a warm-up,
`context_management` compacts a turn whose prompt is over its threshold before the model reads
it, `conversation` is refused naming the field, and every new field is checked with a typed
error over both WebSocket dialects and HTTP. Real clients: the openai SDK sends the fields as
its own parameters."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
import trio
from openai import OpenAI

from proto_server.core.compaction import summary_of
from proto_server.core.reasoning import REASONING_EFFORTS, REASONING_SUMMARIES, echoed_reasoning
from proto_server.core.request import check_create
from proto_server.engine.harmony_renderer import EFFORTS
from proto_server.testing import StreamChecker, o200k_count
from proto_server.wire.converter import decode_client_event
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate
from proto_server.wire.items import UnknownItem

from ..support.clients import connect, in_thread, parse_sse, turn
from ..support.frames import (
    EXEC_COMMAND,
    THREE_SEGMENTS,
    USER,
    answers,
    body,
    create,
    launched_create,
    prefix_tokens,
    tokens,
)
from ..support.servers import StartServer

COMPACT_AT = 50  # tokens: every prompt of these tests is longer
NEVER = 1_000_000


def compaction(threshold: int) -> list[dict[str, Any]]:
    return [{"type": "compaction", "compact_threshold": threshold}]


#: A create's new fields, wrong, and the `param` the refusal names.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt_cache_options": "yes"}, "prompt_cache_options"),
    ({"prompt_cache_options": {"prewarm": "true"}}, "prompt_cache_options.prewarm"),
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode"),
    ({"context_management": {"type": "compaction"}}, "context_management"),
    ({"context_management": ["compaction"]}, "context_management[0]"),
    ({"context_management": [{"compact_threshold": 9}]}, "context_management[0].type"),
    ({"context_management": [{"type": "truncation"}]}, "context_management[0].type"),
    ({"context_management": [{"type": "compaction"}]}, "context_management[0].compact_threshold"),
    ({"context_management": compaction(0)}, "context_management[0].compact_threshold"),
    (
        {"context_management": [{"type": "compaction", "compact_threshold": "9"}]},
        "context_management[0].compact_threshold",
    ),
    ({"context_management": compaction(9) * 2}, "context_management[1]"),
    ({"conversation": 7}, "conversation"),
    ({"conversation": {"name": "c"}}, "conversation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"reasoning": {"effort": "banana"}}, "reasoning.effort"),
    ({"reasoning": {"effort": "x" * 1_000_000}}, "reasoning.effort"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": {"effort": "low", "summary": "verbose"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": ["auto"]}}, "reasoning.generate_summary"),
]


def refusal(fields: dict[str, Any]) -> ProtocolError:
    frame = orjson.dumps({"type": "response.create", "model": "m", **fields})
    with pytest.raises(ProtocolError) as refused:
        check_create(decode_client_event(frame))
    return refused.value


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_each_new_field_is_checked_with_its_path(fields: dict[str, Any], param: str) -> None:
    detail = refusal(fields).detail
    assert (detail.code, detail.param) == ("invalid_field", param)
    assert f"`{param}`" in detail.message


def test_a_refusal_quotes_a_huge_value_briefly() -> None:
    detail = refusal({"reasoning": {"effort": "x" * 1_000_000}}).detail
    assert len(detail.message) < 500 and "1,000,000 characters" in detail.message


@pytest.mark.parametrize("effort", [*REASONING_EFFORTS, None])
@pytest.mark.parametrize("summary", [*REASONING_SUMMARIES, None])
def test_reasoning_takes_the_apis_values_and_echoes_only_them(
    effort: str | None, summary: str | None
) -> None:
    asked = {"effort": effort, "summary": summary, "future_knob": "x" * 1000}
    event = decode_client_event(orjson.dumps({"type": "response.create", "reasoning": asked}))
    assert isinstance(event, ResponseCreate)
    check_create(event)
    echoed = {"effort": effort, "summary": None if summary == "none" else summary}
    assert echoed_reasoning(event.reasoning) == echoed


def test_harmony_says_every_effort_the_api_takes() -> None:
    assert set(EFFORTS) == set(REASONING_EFFORTS)


def test_conversation_is_refused_saying_what_to_do_instead() -> None:
    message = refusal({"conversation": "conv_1"}).detail.message
    assert "not supported" in message and "previous_response_id" in message
    both = refusal({"conversation": "conv_1", "previous_response_id": "resp_1"}).detail
    assert "previous_response_id" in both.message and both.param == "conversation"


def test_unknown_keys_inside_the_new_fields_are_ignored_as_at_the_top() -> None:
    frame = {
        "type": "response.create",
        "prompt_cache_options": {"prewarm": True, "ttl": "12h", "future_knob": 1},
        "context_management": [{"type": "compaction", "compact_threshold": 9, "keep": "all"}],
        "conversation": None,
        "brand_new_option": {"x": 1},
    }
    event = decode_client_event(orjson.dumps(frame))
    check_create(event)  # type: ignore[arg-type]


async def test_a_bad_new_field_is_refused_over_both_dialects_and_http(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(20):
        async with (
            connect(running.address.ws_url) as launched,
            connect(running.prototype_url) as prototype,
            httpx.AsyncClient() as http,
        ):
            for fields, param in BAD:
                for client, frame in ((launched, launched_create), (prototype, create)):
                    await client.send(frame(**fields))
                    error = await client.receive()
                    assert (error["type"], error["error"]["code"], error["error"]["param"]) == (
                        "error", "invalid_field", param
                    ), fields  # fmt: skip
                answer = await http.post(url, json=body(**fields))
                assert answer.status_code == 400
                assert answer.json()["error"]["param"] == param
            # the connections live on, and serve what follows
            assert (await turn(launched, launched_create()))[-1]["type"] == "response.completed"
            await prototype.send(create())
            assert (await prototype.segment())[-1]["type"] == "response.done"


async def test_the_prototype_dialect_refuses_prewarm_and_compaction_naming_them(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    refused = {
        "prompt_cache_options.prewarm": {"prompt_cache_options": {"prewarm": True}},
        "context_management": {"context_management": compaction(NEVER)},
    }
    with trio.fail_after(10):
        async with connect(running.prototype_url) as client:
            for param, fields in refused.items():
                await client.send(create(**fields))
                error = await client.receive()
                assert (error["error"]["code"], error["error"]["param"]) == (
                    "invalid_field", param
                )  # fmt: skip
                assert "prototype dialect" in error["error"]["message"]


# -- prewarm ---------------------------------------------------------------------------------


def prewarm_then_chain(http_url: str) -> tuple[list[Any], list[Any]]:
    """Through the SDK's WebSocket: a prewarm (which overrides `generate: true`), then a turn
    chained from it."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    turns: list[list[Any]] = []
    with client.responses.connect() as connection:
        connection.response.create(
            model="gpt-test",
            instructions="You fix bugs.",
            input=[USER],  # type: ignore[list-item]
            tools=[EXEC_COMMAND],  # type: ignore[list-item]
            store=False,
            generate=True,
            prompt_cache_options={"prewarm": True, "ttl": "30m"},
        )
        for follow_up in (False, True):
            if follow_up:
                connection.response.create(
                    model="gpt-test",
                    instructions="You fix bugs.",
                    previous_response_id=turns[0][-1].response.id,
                    input=[],
                    tools=[EXEC_COMMAND],  # type: ignore[list-item]
                    store=False,
                )
            events = []
            for event in connection:
                events.append(event)
                if event.type in ("response.completed", "response.failed", "error"):
                    break
            turns.append(events)
    return turns[0], turns[1]


async def test_prewarm_is_a_warm_up_over_the_sdk_websocket(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        warm, nxt = await in_thread(prewarm_then_chain, running.address.http_url)
    assert [e.type for e in warm] == [
        "response.created", "response.in_progress", "response.completed"
    ]  # fmt: skip
    warmed = warm[-1].response
    assert (warmed.output, warmed.usage.output_tokens) == ([], 0)
    usage = nxt[-1].response.usage
    # the prewarm prefilled the prompt: the next turn re-reads none of it
    assert usage.input_tokens == warmed.usage.input_tokens
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens
    assert [t.source for t in running.server.responses.turns] == ["fresh", "cache"]


def prewarm_over_http(http_url: str) -> tuple[Any, Any]:
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    warmed = client.responses.create(
        model="gpt-test",
        instructions="You fix bugs.",
        input=[USER],  # type: ignore[list-item]
        tools=[EXEC_COMMAND],  # type: ignore[list-item]
        prompt_cache_options={"prewarm": True},
        extra_body={"brand_new_option": {"x": 1}},  # unknown: accepted and ignored
    )
    answered = client.responses.create(
        model="gpt-test",
        previous_response_id=warmed.id,
        instructions="You fix bugs.",
        tools=[EXEC_COMMAND],  # type: ignore[list-item]
        input=[],
    )
    return warmed, answered


async def test_prewarm_over_http_stores_a_warm_up_to_chain_from(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        warmed, answered = await in_thread(prewarm_over_http, running.address.http_url)
    assert (warmed.status, warmed.output, warmed.usage.output_tokens) == ("completed", [], 0)
    # the first segment of the script: the prewarm generated nothing
    assert [item.type for item in answered.output] == ["message", "function_call"]


# -- server-side compaction ------------------------------------------------------------------


def compacting_rollout(http_url: str, checker: StreamChecker) -> list[list[dict[str, Any]]]:
    """Three chained turns through the SDK's WebSocket; the second asks for compaction at a
    threshold its prompt passes, the first at one it does not."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    turns: list[list[dict[str, Any]]] = []
    with client.responses.connect() as connection:
        for threshold in (NEVER, COMPACT_AT, None):
            fields: dict[str, Any] = {
                "model": "gpt-test",
                "instructions": "You fix bugs.",
                "input": answers(turns[-1]) if turns else [USER],
                "tools": [EXEC_COMMAND],
                "store": False,
            }
            if turns:
                fields["previous_response_id"] = turns[-1][-1]["response"]["id"]
            if threshold is not None:
                fields["context_management"] = compaction(threshold)
            checker.sent({"type": "response.create", **fields})
            connection.response.create(**fields)
            events = []
            for event in connection:
                events.append(event.to_dict())
                checker.received(events[-1])
                if event.type in ("response.completed", "response.failed", "error"):
                    break
            turns.append(events)
    return turns


async def test_a_turn_over_its_threshold_is_compacted_then_served_and_chained_warm(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    checker = StreamChecker(dialect="launched", count_tokens=o200k_count)
    with trio.fail_after(60):
        first, second, third = await in_thread(
            compacting_rollout, running.address.http_url, checker
        )
    checker.finish()
    r1, r2, r3 = (events[-1]["response"] for events in (first, second, third))
    # under its threshold: nothing compacted
    assert [i["type"] for i in r1["output"]] == ["message", "function_call"]
    # over it: the compaction item first, announced as the API announces it
    added, compacting, done = second[2:5]
    assert [e["type"] for e in second[2:5]] == [
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
    ]
    item = done["item"]
    assert (compacting["item_id"], compacting["output_index"]) == (item["id"], 0)
    assert added["item"] == item and set(item) == {"type", "id", "encrypted_content"}
    assert running.server.responses.compaction_key.open(item["encrypted_content"]) is not None
    summary = summary_of(UnknownItem(item))
    assert summary is not None and summary.startswith("Compacted 4 earlier items")
    # ... then the model goes on where the history was (the script's second segment), reading
    # only the compacted history: the user's message and the compaction item, cold
    assert [i["type"] for i in r2["output"]] == ["compaction", "function_call", "function_call"]
    compacted = prefix_tokens() + tokens([USER, item])
    assert r2["usage"]["input_tokens"] == compacted
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] == 0
    # the next turn chains warm from the compacted state
    assert r3["output"][0]["content"][0]["text"] == "Fixed: the loop was off by one."
    end_2 = compacted + tokens(r2["output"][1:])
    assert r3["usage"]["input_tokens_details"]["cached_tokens"] == end_2
    turns = running.server.responses.turns
    assert [t.source for t in turns] == ["fresh", "compacted", "cache"]
    # what the server rendered: the new input, then the compacted prompt
    assert turns[1].rendered_input_tokens == tokens(answers(first)) + compacted
    await running.server.wait_idle()


def compacting_over_http(http_url: str) -> tuple[Any, list[Any], Any]:
    """Over HTTP: a stored turn, a streamed one that compacts, a third chained from the store."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    common: dict[str, Any] = {
        "model": "gpt-test",
        "instructions": "You fix bugs.",
        "tools": [EXEC_COMMAND],
    }
    first = client.responses.create(input=[USER], **common)
    calls = [{"type": "response.output_item.done", "item": i.to_dict()} for i in first.output]
    stream = client.responses.create(
        previous_response_id=first.id,
        input=answers(calls),  # type: ignore[arg-type]
        context_management=compaction(COMPACT_AT),  # type: ignore[arg-type]
        stream=True,
        **common,
    )
    events = list(stream)
    second = events[-1].response
    calls = [{"type": "response.output_item.done", "item": i.to_dict()} for i in second.output]
    third = client.responses.create(
        previous_response_id=second.id,
        input=answers(calls),  # type: ignore[arg-type]
        **common,
    )
    return first, events, third


async def test_over_http_a_compacted_turn_streams_and_the_store_chain_restarts_there(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        first, events, third = await in_thread(compacting_over_http, running.address.http_url)
    assert [i.type for i in first.output] == ["message", "function_call"]  # nothing asked
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
    ]
    second = events[-1].response
    item = second.output[0].to_dict()
    assert [i.type for i in second.output] == ["compaction", "function_call", "function_call"]
    # from the store, the third turn's history is the compacted one, not the whole chain
    compacted = [USER, item, *(i.to_dict() for i in second.output[1:])]
    new = answers(
        [{"type": "response.output_item.done", "item": i.to_dict()} for i in second.output]
    )
    assert running.server.responses.turns[-1].source == "store"
    assert running.server.responses.turns[-1].rendered_input_tokens == (
        prefix_tokens() + tokens(compacted) + tokens(new)
    )
    assert third.output_text == "Fixed: the loop was off by one."


async def test_a_non_streamed_compacted_response_and_a_compacted_warm_up(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    prompt = prefix_tokens() + tokens([USER])
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            # a prompt of exactly the threshold has not passed it
            at = (await http.post(url, json=body(context_management=compaction(prompt)))).json()
            assert [i["type"] for i in at["output"]] == ["message", "function_call"]
            assert at["usage"]["input_tokens"] == prompt
            answer = await http.post(url, json=body(context_management=compaction(prompt - 1)))
            response = answer.json()
            assert [i["type"] for i in response["output"]] == [
                "compaction",
                "message",
                "function_call",
            ]
            # a warm-up over its threshold builds the compacted state: its output says so
            events = parse_sse(
                (
                    await http.post(
                        url,
                        json=body(
                            stream=True,
                            prompt_cache_options={"prewarm": True},
                            context_management=compaction(COMPACT_AT),
                        ),
                    )
                ).text
            )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
        "response.completed",
    ]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["compaction"]


def conversation_over_http(http_url: str) -> openai.BadRequestError:
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="gpt-test", input="hi", conversation="conv_1")
    return refused.value


async def test_the_sdk_hears_conversation_refused_naming_the_field(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        error = await in_thread(conversation_over_http, running.address.http_url)
    assert (error.status_code, error.code, error.param) == (400, "invalid_field", "conversation")
