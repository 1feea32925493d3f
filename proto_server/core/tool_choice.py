"""`tool_choice`: which calls the model may, or must, make."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from proto_server.wire.errors import ProtocolError, quoted, some_of
from proto_server.wire.tools import Tool, function_tools


@attrs.frozen
class ToolChoice:
    """`tool_choice` as the model must obey it: `name` set means that function and no other."""

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None


def parse_tool_choice(value: Any) -> ToolChoice:
    """`auto`, `none`, `required` or `{"type": "function", "name": N}`; other tool types
    (`custom`, hosted tools) are not run by this server's models, so they mean `auto`."""
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") != "function":
        return ToolChoice()
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return ToolChoice("required", value["name"])
    raise ProtocolError(
        "invalid_field",
        '`tool_choice` must be "auto", "none", "required" or {"type": "function", "name": '
        "NAME}; fix the field and resend the frame.",
        param="tool_choice",
    )


def check_tool_choice(value: Any, tools: Sequence[Tool]) -> ToolChoice:
    """`value` parsed, if it is a valid `tool_choice` for `tools` (a named one is offered)."""
    choice = parse_tool_choice(value)
    name = choice.name
    offered = [tool.name for tool in function_tools(tools)]
    if choice.mode == "required" and not offered:
        raise ProtocolError(
            "invalid_field",
            "`tool_choice` demands a call, but the request offers no function tool this server "
            'can call; offer one, or send "auto".',
            param="tool_choice",
        )
    if name is not None and name not in offered:
        raise ProtocolError(
            "invalid_field",
            f"`tool_choice` names function {quoted(name)}, but the request offers "
            f"{some_of(offered) if offered else 'no function tools'}; name an offered one.",
            param="tool_choice",
        )
    return choice
