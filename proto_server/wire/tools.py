"""Tool definitions offered by a request.

Function tools are typed because the server reads their names and schemas; every other tool type
a client sends (`custom`, `namespace`, `web_search`, `tool_search`...) is carried untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from proto_server.wire.carried import carried_or_name


@attrs.frozen(kw_only=True)
class FunctionTool:
    type: str = "function"
    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class UnknownTool:
    """A tool of a type the server does not run; `raw` is echoed back exactly as it came."""

    raw: Mapping[str, Any] | str = attrs.field(converter=carried_or_name)

    @property
    def name(self) -> str | None:
        if isinstance(self.raw, str):
            return self.raw
        name = self.raw.get("name")
        return name if isinstance(name, str) else None


Tool = FunctionTool | UnknownTool


def function_tools(tools: Sequence[Tool]) -> list[FunctionTool]:
    return [tool for tool in tools if isinstance(tool, FunctionTool)]


def offered_tool_names(tools: Sequence[Tool]) -> list[str]:
    return [name for tool in tools if (name := tool.name) is not None]
