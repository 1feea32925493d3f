"""Conversation items and content parts, as the Responses API spells them.

Known items are typed; anything else a client sends (compaction, future types) is kept
whole as an `UnknownItem` and carried through untouched, so no client is refused for being newer
than this server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

ROLES = frozenset({"user", "system", "developer", "assistant"})


@attrs.frozen(kw_only=True)
class InputText:
    type: str = "input_text"
    text: str


@attrs.frozen(kw_only=True)
class OutputText:
    type: str = "output_text"
    text: str
    annotations: tuple[Any, ...] = ()


@attrs.frozen(kw_only=True)
class ReasoningText:
    """What a model thought, as it wrote it (a `reasoning` item's content)."""

    type: str = "reasoning_text"
    text: str


@attrs.frozen(kw_only=True)
class SummaryText:
    type: str = "summary_text"
    text: str


#: The parts a streamed item's `content_part.added` and `.done` carry.
StreamedPart = OutputText | ReasoningText


@attrs.frozen
class UnknownPart:
    """A content part this server does not interpret (an image, a file, a refusal...)."""

    raw: Mapping[str, Any]


ContentPart = InputText | OutputText | UnknownPart
Content = str | tuple[ContentPart, ...]


@attrs.frozen(kw_only=True)
class Message:
    type: str = "message"
    id: str | None = None
    role: str
    content: Content
    status: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    type: str = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutput:
    type: str = "function_call_output"
    id: str | None = None
    call_id: str
    output: Content
    status: str | None = None


@attrs.frozen(kw_only=True)
class CustomToolCall:
    type: str = "custom_tool_call"
    id: str | None = None
    call_id: str
    name: str
    input: str
    status: str | None = None


@attrs.frozen(kw_only=True)
class CustomToolCallOutput:
    type: str = "custom_tool_call_output"
    id: str | None = None
    call_id: str
    output: Content


@attrs.frozen(kw_only=True)
class Reasoning:
    """A model's reasoning before it answered or called. `encrypted_content`: the same,
    sealed by the server that made it (asked for with `include`), so a client that stores
    nothing can send it back for the model to read again."""

    type: str = "reasoning"
    id: str | None = None
    summary: tuple[SummaryText, ...] = ()
    content: tuple[ReasoningText, ...] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


@attrs.frozen
class UnknownItem:
    """An item of a type this server carries but does not interpret (compaction...)."""

    raw: Mapping[str, Any]

    @property
    def type(self) -> str:
        return str(self.raw.get("type"))


Item = (
    Message
    | FunctionCall
    | FunctionCallOutput
    | CustomToolCall
    | CustomToolCallOutput
    | Reasoning
    | UnknownItem
)
ToolCall = FunctionCall | CustomToolCall
ToolOutput = FunctionCallOutput | CustomToolCallOutput

ITEM_TYPES: Mapping[str, type[Item]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "custom_tool_call": CustomToolCall,
    "custom_tool_call_output": CustomToolCallOutput,
    "reasoning": Reasoning,
}


def content_text(content: Content) -> str:
    """The plain text of a message or tool output, parts joined; parts without text are skipped."""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if not isinstance(part, UnknownPart))
