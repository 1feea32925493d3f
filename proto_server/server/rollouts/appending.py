"""One `response.append`, checked and rendered before it is committed, the same way whichever
Response it answers: the lane's open one (the prototype dialect) or one rebuilt from the store
(`Responses.resume`)."""

from __future__ import annotations

from proto_server.core.conversation import RenderedItems, render_items
from proto_server.core.response import ResponseMachine
from proto_server.core.tool_choice import check_tool_choice
from proto_server.engine.base import TokenGenerator
from proto_server.server.process.offload import Offload
from proto_server.server.rollouts.checks import check_forcing
from proto_server.wire.events import ResponseAppend


async def prepare_append(
    machine: ResponseMachine,
    append: ResponseAppend,
    *,
    generator: TokenGenerator,
    offload: Offload,
    size: int,
) -> RenderedItems:
    """`append`'s items rendered for `machine`'s conversation (off the event loop when `size`,
    the frame's bytes, is large), once `machine` would take them and the generator can make the
    forced call a new `tool_choice` asks for; refused with a `ProtocolError` before that work.

    The caller commits them with `SamplingLoop.append`, which asks the machine again: while they
    rendered (the await) the Response may have ended (a cancel, an expiry, a memory eviction),
    so the check after the await is the one that holds; this one spares the work of rendering
    an append that is refused anyway."""
    machine.check_append(append.input)
    if append.tool_choice is not None:  # a new tool_choice for the rest of the Response
        check_forcing(check_tool_choice(append.tool_choice, machine.template.tools), generator)
    conversation = machine.conversation
    return await offload.run(
        render_items, conversation.renderer, append.input, conversation.render_after, size=size
    )
