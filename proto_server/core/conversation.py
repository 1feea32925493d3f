"""The Conversation of a rollout: its items and their rendered tokens, extended incrementally."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from proto_server.core.render import Renderer
from proto_server.wire.items import (
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    UnknownItem,
)
from proto_server.wire.tools import Tool


def is_model_item(item: Item) -> bool:
    """Items the model produced (as opposed to what the user or the tools said)."""
    match item:
        case FunctionCall() | CustomToolCall():
            return True
        case Message(role="assistant"):
            return True
        case UnknownItem():
            return item.type == "reasoning"
    return False


class Conversation:
    """Items in order, and the tokens they render to.

    `extend` renders only the items it is given, so a turn that appends N items costs O(N)
    whatever the history; `rendered_tokens` counts every token ever rendered, so tests and the
    benchmark can prove it.
    """

    def __init__(
        self,
        renderer: Renderer,
        *,
        instructions: str | None = None,
        tools: Sequence[Tool] = (),
    ) -> None:
        self.renderer = renderer
        self.instructions = instructions
        self.tools: tuple[Tool, ...] = tuple(tools)
        self._items: list[Item] = []
        self.tokens = array("I", renderer.render_prefix(instructions, self.tools))
        self.rendered_tokens = len(self.tokens)
        self.model_segments = 0
        self.tool_outputs = 0
        self.model_output_end = 0
        self._last_was_model = False

    @property
    def items(self) -> Sequence[Item]:
        return self._items

    @property
    def token_count(self) -> int:
        return len(self.tokens)

    def extend(self, items: Iterable[Item]) -> int:
        """Render and append new items; return how many tokens they added."""
        before = len(self.tokens)
        for item in items:
            rendered = self.renderer.render_item(item)
            self.tokens.extend(rendered)
            self.rendered_tokens += len(rendered)
            self._items.append(item)
            model = is_model_item(item)
            if model:
                if not self._last_was_model:
                    self.model_segments += 1
                self.model_output_end = len(self.tokens)
            elif isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                self.tool_outputs += 1
            self._last_was_model = model
        return len(self.tokens) - before
