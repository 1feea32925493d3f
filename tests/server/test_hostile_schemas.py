"""Tool schemas and request limits that once stalled or crashed the default model.

A schema that repeats or recurses is answered in bounded time or refused at the door with
`invalid_tool_schema`; an unusual but valid schema gets a call or a text answer, never a
traceback; `max_output_tokens`, `tool_choice`, `max_tool_calls` and `parallel_tool_calls` are
honoured by the default model and the rollout script. Wall-clock bounds here are generous: each
guards a case that took seconds or hours before.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

from proto_server.core.request import check_create
from proto_server.core.tool_choice import ToolChoice, parse_tool_choice
from proto_server.core.tool_schema import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, check_tool_schemas
from proto_server.engine import default_model
from proto_server.engine.default_model import (
    _IDENTIFIER as IDENTIFIER,
)
from proto_server.engine.default_model import NAME_SEARCH_CHARS, _choose_tool
from proto_server.engine.examples import EXAMPLE_BUDGET, SchemaRefused, _Examples, example_value
from proto_server.engine.limits import GenerationLimits
from proto_server.server.listener.app import ProtoServer
from proto_server.testing import connect_checked
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate
from proto_server.wire.tools import FunctionTool

from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS, answers, create
from ..support.servers import StartServer

DEADLINE_S = 10


def nested(levels: int, repeats: int = 10) -> dict[str, Any]:
    """An object `levels` deep whose every level requires "a" `repeats` times."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"] * repeats}
    return schema


def tool(parameters: Any, name: str = "probe") -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": parameters}


def function_call(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    return next((item for item in done if item["type"] == "function_call"), None)


async def one_segment(
    start_server: StartServer, frame: dict[str, Any], script: dict[str, Any] | None = None
) -> Any:
    """The first segment the default model (or `script`) answers `frame` with."""
    running = await start_server(script)
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(frame)
            return await client.segment()


# -- finding 1: repetition and recursion are bounded -------------------------------------------


def counted_visits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sub-schemas `example_value` visits from now on: its cost, counted, not timed."""
    visits = [0]
    build = _Examples.build

    def counting(self: _Examples, *args: Any) -> Any:
        visits[0] += 1
        return build(self, *args)

    monkeypatch.setattr(_Examples, "build", counting)
    return visits


@pytest.mark.parametrize("levels", [9, 12])
def test_a_repeated_required_list_costs_one_value_per_level(
    levels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    visits = counted_visits(monkeypatch)
    value = example_value(nested(levels))
    assert visits[0] <= 2 * levels + 1  # 10^9 sub-schema visits at 9 levels before
    for _ in range(levels):
        assert list(value) == ["a"]
        value = value["a"]
    assert value == "example"


@pytest.mark.parametrize("levels", [9, 12])
async def test_a_deeply_repeated_schema_is_answered_quickly(
    start_server: StartServer, levels: int
) -> None:
    events = await one_segment(start_server, create(tools=[tool(nested(levels))]))
    call = function_call(events)
    assert call is not None and call["name"] == "probe"
    assert isinstance(orjson.loads(call["arguments"]), dict)


def test_a_schema_over_the_depth_budget_is_refused_with_its_path() -> None:
    levels = MAX_SCHEMA_DEPTH  # two JSON levels each: well past the budget
    typed = converter.structure(tool(nested(levels, repeats=1)), FunctionTool)
    with pytest.raises(ProtocolError) as refused:
        check_tool_schemas([typed])
    detail = refused.value.detail
    assert detail.code == "invalid_tool_schema"
    # the first container past the budget, under `parameters` (depth 1)
    expected = "tools[0].parameters" + ".properties.a" * (MAX_SCHEMA_DEPTH // 2)
    assert detail.param == expected and f"`{expected}`" in detail.message


def test_a_refusal_stays_small_however_long_the_names_on_its_path() -> None:
    """Before: 40 levels of one 100,000-character property name made a 3.2 MB error."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"k" * 100_000: schema}}
    with pytest.raises(ProtocolError) as refused:
        check_tool_schemas([converter.structure(tool(schema), FunctionTool)])
    detail = refused.value.detail
    assert detail.code == "invalid_tool_schema" and detail.param is not None
    assert len(detail.message) < 8_000 and len(detail.param) < 4_000
    assert detail.param.startswith("tools[0].parameters.properties." + "k" * 64 + "…")


def at_depth(depth: int) -> dict[str, Any]:
    """A schema whose JSON nests `depth` levels: itself, then lists in lists."""
    value: list[Any] = []
    for _ in range(depth - 2):
        value = [value]
    return {"type": "object", "x": value}


def test_the_depth_budget_is_exact() -> None:
    check_tool_schemas([converter.structure(tool(at_depth(MAX_SCHEMA_DEPTH)), FunctionTool)])
    with pytest.raises(ProtocolError) as refused:
        check_tool_schemas(
            [converter.structure(tool(at_depth(MAX_SCHEMA_DEPTH + 1)), FunctionTool)]
        )
    assert refused.value.detail.param == "tools[0].parameters.x" + "[0]" * (MAX_SCHEMA_DEPTH - 1)


def test_a_schema_over_the_node_budget_is_refused() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_SCHEMA_NODES)}}
    tools = [EXEC_COMMAND, tool(wide)]
    with pytest.raises(ProtocolError) as refused:
        check_tool_schemas([converter.structure(t, FunctionTool) for t in tools])
    assert refused.value.detail.code == "invalid_tool_schema"
    assert refused.value.detail.param == "tools[1].parameters"


