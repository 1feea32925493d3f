"""The prototype dialect: a whole agent rollout is ONE long-lived Response.

`response.create` opens it; on tool calls it suspends (`response.done`); `response.append`
answers the calls and resumes it; `response.completed` ends it. One Response open at a time on
each lane: a create may name a lane (`stream_id`), and appends and cancels name the same lane;
lanes run concurrently. With the multi-agent beta, `response.inject` answers the calls of the
Response it names by id, whatever its lane: the same suspension, resumed the same way.

With a store, a suspended Response outlives its connection and its process: an append that
names it (`response_id`) on a lane with nothing open resumes it from the store (resume.py).

`response.steer` does not start a successor Response here: the one Response of the rollout
cuts its segment at the next safe point and goes on with the steer's messages (its
`response.in_progress` is the commit point), so the rollout keeps its one id and warm state;
while it waits on tool outputs the steer is pending and follows the append that answers them.
"""

from __future__ import annotations

import attrs

from proto_server.core.request import PROTOTYPE_COMPACTION, warmup_field
from proto_server.core.response import Mode
from proto_server.server.dialects.lanes import DialectBase, serve_steer
from proto_server.server.rollouts.appending import prepare_append
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.rollouts.turns import TurnSource
from proto_server.server.transport.outbox import LaneSink
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseInject,
    ResponseSteer,
)


@attrs.frozen
class Ended:
    """The last Response of a lane, once it ended: enough to say so to an append or a cancel."""

    response_id: str
    status: str


class _Lane:
    """A lane's open Response, or the id and final status of its last one once it ended:
    enough to say so, and nothing of what it held (an idle lane keeps no conversation)."""

    def __init__(self, stream_id: str | None, sink: LaneSink) -> None:
        self.stream_id = stream_id
        self.sink = sink
        self.current: SamplingLoop | None = None
        self.ended: Ended | None = None


