"""The embedded default model: serves any client sensibly and deterministically, no script needed.

- No function tools offered: it answers in text, quoting the last user message.
- Function tools offered and no tool output yet: it calls one (a tool the user named, else the
  first) with arguments built from the tool's JSON schema, required fields filled plausibly.
- Tool outputs in the conversation: it answers with a short text that refers to them.

It obeys the request's limits: `tool_choice: "none"` (or `max_tool_calls` spent) means text;
`"required"` means a call even after tool outputs; a named function is the one it calls. A
schema it cannot fill in (not an object) gets a text answer saying so, never a crash. Under a
structured `text.format` its text answer is JSON: `{"answer": TEXT}` for `json_object`, and for
`json_schema` an instance built from the schema as tool arguments are.

An instance follows its schema, within bounded budgets (examples.py), or the Response fails
with `invalid_tool_schema` or `invalid_json_schema` naming the keyword and its path, never a
wrong instance. That is decided when the instance is needed, not when the request arrives: a
real model may honour what this one cannot (a `minLength` of a million), a script builds none,
and a tool never called costs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import INVALID_SCHEMA, SCHEMA_PARAM, TextFormat
from proto_server.core.tool_schema import Trail, trail_of
from proto_server.engine.examples import SchemaRefused, example_value
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.engine.script import ScriptedCall, Segment
from proto_server.wire.items import (
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    content_text,
)
from proto_server.wire.tools import FunctionTool, function_tools

#: Characters of the user's text searched for a tool's name: enough for any instruction, and
#: a 12 MB message costs no more than this to read.
NAME_SEARCH_CHARS = 100_000

_IDENTIFIER = re.compile(r"[a-z0-9_-]+")  # what a function name may hold


def _clip(text: str, limit: int) -> str:
    text = " ".join(text[: limit * 8].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _last_user_text(items: Sequence[Item]) -> str:
    for item in reversed(items):
        if isinstance(item, Message) and item.role == "user":
            return content_text(item.content)
    return ""


def _choose_tool(tools: list[FunctionTool], user_text: str) -> FunctionTool:
    """The first tool whose name the user wrote as a word, else the first tool: one pass over
    (a bounded prefix of) the text and one over the tools."""
    said = set(_IDENTIFIER.findall(user_text[:NAME_SEARCH_CHARS].lower()))
    return next((tool for tool in tools if tool.name.lower() in said), tools[0])


def _answer(text: str, form: TextFormat | None) -> Segment:
    """The text answer `text`, in the shape `form` asks for."""
    if form is None:
        return Segment(text=text)
    if form.kind == "json_object":
        return Segment(text=orjson.dumps({"answer": text}).decode())
    where = trail_of(SCHEMA_PARAM.split("."))
    return Segment(text=orjson.dumps(_example(form.schema, "", where, INVALID_SCHEMA)).decode())


def _example(schema: Any, name: str, where: Trail, code: str) -> Any:
    """`example_value`, a schema it refuses failing the Response with `code`, naming the
    keyword and its path (a 4xx-like refusal of the request, not the server's failure)."""
    try:
        return example_value(schema, name, where=where)
    except SchemaRefused as refused:
        raise GenerationRefused(code, str(refused)) from None


class DefaultModel:
    """A `Planner` that needs no script."""

    def plan(self, conversation: Conversation, limits: GenerationLimits) -> Segment:
        items = conversation.items
        offered = function_tools(conversation.tools)
        named = limits.tool_choice.name
        tools = offered if named is None else [tool for tool in offered if tool.name == named]
        user_text = _last_user_text(items)
        may_call = bool(tools) and limits.max_calls != 0
        if may_call and (conversation.tool_outputs == 0 or limits.must_call):
            tool = _choose_tool(tools, user_text)
            index = next(i for i, offer in enumerate(conversation.tools) if offer is tool)
            where = trail_of(("tools", index, "parameters"))
            parameters = tool.parameters or {"type": "object"}
            arguments = _example(parameters, tool.name, where, "invalid_tool_schema")
            if not isinstance(arguments, dict):
                return _answer(
                    f"I cannot call {tool.name}: its parameters do not describe a JSON "
                    "object I can fill in.",
                    limits.text_format,
                )
            return Segment(
                tool_calls=(
                    ScriptedCall(name=tool.name, arguments=orjson.dumps(arguments).decode()),
                )
            )
        outputs = [i for i in items if isinstance(i, FunctionCallOutput | CustomToolCallOutput)]
        if not offered or not outputs:
            said = f" You said: “{_clip(user_text, 200)}”" if user_text else ""
            return _answer(
                "Hello from proto-server's built-in simulated model."
                + said
                + " Start the server with --script FILE to script a rollout.",
                limits.text_format,
            )
        calls = {i.call_id: i.name for i in items if isinstance(i, FunctionCall)}
        last = outputs[-1]
        name = calls.get(last.call_id, "the tool")
        return _answer(
            f"I ran {name} and read {len(outputs)} tool output(s). The last one says: "
            f"“{_clip(content_text(last.output), 160)}”",
            limits.text_format,
        )