async def test_an_over_budget_schema_gets_invalid_tool_schema_and_the_connection_lives(
    start_server: StartServer,
) -> None:
    deep = [EXEC_COMMAND, tool(nested(MAX_SCHEMA_DEPTH))]
    running = await start_server()
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(create(tools=deep))
            (error,) = await client.segment()
            assert error["type"] == "error"
            assert error["error"]["code"] == "invalid_tool_schema"
            assert error["error"]["param"].startswith("tools[1].parameters.properties.a.")
            await client.send(create())  # the same connection serves the next request
            assert (await client.segment())[-1]["type"] == "response.done"
        async with httpx.AsyncClient() as http:
            body = {k: v for k, v in create(tools=deep).items() if k != "type"}
            answer = await http.post(f"{running.address.http_url}/responses", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_tool_schema"


def test_a_ref_cycle_is_cut() -> None:
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "child": {"$ref": "#/$defs/node"}},
                "required": ["name", "child"],
            }
        },
        "$ref": "#/$defs/node",
    }
    assert example_value(schema) == {"name": "example"}
    definitions = {"definitions": {"a": {"$ref": "#/definitions/a"}}, "$ref": "#/definitions/a"}
    assert example_value(definitions) is None  # nothing but a cycle: nothing to say


def test_refs_that_double_at_every_level_are_refused_at_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30 definitions, each requiring two copies of the next: 2^30 values if followed. The walk
    stops at the budget and the schema is refused (before: an instance with parts left out,
    which the schema does not accept)."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}, "y": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x", "y"],
        }
        for i in range(30)
    }
    defs["d30"] = {"type": "integer"}
    visits = counted_visits(monkeypatch)
    with pytest.raises(SchemaRefused) as refused:
        example_value({"$defs": defs, "$ref": "#/$defs/d0"})
    assert visits[0] <= EXAMPLE_BUDGET + 1  # each visit spends, and the budget ends the walk
    assert refused.value.keyword == "$ref" and refused.value.param.startswith("$defs.d")


# -- a small schema that asks for a huge instance -------------------------------------------

#: The probe: one string property that must be a hundred million characters long.
HUGE_STRING = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 100_000_000}},
    "required": ["a"],
}

