"""Structured output (`text.format`) with the default model: the answer is an instance.

`json_schema` (strict or not) answers an instance of the schema, `json_object` a JSON object,
streamed as ordinary `output_text` deltas over HTTP and WebSocket alike; a malformed format or
an over-budget schema is a 400 (an `error` event over WebSocket) naming the field or the path
inside the schema, before any event. The real openai-python client's `responses.parse` and
LangChain's `with_structured_output` get a parsed instance. The local and vLLM generators'
grammars are tested in test_local_guidance.py, test_local_model.py and test_vllm.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import httpx
import jsonschema
import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from proto_server.core.text_format import TextFormat, parse_text_format
from proto_server.core.tool_schema import MAX_SCHEMA_DEPTH
from proto_server.engine.examples import example_value
from proto_server.wire.errors import ProtocolError

from ..support.clients import END, connect, in_thread, sse
from ..support.frames import answers, body, create
from ..support.servers import StartServer

#: What a strict schema from openai-python looks like: every property required, no others,
#: nested models under `$defs`.
TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 40},
        "priority": {"type": "string", "enum": ["low", "high"]},
        "estimate": {"type": "integer", "minimum": 2, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "owner": {"anyOf": [{"$ref": "#/$defs/Person"}, {"type": "null"}]},
    },
    "required": ["title", "priority", "estimate", "tags", "owner"],
    "additionalProperties": False,
    "$defs": {
        "Person": {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"}},
            "required": ["email"],
            "additionalProperties": False,
        }
    },
}


def schema_format(schema: Any, *, strict: bool = True) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "ticket", "schema": schema, "strict": strict}}


def valid(instance: Any, schema: Any) -> None:
    """`instance` follows `schema`, formats included."""
    validator = jsonschema.Draft202012Validator
    validator(schema, format_checker=validator.FORMAT_CHECKER).validate(instance)


def output_text(response: dict[str, Any]) -> str:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    return "".join(part["text"] for part in message["content"])


# -- the default model's instances --------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "cmd", "path", "city", "url", "count"])
LEAVES = st.one_of(
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 10),
    ),
    st.builds(
        lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span},
        st.integers(0, 30),
        st.integers(0, 5),
    ),
    st.sampled_from(
        [
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "string"},
            {"type": "string", "format": "date-time"},
            {"type": "string", "format": "uuid"},
            {"type": ["string", "null"]},
            {"const": "fixed"},
        ]
    ),
    st.lists(st.text(max_size=5), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _object(properties: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Every property required, in their order (a grammar writes them in that order)."""
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {**schema, "additionalProperties": False} if strict else schema


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(_object, st.dictionaries(NAMES, inner, max_size=4), st.booleans()),
        st.builds(
            lambda items, least: {"type": "array", "items": items, "minItems": least},
            inner,
            st.integers(0, 3),
        ),
        st.lists(inner, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(SCHEMAS)
def test_the_default_model_builds_an_instance_of_small_schemas(schema: dict[str, Any]) -> None:
    valid(example_value(schema), schema)


def test_a_format_is_parsed_or_refused_naming_the_field() -> None:
    assert parse_text_format(None) is None
    assert parse_text_format({"format": {"type": "text"}}) is None
    assert parse_text_format({"verbosity": "low"}) is None
    assert parse_text_format({"format": {"type": "json_object"}}) == TextFormat(kind="json_object")
    form = parse_text_format(schema_format(TICKET, strict=False))
    assert form == TextFormat(kind="json_schema", schema=TICKET, strict=False, name="ticket")
    for text, param in [
        ({"format": {"type": "yaml"}}, "text.format.type"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "schema": []}}, "text.format.schema"),
    ]:
        with pytest.raises(ProtocolError) as refused:
            parse_text_format(text)
        assert refused.value.detail.param == param


# -- over HTTP and WebSocket ---------------------------------------------------------------------


