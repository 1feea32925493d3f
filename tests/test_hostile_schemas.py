"""Tool schemas that once stalled or crashed the default model (issue 10).

A schema that repeats or recurses is answered in bounded time or refused at the door with
`invalid_tool_schema`; an unusual but valid schema gets a call or a text answer, never a
traceback. Wall-clock bounds here are generous: each guards a case that took seconds or hours
before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import orjson
import pytest
import trio

from proto_server.core.tool_schema import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, check_tool_schemas
from proto_server.engine.default_model import EXAMPLE_BUDGET, _choose_tool, example_value
from proto_server.testing import connect_checked
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError
from proto_server.wire.tools import FunctionTool

from .conftest import EXEC_COMMAND, StartServer
from .test_prototype_rollout import create

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


async def one_segment(start_server: StartServer, frame: dict[str, Any], **server: Any) -> Any:
    """The first segment the default model (or `server["script"]`) answers `frame` with."""
    running = await start_server(server.pop("script", None), **server)
    with trio.fail_after(DEADLINE_S):
        async with connect_checked(running.prototype_url) as client:
            await client.send(frame)
            return await client.segment()


# -- finding 1: repetition and recursion are bounded -------------------------------------------


@pytest.mark.parametrize("levels", [9, 12])
def test_a_repeated_required_list_costs_one_value_per_level(levels: int) -> None:
    started = time.perf_counter()
    value = example_value(nested(levels))
    assert time.perf_counter() - started < 1  # 10^9 sub-schema visits at 9 levels before
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


def test_refs_that_double_at_every_level_stop_at_the_budget() -> None:
    """30 definitions, each requiring two copies of the next: 2^30 values if followed."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}, "y": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x", "y"],
        }
        for i in range(30)
    }
    defs["d30"] = {"type": "integer"}
    started = time.perf_counter()
    value = example_value({"$defs": defs, "$ref": "#/$defs/d0"})
    assert time.perf_counter() - started < 1
    assert isinstance(value, dict)
    assert len(orjson.dumps(value)) < 20 * EXAMPLE_BUDGET


# -- finding 8: unusual schemas get a call or text, never a traceback ------------------------

UNUSUAL = {
    "items-as-a-list": {
        "type": "object",
        "properties": {
            "pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
        },
        "required": ["pair"],
    },
    "items-true": {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": True}},
        "required": ["xs"],
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


def test_choosing_among_2000_tools_in_a_12_mb_text_is_quick() -> None:
    tools = [FunctionTool(name=f"tool_{i}") for i in range(2_000)]
    text = "please run tool_1999 now " + "lorem ipsum dolor sit amet " * 450_000
    started = time.perf_counter()
    chosen = _choose_tool(tools, text)
    assert time.perf_counter() - started < 1  # 14 s before: every name against all the text
    assert chosen.name == "tool_1999"
    assert _choose_tool(tools, "tool_19999 is not a tool").name == "tool_0"