HUGE_PROBES = {
    "text.format": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": HUGE_STRING}}},
        "invalid_json_schema",
        "text.format.schema.properties.a.minLength",
    ),
    "a tool's parameters": (
        {"tools": [{"type": "function", "name": "f", "parameters": HUGE_STRING}]},
        "invalid_tool_schema",
        "tools[0].parameters.properties.a.minLength",
    ),
}


@pytest.mark.parametrize("probe", list(HUGE_PROBES))
async def test_a_tiny_request_asking_a_huge_instance_is_refused_and_the_server_serves_on(
    start_server: StartServer, probe: str
) -> None:
    """Before: the default model built the 100,000,000 characters and streamed them, 4.87 GB
    resident, nothing sent for a minute, `/healthz` unanswered. Now the Response fails at
    once with the schema's code, naming the keyword's path, having sent nothing of it."""
    fields, code, param = HUGE_PROBES[probe]
    frame = {"type": "response.create", "model": "m", "input": "hi", **fields}
    assert len(orjson.dumps(frame)) < 256  # the probe that was sent: 254 bytes
    running = await start_server()
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(frame)
            events = await client.segment()
            assert not [e for e in events if e["type"].endswith(".delta")]
            failed = events[-1]
            assert failed["type"] == "response.failed", failed
            error = failed["response"]["error"]
            assert error["code"] == code and f"`{param}`" in error["message"]
            assert "100000000" in error["message"] and "--generator" in error["message"]
            await client.send(create())  # the same connection serves the next request
            assert (await client.segment())[-1]["type"] == "response.done"
        async with httpx.AsyncClient() as http:
            assert (
                await http.get(f"http://{running.address.host}:{running.address.port}/healthz")
            ).status_code == 200
            body = {k: v for k, v in frame.items() if k != "type"}
            answer = await http.post(f"{running.address.http_url}/responses", json=body)
    response = answer.json()  # a Response that failed, as OpenAI returns one
    assert answer.status_code == 200 and response["status"] == "failed"
    assert response["error"]["code"] == code and not response["output"]


# -- finding 8: unusual schemas get a call or text, never a traceback ------------------------

UNUSUAL = {
    # arrays named `command`, `cmd` or `argv` had their items read as a schema object
    "items-as-a-list": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
        },
        "required": ["command"],
    },
    "items-true": {
        "type": "object",
        "properties": {"argv": {"type": "array", "items": True}},
        "required": ["argv"],
    },
    "items-false": {
        "type": "object",
        "properties": {"cmd": {"type": "array", "items": False}},
        "required": ["cmd"],
    },
    "minimum-a-string": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": "5"}},
        "required": ["n"],
    },
    "minimum-null": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": None}},
        "required": ["n"],
    },
    "minimum-past-2^64": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1e20}, "x": {"type": "number"}},
        "required": ["n", "x"],
    },
    "properties-a-list": {"type": "object", "properties": [{"a": 1}], "required": ["a"]},
    "required-a-string": {"type": "object", "properties": {"a": {}}, "required": "a"},
    "type-a-number": {"type": 5, "properties": {}},
    "a-string-not-an-object": {"type": "string"},
    "unresolvable-ref": {"$ref": "https://example.com/schema.json"},
}


