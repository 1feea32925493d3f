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
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine.limits import GenerationLimits
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


#: What one example may cost: each value built and each `required` entry read costs 1, a
#: literal (`const`, `default`, `enum`) its encoded length. `$ref` lets a small schema describe an
#: exponentially large value; past the budget the example stops growing (what is left is omitted).
EXAMPLE_BUDGET = 20_000

#: How deep an example may nest, `$ref`s followed; deeper parts are left out.
EXAMPLE_DEPTH = 32

#: Characters of the user's text searched for a tool's name: enough for any instruction, and
#: a 12 MB message costs no more than this to read.
NAME_SEARCH_CHARS = 100_000

#: What a string of a known `format` is (the formats OpenAI's structured outputs allow).
_STRINGS_BY_FORMAT = {
    "date-time": "2026-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "date": "2026-01-01",
    "duration": "P1D",
    "email": "user@example.com",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "http://127.0.0.1/",
}

_IDENTIFIER = re.compile(r"[a-z0-9_-]+")  # what a function name may hold
_SAFE_NUMBER = 2**53  # beyond it a JSON number is not an exact integer (nor encodable past 2^64)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text[: limit * 8].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Omit:
    """A value left out: a `$ref` cycle cut, or the budget spent."""


_OMIT = _Omit()


def example_value(schema: Any, name: str = "") -> Any:
    """A plausible value for a JSON schema: enums, defaults and names guide the choice.

    Local `$ref`s (`#/$defs/...`, `#/definitions/...`, any `#/` pointer) are followed and a cycle
    is cut; `required` is read once per name; cost and depth are bounded (`EXAMPLE_BUDGET`,
    `EXAMPLE_DEPTH`), so any schema gives an answer in bounded time. A part it cannot use
    (`items: false`, a cycle) is left out; None if nothing at all could be built.
    """
    value = _Examples(schema).build(schema, name, 0, frozenset())
    return None if isinstance(value, _Omit) else value


class _Examples:
    def __init__(self, root: Any) -> None:
        self._root = root
        self._budget = EXAMPLE_BUDGET
        self._resolved: dict[str, Any] = {}  # each pointer walked once, however often used

    def _spend(self, cost: int = 1) -> bool:
        self._budget -= cost
        return self._budget >= 0

    def _literal(self, value: Any) -> Any:
        return value if self._spend(len(orjson.dumps(value))) else _OMIT

    def _resolve(self, ref: str) -> Any:
        """The schema a local `#/...` JSON pointer names; None if there is none."""
        if ref not in self._resolved:
            self._resolved[ref] = self._walk(ref)
        return self._resolved[ref]

    def _walk(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None
        node = self._root
        for part in ref[1:].split("/")[1:]:
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node

    def build(self, schema: Any, name: str, depth: int, refs: frozenset[str]) -> Any:
        if depth > EXAMPLE_DEPTH or not self._spend() or schema is False:
            return _OMIT
        if not isinstance(schema, Mapping):  # `true`, or not a schema: anything goes
            return _STRINGS_BY_NAME.get(name.lower(), "example")
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in refs:
                return _OMIT
            target = self._resolve(ref)
            if target is not None:
                return self.build(target, name, depth + 1, refs | {ref})
        for key in ("const", "default"):
            if key in schema:
                return self._literal(schema[key])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._literal(enum[0])
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                return self.build(branches[0], name, depth + 1, refs)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, depth, refs)
        if kind == "array":
            return self._array(schema, name, depth, refs)
        if kind in ("integer", "number"):
            return _number(schema, integer=kind == "integer")
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        return _string(schema, name)

    def _object(self, schema: Mapping[str, Any], depth: int, refs: frozenset[str]) -> Any:
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            properties = {}
        required = schema.get("required")
        value: dict[str, Any] = {}
        for key in required if isinstance(required, list) else ():
            if not self._spend():
                break
            if isinstance(key, str) and key not in value:
                field = self.build(properties.get(key, {}), key, depth + 1, refs)
                if not isinstance(field, _Omit):
                    value[key] = field
        return value

    def _array(self, schema: Mapping[str, Any], name: str, depth: int, refs: frozenset[str]) -> Any:
        items = schema.get("items", {})
        tuple_items = schema.get("prefixItems", items)
        if isinstance(tuple_items, list):  # a tuple (draft 4 `items`, 2020-12 `prefixItems`)
            values = []
            for item in tuple_items:
                value = self.build(item, name, depth + 1, refs)
                if self._budget < 0:
                    break
                if not isinstance(value, _Omit):
                    values.append(value)
            return values
        if name.lower() in ("command", "cmd", "argv") and _is_string_schema(items):
            return ["echo", "hello from proto-server"]
        least, most = _bound(schema, "minItems"), _bound(schema, "maxItems")
        if most is not None and most < 1:
            return []
        item = self.build(items, name, depth + 1, refs)
        if isinstance(item, _Omit):
            return []
        count = max(1, int(least or 0))
        return [item] * count if self._spend(count) else [item]


def _is_string_schema(schema: Any) -> bool:
    """Any string at all: a `type` and words about it, no other constraint."""
    return (
        isinstance(schema, Mapping)
        and schema.get("type") == "string"
        and set(schema) <= {"type", "description", "title"}
    )


def _string(schema: Mapping[str, Any], name: str) -> str:
    """A string for `schema`: by its `format`, else its property's name, fitted to its
    `minLength` and `maxLength`."""
    text = _STRINGS_BY_FORMAT.get(str(schema.get("format")))
    if text is None:
        text = _STRINGS_BY_NAME.get(name.lower(), "example")
    least, most = _bound(schema, "minLength"), _bound(schema, "maxLength")
    if least is not None and len(text) < least:
        text += "x" * (int(least) - len(text))
    if most is not None and len(text) > most:
        text = text[: max(int(most), 0)]
    return text


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value if abs(value) <= _SAFE_NUMBER else None
    return None  # a string, null or a huge number: not a usable bound


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    """1 when the bounds allow it, else the bound nearest to it."""
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    value: float = 1
    if low is not None and value < low:
        value = math.ceil(low) if integer else low
    if high is not None and value > high:
        value = math.floor(high) if integer else high
    return int(value) if integer else float(value)


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
    value = {"answer": text} if form.kind == "json_object" else example_value(form.schema)
    return Segment(text=orjson.dumps(value).decode())


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
            arguments = example_value(tool.parameters or {"type": "object"}, tool.name)
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