class PrototypeDialect(DialectBase[_Lane]):
    async def handle(self, event: ClientEvent, frame_bytes: int) -> None:
        match event:
            case ResponseCreate():
                await self._create(event, frame_bytes)
            case ResponseAppend(response_id=str(response_id), stream_id=stream_id) if self._resumes(
                response_id, stream_id
            ):
                await self._resume(event, frame_bytes)
            case ResponseAppend(stream_id=stream_id):
                loop = self._open_rollout(stream_id, "append to")
                responses = self._responses
                rendered = await prepare_append(
                    loop.machine,
                    event,
                    generator=responses.generator,
                    offload=responses.offload,
                    size=frame_bytes,
                )
                # asked again after the await: the lane's Response may have ended meanwhile
                loop = self._open_rollout(stream_id, "append to")
                loop.append(event.input, rendered, tool_choice=event.tool_choice)
            case ResponseCancel(stream_id=stream_id):
                self._open_rollout(stream_id, "cancel").cancel()
            case ResponseInject():
                await self._inject(event, frame_bytes)
            case ResponseSteer():
                # the same Response goes on with the steer's messages (ResponseMachine.steer)
                await serve_steer(
                    event,
                    find=self._find,
                    ended=self._ended,
                    lane=self._connection.lane,
                    budget=self._connection.budget,
                )

    def _resumes(self, response_id: str, stream_id: str | None) -> bool:
        """Whether an append naming `response_id` resumes it from the store onto its lane (no
        Response is open there); one that names another than the lane's open Response, or one
        open on another lane, is refused."""
        lane = self._lanes.get(stream_id)
        current = lane.current if lane is not None else None
        if current is not None and not current.ended:
            if current.machine.id != response_id:
                raise ProtocolError(
                    "invalid_field",
                    f"`response_id` {quoted(response_id)} is not the Response open on this "
                    f"lane ({current.machine.id}); leave it out, or name that one.",
                    param="response_id",
                )
            return False
        found = self._find(response_id)
        if found is not None:
            raise ProtocolError(
                "invalid_field",
                f"Response {quoted(response_id)} is open on lane {found[1].stream_id!r} of this "
                "connection; append to it there.",
                param="response_id",
            )
        return True

    async def _resume(self, append: ResponseAppend, frame_bytes: int) -> None:
        """A suspended Response of another connection (or process), rebuilt from the store and
        resumed on this lane (resume.py)."""
        lane = self._lane(append.stream_id)
        loop = await self._responses.resume(
            append,
            owner=self._owner,
            budget=self._connection.budget,
            events=lane.sink,
            size=frame_bytes,
        )
        lane.current = loop
        self._nursery.start_soon(self._run, lane, loop)

    def _lane(self, stream_id: str | None) -> _Lane:
        lane = self._lanes.get(stream_id)
        if lane is None:
            self._names.admit(stream_id)
            lane = self._lanes[stream_id] = _Lane(stream_id, self._connection.lane(stream_id))
        return lane

    def _open_rollout(self, stream_id: str | None, verb: str) -> SamplingLoop:
        """The lane's Response (whether it still takes `verb` is its machine's to say)."""
        lane = self._lanes.get(stream_id)
        where = "this connection" if stream_id is None else f"lane {stream_id!r}"
        rollout = lane.current if lane is not None else None
        if rollout is not None:
            return rollout
        ended = lane.ended if lane is not None else None
        if ended is None:
            raise ProtocolError(
                "no_open_response",
                f"There is no open Response to {verb} on {where}; start one with response.create.",
            )
        raise ProtocolError(
            "no_open_response",
            f"Response {ended.response_id} already ended ({ended.status}); there is "
            f"nothing to {verb}. Start a new Response with response.create.",
        )

    async def _create(self, create: ResponseCreate, frame_bytes: int) -> None:
        lane = self._lanes.get(create.stream_id)
        current = lane.current if lane is not None else None
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
                "creating another on its lane (or name another stream_id).",
            )
        if create.previous_response_id is not None:
            raise _unsupported(
                "previous_response_id", "a prototype Response continues with response.append"
            )
        if (warmup := warmup_field(create)) is not None:
            raise _unsupported(warmup, "warm-ups belong to the launched dialect")
        lane = self._lane(create.stream_id)
        await self._responses.check(create, size=frame_bytes)
        if create.context_management:  # valid (checked above), and not for this dialect
            raise _unsupported("context_management", PROTOTYPE_COMPACTION)
        loop = await self._responses.begin(
            create,
            lane.sink,
            budget=self._connection.budget,
            source=TurnSource.FRESH,
            owner=self._owner,
            mode=Mode.SUSPEND,
            size=frame_bytes,
        )
        lane.current = loop
        self._nursery.start_soon(self._run, lane, loop)

    async def _run(self, lane: _Lane, loop: SamplingLoop) -> None:
        """The rollout lives exactly as long as its one Response."""
        try:
            await loop.run_and_close()
        finally:
            self._ended.add(loop.machine.id, lane.stream_id)
            if lane.current is loop:
                lane.ended = Ended(loop.machine.id, loop.machine.status.value)
                lane.current = None

    async def drain(self) -> None:
        for lane in list(self._lanes.values()):
            if lane.current is not None:
                await lane.current.wait_settled()

    async def expire(self, reason: str) -> None:
        loops = [lane.current for lane in self._lanes.values() if lane.current is not None]
        for loop in loops:
            if not loop.ended:
                loop.expire(reason)
        for loop in loops:
            await loop.wait_ended()

    async def aclose(self) -> None:
        """Nothing outlives a Response here: each rollout closes with it (`run_and_close`)."""


def _unsupported(field: str, why: str) -> ProtocolError:
    return ProtocolError(
        "invalid_field",
        f"`{field}` is not supported in the prototype dialect: {why}. Remove it, or connect "
        "without the prototype opt-in to use the launched dialect.",
        param=field,
    )
