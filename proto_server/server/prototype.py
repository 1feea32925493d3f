"""The prototype dialect: a whole agent rollout is ONE long-lived Response.

`response.create` opens it; on tool calls it suspends (`response.done`); `response.append`
answers the calls and resumes it; `response.completed` ends it. One Response open at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proto_server.core.conversation import render_items
from proto_server.core.request import PROTOTYPE_COMPACTION, check_tool_choice, warmup_field
from proto_server.server.sampling import SamplingLoop
from proto_server.server.store import ANONYMOUS
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ClientEvent, ResponseAppend, ResponseCancel, ResponseCreate

if TYPE_CHECKING:
    import trio

    from proto_server.server.app import ProtoServer
    from proto_server.server.connection import Connection


class PrototypeDialect:
    def __init__(
        self,
        server: ProtoServer,
        connection: Connection,
        nursery: trio.Nursery,
        *,
        owner: str = ANONYMOUS,
    ) -> None:
        self._server = server
        self._connection = connection
        self._nursery = nursery
        self._owner = owner
        self.current: SamplingLoop | None = None
        #: The id and final status of the last Response once it ended: enough to say so, and
        #: nothing of what it held (an idle connection keeps no conversation).
        self._ended: tuple[str, str] | None = None

    async def handle(self, event: ClientEvent, frame_bytes: int) -> None:
        match event:
            case ResponseCreate():
                await self._create(event, frame_bytes)
            case ResponseAppend(input=items, tool_choice=tool_choice):
                loop = self._open_rollout("append to")
                loop.machine.check_append(items)  # before the work of rendering them
                if tool_choice is not None:  # a new tool_choice for the rest of the Response
                    tools = loop.machine.template.tools
                    self._server.check_forcing(check_tool_choice(tool_choice, tools))
                renderer = loop.rollout.conversation.renderer
                rendered = await self._server.offload.run(
                    render_items, renderer, items, size=frame_bytes
                )
                self._open_rollout("append to").append(items, rendered, tool_choice=tool_choice)
            case ResponseCancel():
                self._open_rollout("cancel").cancel()

    def _open_rollout(self, verb: str) -> SamplingLoop:
        rollout = self.current
        if rollout is not None and not rollout.machine.status.terminal:
            return rollout
        ended = self._ended
        if rollout is not None:  # decided, but its terminal event is not out yet
            ended = (rollout.machine.id, rollout.machine.status.value)
        if ended is None:
            raise ProtocolError(
                "no_open_response",
                f"There is no open Response to {verb} on this connection; "
                "start one with response.create.",
            )
        raise ProtocolError(
            "no_open_response",
            f"Response {ended[0]} already ended ({ended[1]}); there is "
            f"nothing to {verb}. Start a new Response with response.create.",
        )

    async def _create(self, create: ResponseCreate, frame_bytes: int) -> None:
        current = self.current
        if current is not None and not current.ended:
            machine = current.machine
            if machine.status.terminal:  # decided, but its terminal event is not out yet
                raise ProtocolError(
                    "concurrent_request",
                    f"Response {machine.id} is ending ({machine.status.value}); wait for its "
                    f"response.{machine.status.value} event, then create another.",
                )
            raise ProtocolError(
                "concurrent_request",
                f"Response {machine.id} is still open ({machine.status.value}); "
                "answer it with response.append, or end it with response.cancel, before "
                "creating another.",
            )
        if create.previous_response_id is not None:
            raise _unsupported(
                "previous_response_id", "a prototype Response continues with response.append"
            )
        if (warmup := warmup_field(create)) is not None:
            raise _unsupported(warmup, "warm-ups belong to the launched dialect")
        if create.background:
            raise _unsupported("background", "background responses are not served over a WebSocket")
        await self._server.offload.run(self._server.check_create, create, size=frame_bytes)
        if create.context_management:  # valid (checked above), and not for this dialect
            raise _unsupported("context_management", PROTOTYPE_COMPACTION)
        loop = await self._server.begin_response(
            create,
            self._connection.events,
            budget=self._connection.budget,
            source="fresh",
            owner=self._owner,
            suspend_on_tool_calls=True,
            size=frame_bytes,
        )
        self.current = loop
        self._nursery.start_soon(self._run, loop)

    async def _run(self, loop: SamplingLoop) -> None:
        """The rollout lives exactly as long as its one Response."""
        try:
            await loop.run()
        finally:
            await loop.rollout.aclose()
            if self.current is loop:
                self._ended = (loop.machine.id, loop.machine.status.value)
                self.current = None

    async def drain(self) -> None:
        if self.current is not None:
            await self.current.wait_settled()

    async def expire(self, reason: str) -> None:
        current = self.current
        if current is not None and not current.ended:
            current.expire(reason)
            await current.wait_ended()


def _unsupported(field: str, why: str) -> ProtocolError:
    return ProtocolError(
        "invalid_field",
        f"`{field}` is not supported in the prototype dialect: {why}. Remove it, or connect "
        "without the prototype opt-in to use the launched dialect.",
        param=field,
    )