@pytest.mark.parametrize("name", list(UNUSUAL))
async def test_an_unusual_schema_gets_a_call_or_text_and_no_traceback(
    start_server: StartServer, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    caplog.set_level(logging.WARNING, logger="proto_server")
    events = await one_segment(start_server, create(tools=[tool(UNUSUAL[name])]))
    assert events[-1]["type"] in ("response.done", "response.completed"), events[-1]
    call = function_call(events)
    if call is not None:
        assert isinstance(orjson.loads(call["arguments"]), dict)
    assert not [r for r in caplog.records if r.getMessage() == "generator.crashed"]


def test_unusual_numbers_stay_within_their_bounds() -> None:
    assert example_value({"type": "integer", "minimum": 1e20}) == 1
    assert example_value({"type": "integer", "minimum": 3.5}) == 4
    assert example_value({"type": "number", "minimum": -5, "maximum": 0.5}) == 0.5
    assert example_value({"type": "array", "items": [{"type": "boolean"}, {}]}) == [
        False, "example"
    ]  # fmt: skip


# -- finding 2: choosing the tool is linear ------------------------------------------------------


def test_choosing_among_2000_tools_in_a_12_mb_text_reads_the_text_once_and_only_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tools = [FunctionTool(name=f"tool_{i}") for i in range(2_000)]
    text = "please run tool_1999 now " + "lorem ipsum dolor sit amet " * 450_000
    scanned: list[int] = []

    class CountingPattern:  # 14 s before: every name searched for in all of the text
        def findall(self, within: str) -> list[str]:
            scanned.append(len(within))
            return IDENTIFIER.findall(within)

    monkeypatch.setattr(default_model, "_IDENTIFIER", CountingPattern())
    chosen = _choose_tool(tools, text)
    assert scanned == [NAME_SEARCH_CHARS]
    assert chosen.name == "tool_1999"
    assert _choose_tool(tools, "tool_19999 is not a tool").name == "tool_0"


# -- finding 9: request limits are honoured ------------------------------------------------------


async def test_max_output_tokens_cuts_the_response_short(start_server: StartServer) -> None:
    script = {"segments": [{"text": "A long answer that takes many tokens to say."}]}
    events = await one_segment(start_server, create(max_output_tokens=1), script=script)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["usage"]["output_tokens"] <= 1


async def test_max_output_tokens_counts_every_segment_of_the_response(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(create(max_output_tokens=14))
            first = await client.segment()
            used = first[-1]["response"]["usage"]["output_tokens"]
            assert first[-1]["type"] == "response.done" and used < 14
            await client.send({"type": "response.append", "input": answers(first)})
            second = await client.segment()
    final = second[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["usage"]["output_tokens"] <= 14


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_output_tokens", 0), ("max_output_tokens", -1), ("max_tool_calls", -1)],
)
async def test_limits_out_of_range_are_refused(
    start_server: StartServer, field: str, value: int
) -> None:
    (error,) = await one_segment(start_server, create(**{field: value}))
    assert error["type"] == "error"
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_field", field)


WEATHER = tool(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    name="weather",
)


async def test_tool_choice_none_answers_in_text(start_server: StartServer) -> None:
    events = await one_segment(start_server, create(tool_choice="none"))
    assert function_call(events) is None
    assert events[-1]["type"] == "response.completed"


async def test_max_tool_calls_zero_answers_in_text(start_server: StartServer) -> None:
    events = await one_segment(start_server, create(max_tool_calls=0))
    assert function_call(events) is None
    assert events[-1]["type"] == "response.completed"


async def test_a_named_tool_choice_is_the_tool_called(start_server: StartServer) -> None:
    choice = {"type": "function", "name": "weather"}
    events = await one_segment(
        start_server, create(tools=[EXEC_COMMAND, WEATHER], tool_choice=choice)
    )
    call = function_call(events)
    assert call is not None and call["name"] == "weather"


async def test_tool_choice_required_calls_even_after_tool_outputs(
    start_server: StartServer,
) -> None:
    running = await start_server()
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(create(tool_choice="required", max_tool_calls=2))
            first = await client.segment()
            await client.send({"type": "response.append", "input": answers(first)})
            second = await client.segment()
            assert second[-1]["type"] == "response.done"
            assert function_call(second) is not None
            # max_tool_calls is spent: the third segment answers in text
            await client.send({"type": "response.append", "input": answers(second)})
            third = await client.segment()
    assert third[-1]["type"] == "response.completed" and function_call(third) is None


@pytest.mark.parametrize(
    "choice", [{"type": "function", "name": "nope"}, "sometimes", 3, {"type": "function"}]
)
async def test_a_tool_choice_that_cannot_be_honoured_is_refused(
    start_server: StartServer, choice: Any
) -> None:
    (error,) = await one_segment(start_server, create(tool_choice=choice))
    assert error["type"] == "error"
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_field", "tool_choice")


def test_hosted_and_custom_tool_choices_mean_auto() -> None:
    """This server runs no hosted or custom tools, so it cannot force one: the model chooses."""
    check_create(ResponseCreate(tool_choice={"type": "custom", "name": "apply_patch"}))
    assert parse_tool_choice({"type": "web_search"}) == ToolChoice("auto")


def test_limits_combine_into_the_calls_a_segment_may_make() -> None:
    assert GenerationLimits().max_calls is None
    assert GenerationLimits(parallel_tool_calls=False, max_tool_calls=3).max_calls == 1
    assert GenerationLimits(max_tool_calls=0).max_calls == 0
    required = GenerationLimits(tool_choice=ToolChoice("required"), max_tool_calls=0)
    assert not required.must_call  # the cap wins: no call is left to make


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"parallel_tool_calls": False}, "parallel_tool_calls is false"),
        ({"max_tool_calls": 2}, "max_tool_calls leaves 1 more"),
        ({"tool_choice": "none"}, 'tool_choice is "none"'),
    ],
)
async def test_a_script_segment_over_the_requests_limits_is_a_script_error(
    start_server: StartServer, fields: dict[str, Any], words: str
) -> None:
    """THREE_SEGMENTS calls once, then twice in one segment."""
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(create(**fields))
            events = await client.segment()
            if fields != {"tool_choice": "none"}:
                assert events[-1]["type"] == "response.done"
                await client.send({"type": "response.append", "input": answers(events)})
                events = await client.segment()
    failed = events[-1]
    assert failed["type"] == "response.failed"
    error = failed["response"]["error"]
    assert error["code"] == "script_error"
    segment = "segment 1 " if fields == {"tool_choice": "none"} else "segment 2 "
    assert segment in error["message"] and words in error["message"]


