"""The embedded default model: serves any client sensibly and deterministically, no script needed.

- No function tools offered: it answers in text, quoting the last user message.
- Function tools offered and no tool output yet: it calls one (a tool the user named, else the
  first) with arguments built from the tool's JSON schema, required fields filled plausibly.
- Tool outputs in the conversation: it answers with a short text that refers to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proto_server.core.conversation import Conversation
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

_STRINGS_BY_NAME = {
    "cmd": "echo hello from proto-server",
    "command": "echo hello from proto-server",
    "path": "README.md",
    "file": "README.md",
    "filename": "README.md",
    "file_path": "README.md",
    "dir": ".",
    "workdir": ".",
    "cwd": ".",
    "directory": ".",
    "url": "http://127.0.0.1/",
    "query": "proto-server",
    "pattern": "TODO",
    "city": "Paris",
    "location": "Paris",
}


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def example_value(schema: Any, name: str = "") -> Any:
    """A plausible value for a JSON schema: enums, defaults and names guide the choice."""
    if not isinstance(schema, Mapping):
        return "example"
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        required = [k for k in schema.get("required") or () if isinstance(k, str)]
        return {key: example_value(properties.get(key, {}), key) for key in required}
    if kind == "array":
        items = schema.get("items", {})
        if name.lower() in ("command", "cmd", "argv") and items.get("type") == "string":
            return ["echo", "hello from proto-server"]
        return [example_value(items, name)]
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.0))
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return _STRINGS_BY_NAME.get(name.lower(), "example")


def _last_user_text(items: list[Item]) -> str:
    for item in reversed(items):
        if isinstance(item, Message) and item.role == "user":
            return content_text(item.content)
    return ""


def _choose_tool(tools: list[FunctionTool], user_text: str) -> FunctionTool:
    lowered = user_text.lower()
    return next((tool for tool in tools if tool.name.lower() in lowered), tools[0])


class DefaultModel:
    """A `Planner` that needs no script."""

    def plan(self, conversation: Conversation) -> Segment:
        items = list(conversation.items)
        tools = function_tools(conversation.tools)
        user_text = _last_user_text(items)
        if not tools:
            said = f" You said: “{_clip(user_text, 200)}”" if user_text else ""
            return Segment(
                text="Hello from proto-server's built-in simulated model."
                + said
                + " Start the server with --script FILE to script a rollout."
            )
        if conversation.tool_outputs == 0:
            tool = _choose_tool(tools, user_text)
            arguments = example_value(tool.parameters or {"type": "object"}, tool.name)
            return Segment(
                tool_calls=(
                    ScriptedCall(name=tool.name, arguments=orjson.dumps(arguments).decode()),
                )
            )
        outputs = [i for i in items if isinstance(i, FunctionCallOutput | CustomToolCallOutput)]
        calls = {i.call_id: i.name for i in items if isinstance(i, FunctionCall)}
        last = outputs[-1]
        name = calls.get(last.call_id, "the tool")
        return Segment(
            text=f"I ran {name} and read {len(outputs)} tool output(s). The last one says: "
            f"“{_clip(content_text(last.output), 160)}”"
        )
