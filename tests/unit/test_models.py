"""Rollout scripts and the built-in default model: what the simulated GPU decides to say."""

from __future__ import annotations

import json

import pytest

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.engine.default_model import DefaultModel, example_value
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.script import ScriptError, load_script, parse_script
from proto_server.wire.converter import converter
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message
from proto_server.wire.tools import Tool

from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS

NO_LIMITS = GenerationLimits()


def conv(*tools: dict[str, object]) -> Conversation:
    typed = tuple(converter.structure(t, Tool) for t in tools)  # type: ignore[arg-type]
    c = Conversation(O200kRenderer(), tools=typed)
    c.extend([Message(role="user", content="please check the weather in the repo")])
    return c


def test_a_script_follows_the_conversation() -> None:
    script = parse_script(THREE_SEGMENTS)
    c = conv(EXEC_COMMAND)
    assert script.plan(c, NO_LIMITS).text == "Let me look."
    c.extend([FunctionCall(call_id="a", name="exec_command", arguments="{}")])
    c.extend([FunctionCallOutput(call_id="a", output="x")])
    assert [call.arguments for call in script.plan(c, NO_LIMITS).tool_calls] == [
        '{"cmd":"cat a.py"}',
        '{"cmd":"cat b.py"}',
    ]


def test_a_script_error_about_thousands_of_offered_tools_stays_small() -> None:
    script = parse_script({"segments": [{"tool_calls": [{"name": "missing"}]}]})
    tools = [{"type": "function", "name": f"tool_{i}"} for i in range(3_000)]
    with pytest.raises(ScriptError) as error:
        script.plan(conv(*tools), NO_LIMITS)
    assert len(str(error.value)) < 500
    assert "offered 3,000, e.g. 'tool_0'" in str(error.value)


def test_an_exhausted_script_says_so() -> None:
    script = parse_script({"segments": [{"text": "only"}]})
    c = conv()
    c.extend([Message(role="assistant", content="only")])
    with pytest.raises(ScriptError, match="1 segment"):
        script.plan(c, NO_LIMITS)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "segments"),
        ({"segments": []}, "empty"),
        ({"segments": [{}]}, "says nothing"),
        ({"segments": [{"text": 1}]}, "segments[0].text"),
        ({"segments": [{"tool_calls": [{"arguments": {}}]}]}, "tool_calls[0]"),
        ({"segments": [{"text": "a", "tools": []}]}, "unknown keys"),
    ],
)
def test_a_bad_script_is_refused_with_where(data: object, words: str) -> None:
    with pytest.raises(ScriptError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_script(data)


def test_load_script_reports_unreadable_files(tmp_path: object) -> None:
    with pytest.raises(ScriptError, match="cannot read"):
        load_script("/nonexistent/script.json")


def test_load_script_reads_json(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "s.json"  # type: ignore[operator]
    path.write_text(json.dumps(THREE_SEGMENTS))
    assert len(load_script(path).segments) == 3


def test_the_default_model_answers_in_text_without_tools() -> None:
    segment = DefaultModel().plan(conv(), NO_LIMITS)
    assert segment.tool_calls == ()
    assert "please check the weather" in segment.text


def test_the_default_model_calls_a_tool_with_schema_built_arguments() -> None:
    weather = {
        "type": "function",
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1},
                "verbose": {"type": "boolean"},
            },
            "required": ["city", "unit", "days"],
        },
    }
    # the user named "weather", so that tool is chosen over the first one offered
    segment = DefaultModel().plan(conv(EXEC_COMMAND, weather), NO_LIMITS)
    (call,) = segment.tool_calls
    assert call.name == "weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c", "days": 1}


def test_the_default_model_refers_to_tool_outputs() -> None:
    c = conv(EXEC_COMMAND)
    call = DefaultModel().plan(c, NO_LIMITS).tool_calls[0]
    assert json.loads(call.arguments) == {"cmd": "echo hello from proto-server"}
    c.extend([FunctionCall(call_id="a", name=call.name, arguments=call.arguments)])
    c.extend([FunctionCallOutput(call_id="a", output="hello from proto-server\n")])
    segment = DefaultModel().plan(c, NO_LIMITS)
    assert segment.tool_calls == ()
    assert "exec_command" in segment.text and "hello from proto-server" in segment.text


def test_example_values_for_common_schemas() -> None:
    assert example_value({"type": "array", "items": {"type": "string"}}, "command") == [
        "echo", "hello from proto-server"
    ]  # fmt: skip
    assert example_value({"anyOf": [{"type": "number"}, {"type": "null"}]}) == 1.0
    assert example_value({"type": ["null", "string"]}, "path") == "README.md"