async def test_a_script_without_the_required_call_is_a_script_error(
    start_server: StartServer,
) -> None:
    script = {"segments": [{"text": "Nothing to run."}]}
    events = await one_segment(start_server, create(tool_choice="required"), script=script)
    error = events[-1]["response"]["error"]
    assert error["code"] == "script_error" and "requires one" in error["message"]


class CannotForce:
    """A generator like the local one: it cannot make a call the request forces."""

    renderer = None
    forces_tool_calls = False

    def open_session(
        self, conversation: Any, *, cache_salt: str | None = None, affinity: str | None = None
    ) -> Any:
        raise AssertionError("a refused create opens no session")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "exec_command"}])
def test_a_forced_call_a_generator_cannot_make_is_refused_on_arrival(choice: Any) -> None:
    server = ProtoServer(CannotForce())  # type: ignore[arg-type]
    create_event = converter.structure(create(tool_choice=choice), ResponseCreate)
    with pytest.raises(ProtocolError) as refused:
        server.responses.check_create(create_event)
    assert (refused.value.detail.code, refused.value.detail.param) == (
        "unsupported_tool_choice",
        "tool_choice",
    )
    server.responses.check_create(attrs.evolve(create_event, tool_choice="none"))


def test_a_call_demanded_of_no_function_tool_is_refused() -> None:
    """As OpenAI's API does; a generator forced to call with nothing to call cannot (vLLM was
    sent an impossible schema)."""
    create = converter.structure({"tool_choice": "required", "tools": [{"type": "web_search"}]},
                                 ResponseCreate)  # fmt: skip
    with pytest.raises(ProtocolError) as refused:
        check_create(create)
    assert (refused.value.detail.code, refused.value.detail.param) == (
        "invalid_field",
        "tool_choice",
    )