async def test_json_schema_is_answered_with_an_instance_over_http(
    start_server: StartServer,
) -> None:
    running = await start_server()
    url = f"{running.address.http_url}/responses"
    async with httpx.AsyncClient() as http:
        for strict in (True, False):
            answer = await http.post(
                url, json=body(tools=[], text=schema_format(TICKET, strict=strict))
            )
            assert answer.status_code == 200
            response = answer.json()
            valid(orjson.loads(output_text(response)), TICKET)
            assert response["text"]["format"]["strict"] is strict
        events = await sse(http, url, body(tools=[], text=schema_format(TICKET)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    valid(orjson.loads(deltas), TICKET)
    assert output_text(events[-1]["response"]) == deltas


async def test_json_object_is_answered_with_an_object_over_websocket(
    start_server: StartServer,
) -> None:
    running = await start_server()
    async with connect(running.address.ws_url) as client:
        await client.send(create(tools=[], store=False, text={"format": {"type": "json_object"}}))
        events = await client.until(*END)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    answer = orjson.loads(deltas)
    assert isinstance(answer, dict) and "the tests fail" in answer["answer"]


async def test_with_tools_it_calls_first_then_answers_an_instance(
    start_server: StartServer,
) -> None:
    """Tools offered and a format asked: the call comes first (the agent's loop), the answer
    after the tool's output is the instance."""
    running = await start_server()
    async with connect(running.address.ws_url) as client:
        await client.send(create(store=False, text=schema_format(TICKET)))
        first = await client.until(*END)
        outputs = answers(first)
        kinds = [item["type"] for item in first[-1]["response"]["output"]]
        assert kinds == ["function_call"] and len(outputs) == 1
        await client.send(
            create(
                store=False,
                previous_response_id=first[-1]["response"]["id"],
                input=outputs,
                text=schema_format(TICKET),
            )
        )
        second = await client.until(*END)
    valid(orjson.loads(output_text(second[-1]["response"])), TICKET)


async def test_a_malformed_or_over_budget_schema_is_refused_naming_the_path(
    start_server: StartServer,
) -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    running = await start_server()
    url = f"{running.address.http_url}/responses"
    async with httpx.AsyncClient() as http:
        missing = await http.post(
            url, json=body(text={"format": {"type": "json_schema", "name": "x"}})
        )
        assert missing.status_code == 400
        assert missing.json()["error"]["param"] == "text.format.schema"
        too_deep = await http.post(url, json=body(text=schema_format(deep)))
        assert too_deep.status_code == 400
        error = too_deep.json()["error"]
        assert error["code"] == "invalid_json_schema"
        assert error["param"].startswith("text.format.schema.properties.a.properties.a")
    async with connect(running.address.ws_url) as client:
        await client.send(create(text={"format": {"type": "yaml"}}))
        event = await client.receive()
    assert event["type"] == "error" and event["error"]["param"] == "text.format.type"


# -- real clients --------------------------------------------------------------------------------


class Person(pydantic.BaseModel):
    email: str


class Ticket(pydantic.BaseModel):
    title: str
    priority: Literal["low", "high"]
    estimate: int
    tags: list[str]
    owner: Person | None


def parse_with_openai(http_url: str) -> Any:
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    response = client.responses.parse(
        model="gpt-test", input="file a ticket for the flaky test", text_format=Ticket
    )
    return response.output_parsed


async def test_openai_python_responses_parse_gets_an_instance(start_server: StartServer) -> None:
    running = await start_server()
    parsed = await in_thread(parse_with_openai, running.address.http_url)
    assert isinstance(parsed, Ticket)


class Shipment(pydantic.BaseModel):
    """Constraints openai-python sends as `pattern`, `exclusiveMinimum` and `multipleOf`."""

    code: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{2}$")
    crates: int = pydantic.Field(gt=0, multiple_of=5)
    share: float = pydantic.Field(gt=0, lt=1)
    weight: float = pydantic.Field(ge=0.5, multiple_of=0.25)


def parse_shipment_with_openai(http_url: str) -> Any:
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    response = client.responses.parse(
        model="gpt-test", input="book a shipment", text_format=Shipment
    )
    return response.output_parsed


async def test_openai_python_responses_parse_gets_a_pattern_and_multiples_honoured(
    start_server: StartServer,
) -> None:
    """Before: `code` was "example", `crates` 1 and `share` 1.0, and pydantic refused them."""
    running = await start_server()
    parsed = await in_thread(parse_shipment_with_openai, running.address.http_url)
    assert isinstance(parsed, Shipment)
    assert parsed.crates % 5 == 0 and 0 < parsed.share < 1


def structured_with_langchain(http_url: str) -> Any:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model="gpt-test", base_url=http_url, api_key="sk-test", use_responses_api=True
    )
    runnable = model.with_structured_output(Ticket)
    return asyncio.run(runnable.ainvoke("file a ticket for the flaky test"))


async def test_langchain_with_structured_output_gets_an_instance(
    start_server: StartServer,
) -> None:
    pytest.importorskip("langchain_openai")
    running = await start_server()
    parsed = await in_thread(structured_with_langchain, running.address.http_url)
    assert isinstance(parsed, Ticket)
