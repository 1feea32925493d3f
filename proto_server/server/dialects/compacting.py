"""`POST /v1/responses/compact` (routes.py): a history compacted into one item, to start a new
chain from, with the tokens of what it was given and of what it gives back."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from proto_server.core.compaction import check_compactions, compact
from proto_server.core.conversation import Conversation, counted
from proto_server.core.ids import new_id
from proto_server.core.render import Renderer
from proto_server.core.request import input_items
from proto_server.server.process.logs import log
from proto_server.server.rollouts.responses import Responses
from proto_server.wire.converter import converter
from proto_server.wire.events import ResponseCreate
from proto_server.wire.items import Item
from proto_server.wire.response import Usage


async def compaction(
    responses: Responses, create: ResponseCreate, history: Sequence[Item], size: int
) -> dict[str, Any]:
    """The `response.compaction` object for `create` continuing `history` (`size`: the
    request's bytes, for whether counting runs off the event loop)."""
    new_items = input_items(create)
    check_compactions(new_items, responses.compaction_key)
    items = [*history, *new_items]
    turns, outputs = counted(items)
    output, summary = compact(
        items, responses.compaction_key, model_turns=turns, tool_outputs=outputs
    )
    input_tokens, output_tokens = await responses.offload.run(
        _count_tokens,
        responses.renderer,
        create.instructions,
        items,
        output,
        size=size + 1024 * len(items),
    )
    log.debug("http.compact", extra={"items": len(items), "summary": summary})
    return {
        "id": new_id("cmp"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "model": create.model,
        "output": converter.unstructure(output),
        "usage": converter.unstructure(
            Usage(
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                total_tokens=input_tokens + output_tokens,
            )
        ),
    }


def _count_tokens(
    renderer: Renderer, instructions: str | None, items: list[Item], output: list[Item]
) -> tuple[int, int]:
    """The tokens of a compaction's input and of its output (on a worker thread if large)."""
    conversation = Conversation(renderer, instructions=instructions)
    conversation.extend(items)
    return conversation.token_count, Conversation(renderer).extend(output)
