"""The published Open Responses schema: on every path, over every transport, in both dialects.

Each test here validates what its client received itself (`wire_schema()`), beside the net
that conftest.py puts around every test; the last ones show that the validator can fail.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import orjson
import pytest
import trio

from proto_server.testing import InvariantViolation, StreamChecker, WireClient
from proto_server.testing.schema import (
    EXTENSION_EVENTS,
    SPEC_PATH,
    SchemaViolation,
    WireSchema,
    wire_schema,
)

from ..support.clients import connect, parse_sse
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.published import SchemaNet
from ..support.servers import StartServer

SCHEMA = wire_schema()
SCHEMA_DOCUMENT: Any = orjson.loads(SPEC_PATH.read_bytes())
TOOLS = [EXEC_COMMAND, {"type": "custom", "name": "apply_patch"}, {"type": "web_search"}]
ANSWER = "Fixed: the loop was off by one."


def create(**fields: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": "m", "input": "fix it", "tools": TOOLS, **fields}


async def valid_until(client: WireClient, *types: str) -> list[dict[str, Any]]:
    events = await client.until(*types)
    for event in events:
        SCHEMA.check_event(event)
    return events


def outputs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    return [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
        for c in calls
        if c["type"] == "function_call"
    ]


async def test_prototype_paths_validate(
    start_server: StartServer, published_schema: SchemaNet
) -> None:
    """Suspended (`response.done`), resumed, completed, cancelled and refused, as sent."""
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.prototype_url) as client:
            await client.send(create(reasoning={"effort": "low"}, text={"verbosity": "low"}))
            segment = await valid_until(client, "response.done")
            response = segment[-1]["response"]
            assert response["reasoning"] == {"effort": "low", "summary": None}
            assert response["text"] == {"format": {"type": "text"}, "verbosity": "low"}
            assert response["completed_at"] is None
            await client.send({"type": "response.append", "input": outputs(segment)})
            segment = await valid_until(client, "response.done")
            await client.send({"type": "response.append", "input": outputs(segment)})
            done = (await valid_until(client, "response.completed"))[-1]["response"]
            assert done["completed_at"] >= done["created_at"]
            assert done["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
            # cancelled, then an error event for a frame that cannot be served
            await client.send(create())
            await valid_until(client, "response.done")
            await client.send({"type": "response.cancel"})
            cancelled = (await valid_until(client, "response.cancelled"))[-1]["response"]
            assert (cancelled["status"], cancelled["completed_at"]) == ("cancelled", None)
            await client.send({"type": "response.nonsense"})
            await valid_until(client, "error")
    assert published_schema.validate() == []
    assert published_schema.checked["websocket"] > 20


async def test_launched_paths_validate(start_server: StartServer) -> None:
    """A warm-up, chained turns, a failure and an incomplete Response, in the launched dialect."""
    script = {
        "segments": [
            {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
            {"text": ANSWER},
            {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        ]
    }
    running = await start_server(script)
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            await client.send(create(generate=False))
            warm = (await valid_until(client, "response.completed"))[-1]["response"]
            assert warm["output"] == []
            await client.send(create(previous_response_id=warm["id"], input=[]))
            turn = await valid_until(client, "response.completed")
            await client.send(
                create(previous_response_id=turn[-1]["response"]["id"], input=outputs(turn))
            )
            await valid_until(client, "response.completed")
            # a call under tool_choice none: the script cannot be served, the Response fails
            await client.send(create(tool_choice="none"))
            failed = (await valid_until(client, "response.failed"))[-1]["response"]
            assert failed["error"]["code"] == "script_error" and failed["completed_at"] is None
            await client.send(create(previous_response_id="resp_gone", store=False))
            await valid_until(client, "error")
    running = await start_server({"segments": [{"text": ANSWER}]})
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            await client.send(create(max_output_tokens=2))
            cut = (await valid_until(client, "response.incomplete"))[-1]["response"]
            assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_http_paths_validate(start_server: StartServer) -> None:
    """SSE events, a JSON Response, a stored one fetched again, a compaction and errors."""
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    body = {"model": "m", "input": "fix it", "tools": TOOLS, "store": True}
    with trio.fail_after(20):
        async with httpx.AsyncClient() as http:
            streamed = await http.post(url, json={**body, "stream": True})
            for event in parse_sse(streamed.text):
                SCHEMA.check_event(event, transport="sse")
            plain = await http.post(url, json=body)
            SCHEMA.check_body("/v1/responses", plain.status_code, plain.json())
            stored = await http.get(f"{url}/{plain.json()['id']}")
            SCHEMA.check_body(f"/v1/responses/{plain.json()['id']}", 200, stored.json())
            compacted = await http.post(
                f"{url}/compact",
                json={"model": "m", "input": [{"role": "user", "content": "fix it"}]},
            )
            result = compacted.json()
            SCHEMA.check_compaction(result)
            assert result["output"][0]["content"] == [{"type": "input_text", "text": "fix it"}]
            for path, answer in [
                ("/v1/responses/resp_missing", await http.get(f"{url}/resp_missing")),
                ("/v1/responses", await http.post(url, json={"model": 3})),
                ("/v1/responses/compact", await http.post(f"{url}/compact", json={})),
            ]:
                assert answer.status_code >= 400
                SCHEMA.check_body(path, answer.status_code, answer.json())


JSON_FORMAT = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("fields", "echoed"),
    [
        ({"reasoning": {"summary": "auto"}}, ("reasoning", {"effort": None, "summary": "auto"})),
        (
            {"reasoning": {"effort": "minimal"}},
            ("reasoning", {"effort": "minimal", "summary": None}),
        ),
        (
            {"reasoning": {"effort": "high", "summary": "none"}},
            ("reasoning", {"effort": "high", "summary": None}),
        ),
        (
            {"text": {"format": JSON_FORMAT}},
            ("text", {"format": {**JSON_FORMAT, "description": None, "strict": False}}),
        ),
        ({"tool_choice": {"type": "custom", "name": "apply_patch"}}, None),
        ({"truncation": "auto", "service_tier": "flex", "top_logprobs": 3}, None),
        ({"presence_penalty": 0.5, "frequency_penalty": -0.5}, ("presence_penalty", 0.5)),
    ],
)
async def test_what_a_create_asks_for_is_echoed_as_the_schema_has_it(
    start_server: StartServer, fields: dict[str, Any], echoed: tuple[str, Any] | None
) -> None:
    """Codex sends half a `reasoning` and a `text` without `format`; the echo is whole."""
    running = await start_server({"segments": [{"text": ANSWER}]})
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            await client.send(create(**fields))
            response = (await valid_until(client, "response.completed"))[-1]["response"]
    if echoed is not None:
        assert response[echoed[0]] == echoed[1]


def response_object() -> dict[str, Any]:
    """A valid Response object, as this server sends one."""
    example = SCHEMA_DOCUMENT["components"]["schemas"]["ResponseResource"]["example"]
    response = copy.deepcopy(example)
    response["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    response.update(
        incomplete_details=None, previous_response_id=None, instructions=None, error=None,
        max_output_tokens=None, max_tool_calls=None, safety_identifier=None,
        prompt_cache_key=None, reasoning=None,
    )  # fmt: skip
    return response


def event(kind: str, response: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "sequence_number": 0, "response": response}


def test_the_validator_passes_a_good_response_and_names_what_is_missing() -> None:
    good = response_object()
    SCHEMA.check_response(good)
    for field in ("completed_at", "presence_penalty", "frequency_penalty"):
        bad = {k: v for k, v in good.items() if k != field}
        with pytest.raises(SchemaViolation, match=f"'{field}' is a required property"):
            SCHEMA.check_response(bad)
    # OpenAI's own API requires more than the document: cache_write_tokens
    del good["usage"]["input_tokens_details"]["cache_write_tokens"]
    with pytest.raises(SchemaViolation, match="cache_write_tokens"):
        SCHEMA.check_response(good)


def test_items_and_tools_are_checked() -> None:
    SCHEMA.check_item({"type": "compaction", "id": "cmp_1", "encrypted_content": "x.y"})
    with pytest.raises(SchemaViolation, match="encrypted_content"):
        SCHEMA.check_item({"type": "compaction", "id": "cmp_1", "encrypted_content": None})
    with pytest.raises(SchemaViolation):
        SCHEMA.check_item({"type": "message", "id": None, "role": "user", "content": "hi"})
    good = response_object()
    carried = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]
    SCHEMA.check_response({**good, "tools": carried})  # echoed as sent: carried
    for bad in ("bare_name", {"type": "function", "name": "f"}):  # a function tool is checked
        with pytest.raises(SchemaViolation, match=r"tools\[0\]"):
            SCHEMA.check_response({**good, "tools": [bad]})


def test_the_errata_are_narrow() -> None:
    """What the overlay settles lets in what the document meant, not anything."""
    good = response_object()
    SCHEMA.check_response({**good, "reasoning": {"effort": "minimal", "summary": None}})
    with pytest.raises(SchemaViolation, match="effort"):
        SCHEMA.check_response({**good, "reasoning": {"effort": "maximal", "summary": None}})
    form = {**JSON_FORMAT, "description": None, "strict": True}
    SCHEMA.check_response({**good, "text": {"format": form}})
    with pytest.raises(SchemaViolation, match="schema"):
        SCHEMA.check_response({**good, "text": {"format": {**form, "schema": "an object"}}})
    SCHEMA.check_response({**good, "tool_choice": {"type": "custom", "name": "apply_patch"}})
    with pytest.raises(SchemaViolation, match="tool_choice"):
        SCHEMA.check_response({**good, "tool_choice": {"type": "allowed_tools"}})


def test_events_outside_the_schema_are_exactly_the_listed_extensions() -> None:
    good = response_object()
    assert set(EXTENSION_EVENTS) == {"response.done", "response.cancelled"}
    SCHEMA.check_event(event("response.done", {**good, "status": "in_progress"}))
    SCHEMA.check_event(event("response.cancelled", {**good, "status": "cancelled"}))
    with pytest.raises(SchemaViolation, match="'in_progress' was expected"):
        SCHEMA.check_event(event("response.done", good))  # a suspension is in_progress
    with pytest.raises(SchemaViolation, match="neither in the schema nor a listed extension"):
        SCHEMA.check_event(event("response.finished", good))
    # a published event is checked by its own schema, its Response included
    SCHEMA.check_event(event("response.completed", good))
    with pytest.raises(SchemaViolation, match="completed_at"):
        SCHEMA.check_event(
            event("response.completed", {k: v for k, v in good.items() if k != "completed_at"})
        )
    # a WebSocket error must carry `status`; over SSE it need not
    error = {
        "type": "error",
        "sequence_number": 3,
        "error": {"type": "invalid_request_error", "code": "x", "message": "m", "param": None},
    }
    SCHEMA.check_event(error, transport="sse")
    with pytest.raises(SchemaViolation, match="status"):
        SCHEMA.check_event(error)
    SCHEMA.check_event({**error, "status": 400})


def test_the_checker_fails_an_event_off_the_schema_as_invariant_8() -> None:
    checker = StreamChecker(dialect="launched", schema=SCHEMA)
    checker.sent(create())
    fresh = {**response_object(), "status": "in_progress", "output": [], "completed_at": None}
    broken = {k: v for k, v in fresh.items() if k != "frequency_penalty"}
    with pytest.raises(InvariantViolation) as caught:
        checker.received(event("response.created", broken))
    assert caught.value.invariant == 8
    assert "frequency_penalty" in str(caught.value)
    # without a schema the same stream is the checker's business only
    plain = StreamChecker(dialect="launched")
    plain.sent(create())
    plain.received(event("response.created", broken))


def test_a_document_can_be_given() -> None:
    """The validator reads the document it is given (here one whose Usage needs more)."""
    document = copy.deepcopy(SCHEMA_DOCUMENT)
    document["components"]["schemas"]["Usage"]["required"].append("tool_usage")
    with pytest.raises(SchemaViolation, match="tool_usage"):
        WireSchema(document).check_response(response_object())


def test_the_net_fails_a_test_for_what_a_server_sent_off_the_schema() -> None:
    net = SchemaNet()  # not installed: fed by hand
    net.event(orjson.dumps(event("response.created", {"id": "resp_1"})).decode(), "websocket")
    net.body("/v1/responses/compact", 200, b'{"object": "response.compaction"}')
    net.body("", 500, b'{"error": {"message": "no type, no code"}}')
    found = net.validate()
    assert len(found) == 3
    assert "response.created at $.response" in found[0] and "CompactResource" in found[1]
    with pytest.raises(pytest.fail.Exception, match="3 things the server sent"):
        net.verdict()
