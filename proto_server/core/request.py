"""What a `response.create` asks for, in the core's terms."""

from __future__ import annotations

from proto_server.core.response import ResponseSettings
from proto_server.wire.events import ResponseCreate
from proto_server.wire.items import Item, Message


def input_items(create: ResponseCreate) -> tuple[Item, ...]:
    """`input` as items: a bare string is one user message."""
    if isinstance(create.input, str):
        return (Message(role="user", content=create.input),)
    return create.input


def response_settings(create: ResponseCreate, *, default_model: str) -> ResponseSettings:
    return ResponseSettings(
        model=create.model or default_model,
        instructions=create.instructions,
        tools=create.tools,
        tool_choice=create.tool_choice,
        parallel_tool_calls=True
        if create.parallel_tool_calls is None
        else create.parallel_tool_calls,
        store=bool(create.store),
        previous_response_id=create.previous_response_id,
        metadata=create.metadata or {},
    )
