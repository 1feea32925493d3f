"""Budgets on the JSON schemas a request sends, checked when it is accepted.

The server reads every function tool's `parameters` (the default model builds arguments from
them) and the `text.format` schema (text_format.py), so one request must not be able to make
that reading expensive. The check walks each
schema once, iteratively, and refuses one that is too deep or too large with a 400
`invalid_tool_schema` whose `param` is the path of the offending part, e.g.
`tools[0].parameters.properties.a.properties.a`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proto_server.wire.errors import ProtocolError
from proto_server.wire.tools import FunctionTool, Tool

#: JSON levels a tool's `parameters` may nest (objects and arrays, `parameters` itself is 1).
#: Real tool schemas stay under 10; 32 is 16 levels of nested object properties.
MAX_SCHEMA_DEPTH = 32

#: JSON values (objects, arrays and scalars) one tool's `parameters` may hold. Codex's largest
#: tool has a few hundred; the cap keeps whatever reads a schema cheap, whoever sent it.
MAX_SCHEMA_NODES = 10_000

#: Characters of each property name a path quotes.
PATH_KEY_CHARS = 64

#: A path as a linked list, (key, parent): made into text only when a schema is refused.
Trail = tuple[str | int, "Trail"] | None


def trail_of(keys: Sequence[str | int]) -> Trail:
    """The trail of a path given as its keys, outermost first."""
    trail: Trail = None
    for key in keys:
        trail = (key, trail)
    return trail


def trail_path(trail: Trail) -> str:
    """`trail` as a request path, e.g. `tools[0].parameters.properties.a`."""
    keys: list[str | int] = []
    while trail is not None:
        key, trail = trail
        keys.append(key)
    path = ""
    for key in reversed(keys):
        if isinstance(key, str) and len(key) > PATH_KEY_CHARS:  # the client's names: an error
            key = f"{key[:PATH_KEY_CHARS]}…"  # about them stays small however long they are
        path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else key)
    return path


def check_tool_schemas(tools: Sequence[Tool]) -> None:
    """Raise `ProtocolError("invalid_tool_schema")` if a function tool's schema is over budget;
    O(size of the schemas)."""
    for index, tool in enumerate(tools):
        if isinstance(tool, FunctionTool) and tool.parameters is not None:
            _check(tool.parameters, ("parameters", (index, ("tools", None))), "invalid_tool_schema")


def check_schema(schema: Mapping[str, Any], where: Sequence[str | int], code: str) -> None:
    """The same budgets for a schema at `where` (its path's keys) in the request; `code` is the
    error's."""
    _check(schema, trail_of(where), code)


def _check(schema: Mapping[str, Any], root: Trail, code: str) -> None:
    """Only containers are visited; their sizes are counted before their children are read."""
    nodes = 1
    stack: list[tuple[Mapping[str, Any] | list[Any], int, Trail]] = [(schema, 1, root)]
    while stack:
        value, depth, trail = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            path = trail_path(trail)
            raise ProtocolError(
                code,
                f"`{path}` nests deeper than {MAX_SCHEMA_DEPTH} levels inside its schema;"
                " this server reads schemas at most that deep. Flatten the schema.",
                param=path,
            )
        nodes += len(value)
        if nodes > MAX_SCHEMA_NODES:
            raise ProtocolError(
                code,
                f"`{trail_path(root)}` holds more than {MAX_SCHEMA_NODES} JSON values; this server "
                "reads at most that many per schema. Simplify the schema.",
                param=trail_path(root),
            )
        children = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, child in children:
            if isinstance(child, Mapping | list):
                stack.append((child, depth + 1, (key, trail)))
