"""How a conversation becomes tokens: one text template per item, encoded with o200k_base.

The template is this server's own (a real model brings its chat template instead). What matters
is that each item renders on its own, so a conversation is extended by rendering only new items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import orjson

from proto_server.core.compaction import summary_of
from proto_server.core.tokenizer import encode_bounded, o200k_base
from proto_server.wire.carried import encoded
from proto_server.wire.converter import unstructure
from proto_server.wire.items import (
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    UnknownItem,
    content_text,
)
from proto_server.wire.tools import Tool


class Renderer(Protocol):
    def render_prefix(
        self, instructions: str | None, tools: Sequence[Tool], *, effort: str | None = None
    ) -> Sequence[int]:
        """What opens the conversation: the instructions and the tools, and the requested
        reasoning `effort` where the model's format says it there (harmony's system message;
        other renderers ignore it)."""
        ...

    def prefix_effort(self, effort: str | None) -> str | None:
        """`effort` as this renderer's prefix says it (None: it says none): a warm rollout is
        rebuilt only when this changes, not for an effort its prefix would not show."""
        ...

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        """The item's tokens; possibly shared with later calls (a renderer may keep them), so
        never to be changed by the caller. `previous`: the item rendered just before it, where
        the format joins them (Qwen3's reasoning and the call after it are one message).

        A renderer may also have `render_run(outputs, previous)`: two or more consecutive tool
        outputs rendered together, and `render_turn(items, previous)`: a `model_turn`'s items
        as one message, where the format joins them (`render_items` and
        `Conversation.extend_turn` ask them); either answers None where it renders them apart.
        And `closing(last)`: what closes a message it left open for what usually follows
        (Qwen3's reasoning), where the model's own next turn follows instead."""
        ...


@attrs.frozen
class ModelTurn:
    """What a model wrote in one turn, in the order it writes it: its reasoning, its text,
    then its calls (name, arguments); what a renderer that joins them in one message reads."""

    thought: str | None
    text: str | None
    calls: tuple[tuple[str, str], ...]


def is_assistant_message(item: Item) -> bool:
    return isinstance(item, Message) and item.role == "assistant"


def turn_end(items: Sequence[Item], start: int) -> int:
    """Where the longest run at `items[start]` shaped as one model turn ends: a reasoning
    item, an assistant message, then calls, each part optional."""
    end = start
    if end < len(items) and isinstance(items[end], Reasoning):
        end += 1
    if end < len(items) and is_assistant_message(items[end]):
        end += 1
    while end < len(items) and isinstance(items[end], FunctionCall | CustomToolCall):
        end += 1
    return end


def model_turn(items: Sequence[Item]) -> ModelTurn | None:
    """`items` as one model turn, where they are one that a format may render joined (a
    text and the calls after it, or several calls); None otherwise."""
    if turn_end(items, 0) != len(items):
        return None
    thought = text = None
    calls: list[tuple[str, str]] = []
    for item in items:
        match item:
            case Reasoning():
                thought = item.text
            case Message(content=content):
                text = content_text(content)
            case FunctionCall(name=name, arguments=arguments):
                calls.append((name, arguments))
            case CustomToolCall(name=name, input=given):
                calls.append((name, given))
    if not calls or (text is None and len(calls) < 2):
        return None
    return ModelTurn(thought, text, tuple(calls))


def requested_effort(reasoning: Mapping[str, Any] | None) -> str | None:
    """The `effort` a request's (or a Response's echoed) `reasoning` asks for, if any."""
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    return effort if isinstance(effort, str) else None


def item_text(item: Item) -> str:
    """The template of one item: a header line naming who speaks, then the content."""
    match item:
        case Message(role=role, content=content):
            return f"<|{role}|>\n{content_text(content)}\n"
        case FunctionCall(name=name, call_id=call_id, arguments=arguments):
            return f"<|assistant|> call {name} {call_id}\n{arguments}\n"
        case CustomToolCall(name=name, call_id=call_id, input=text):
            return f"<|assistant|> custom {name} {call_id}\n{text}\n"
        case (
            FunctionCallOutput(call_id=call_id, output=output)
            | CustomToolCallOutput(call_id=call_id, output=output)
        ):
            return f"<|tool|> {call_id}\n{content_text(output)}\n"
        case Reasoning():
            return f"<|reasoning|>\n{item.text}\n"
        case UnknownItem(raw=raw):
            if item.type == "compaction" and (summary := summary_of(item)) is not None:
                return f"<|compaction|>\n{summary}\n"
            return f"<|{item.type}|>\n{encoded(raw).decode()}\n"
    raise TypeError(f"not an item: {item!r}")


def prefix_text(instructions: str | None, tools: Sequence[Tool]) -> str:
    parts = []
    if instructions:
        parts.append(f"<|system|>\n{instructions}\n")
    if tools:
        # a tool at a time, as one JSON array: in one call, orjson held the GIL for 185 ms
        # over the 134,000 tools of a 15 MB request
        listed = ",".join(orjson.dumps(unstructure(tool)).decode() for tool in tools)
        parts.append(f"<|tools|>\n[{listed}]\n")
    return "".join(parts)


class O200kRenderer:
    """The default renderer: the item templates above, tokenized with o200k_base."""

    def __init__(self) -> None:
        self._encoding = o200k_base()

    def render_prefix(
        self, instructions: str | None, tools: Sequence[Tool], *, effort: str | None = None
    ) -> Sequence[int]:
        return encode_bounded(self._encoding, prefix_text(instructions, tools))

    def prefix_effort(self, effort: str | None) -> str | None:
        return None

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        return encode_bounded(self._encoding, item_text(item))
