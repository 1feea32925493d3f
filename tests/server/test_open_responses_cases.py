"""The Open Responses compliance cases as the suite's public version writes them.

The suite (`openresponses/openresponses`, `src/lib/compliance-tests.ts`) is not published as a
package and cannot be fetched here; the version readable in the public source index has seven
cases. Each is sent as the suite sends it (`POST /responses`, streamed where the case streams),
and over WebSocket mode (`response.create`), to the server with its built-in model; what comes
back must pass the published schema (the suite parses it with the same schema, generated) and
the case's own checks: output present, status `completed`, a `function_call` for the tool
cases, and a streamed call's added, arguments delta and done, and item done events.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from proto_server.testing.schema import wire_schema

from ..support.clients import connect, parse_sse
from ..support.servers import StartServer

SCHEMA = wire_schema()
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            }
        },
        "required": ["location"],
    },
}
SF = {"type": "message", "role": "user", "content": "What's the weather like in San Francisco?"}
#: A 1x1 PNG as a data URL (the suite's is a 32x32 heart icon; any image does here).
IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQ"
    "DwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
#: (id, request, streamed, a function_call expected)
CASES: list[tuple[str, dict[str, Any], bool, bool]] = [
    ("basic-response", {"input": [{"type": "message", "role": "user",
                                   "content": "Say hello in exactly 3 words."}]}, False, False),
    ("streaming-response", {"input": [{"type": "message", "role": "user",
                                       "content": "Count from 1 to 5."}]}, True, False),
    ("system-prompt", {"input": [
        {"type": "message", "role": "system",
         "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."},
    ]}, False, False),
    ("tool-calling", {"input": [SF], "tools": [WEATHER]}, False, True),
    ("tool-calling-streaming", {"input": [SF], "tools": [WEATHER]}, True, True),
    ("image-input", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": IMAGE},
    ]}]}, False, False),
    ("multi-turn", {"input": [
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {"type": "message", "role": "assistant",
         "content": "Hello Alice! Nice to meet you. How can I help you today?"},
        {"type": "message", "role": "user", "content": "What is my name?"},
    ]}, False, False),
]  # fmt: skip


def check_case(response: dict[str, Any], events: list[dict[str, Any]], calls: bool) -> None:
    """The suite's checks of one case, on the final Response and the events before it."""
    assert response["output"], "Response has no output items"
    if calls:
        assert any(item["type"] == "function_call" for item in response["output"])
    else:
        assert response["status"] == "completed", response["status"]
    if calls and events:
        kinds = [event["type"] for event in events]
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        for kind in ("response.output_item.added", "response.output_item.done"):
            assert any(e["type"] == kind and e["item"]["type"] == "function_call" for e in events)


@pytest.mark.parametrize(("case", "request_body", "streamed", "calls"), CASES,
                         ids=[case for case, *_ in CASES])  # fmt: skip
async def test_each_case_passes_over_http(
    start_server: StartServer, case: str, request_body: dict[str, Any], streamed: bool,
    calls: bool,
) -> None:  # fmt: skip
    running = await start_server()
    body = {"model": "proto-server", **request_body, "stream": streamed}
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=running.address.http_url) as http:
            answer = await http.post("/responses", json=body)
    assert answer.status_code == 200, answer.text
    if streamed:
        events = parse_sse(answer.text)
        for event in events:
            SCHEMA.check_event(event, transport="sse")
        assert events[-1]["type"] == "response.completed"
        response = events[-1]["response"]
    else:
        events, response = [], answer.json()
        SCHEMA.check_body("/v1/responses", 200, response)
    check_case(response, events, calls)


@pytest.mark.parametrize(("case", "request_body", "streamed", "calls"), CASES,
                         ids=[case for case, *_ in CASES])  # fmt: skip
async def test_each_case_passes_over_websocket_mode(
    start_server: StartServer, case: str, request_body: dict[str, Any], streamed: bool,
    calls: bool,
) -> None:  # fmt: skip
    running = await start_server()
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            await client.send({"type": "response.create", "model": "proto-server", **request_body})
            events = await client.until("response.completed", "response.failed", "error")
    for event in events:
        SCHEMA.check_event(event)
    assert events[-1]["type"] == "response.completed", events[-1]
    check_case(events[-1]["response"], events, calls)
