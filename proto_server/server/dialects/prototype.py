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

from typing import Any

import attrs
import trio

from proto_server.core.request import PROTOTYPE_COMPACTION, refuse_background, warmup_field
from proto_server.core.response import Mode, Status
from proto_server.server.dialects.lanes import DialectBase, serve_steer
from proto_server.server.rollouts.appending import prepare_append
from proto_server.server.rollouts.kept import Holding, Relay
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.rollouts.turns import TurnSource
from proto_server.server.transport.outbox import LaneAnswers, LaneSink
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseInject,
    ResponseSteer,
)
from proto_server.wire.reattach import ResponseReattach


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
        #: What streams `current` to this lane when it is kept for a reattach.
        self.relay: Relay | None = None


class PrototypeDialect(DialectBase[_Lane]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Its Responses that run on kept for a reattach once its client went.
        self._holding = Holding(self._responses.detached)

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
            case ResponseReattach():
                await self._reattach(event)
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

    def _answers(self, lane: _Lane) -> LaneAnswers:
        """A Response kept for a reattach is answered through its relay, so that what answers
        a frame about it is kept among its events: a replay across it has no gap."""
        return lane.relay if lane.relay is not None else lane.sink

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
        refuse_background(create)
        await self._responses.check(create, size=frame_bytes)
        if create.context_management:  # valid (checked above), and not for this dialect
            raise _unsupported("context_management", PROTOTYPE_COMPACTION)
        responses = self._responses
        kept = responses.keeper(self._owner)
        relay = None
        if kept is not None:
            config = responses.config
            relay = Relay(kept, grace_s=config.reattach_grace_s)
        loop = await responses.begin(
            create,
            lane.sink if relay is None else relay,
            budget=self._connection.budget,
            source=TurnSource.FRESH,
            owner=self._owner,
            mode=Mode.SUSPEND,
            size=frame_bytes,
        )
        lane.current = loop
        if relay is None:
            self._nursery.start_soon(self._run, lane, loop)
            return
        relay.kept.response_id, relay.loop = loop.machine.id, loop
        relay.attach_now(lane.sink)
        lane.relay = relay
        self._nursery.start_soon(self._run_kept, lane, loop, relay)

    async def _run_kept(self, lane: _Lane, loop: SamplingLoop, relay: Relay) -> None:
        """`_run`, for a Response kept for a reattach: shielded from its connection's end, which
        `_follow` tells its relay of; the relay cuts it if no lane takes it within the grace."""
        self._nursery.start_soon(self._follow, lane, loop, relay)
        try:
            with trio.CancelScope(shield=True) as own:
                relay.cut = own.cancel
                async with self._responses.detached.keeping(relay.kept), trio.open_nursery() as n:
                    n.start_soon(relay.run)
                    await loop.run_and_close()
                    if relay.target is not None:
                        n.cancel_scope.cancel()  # its end went to its lane: nothing to wait for
        finally:
            relay.done.set()
            relay.let_go()  # a writer's last batch may still name the relay: not the rollout
            self._holding.over(relay)

    async def _reattach(self, event: ResponseReattach) -> None:
        """A Response kept since its connection dropped, attached to a lane that has carried
        nothing yet (it goes on with the Response's numbers); then appended to as usual."""
        if event.stream_id in self._lanes:
            raise ProtocolError(
                "invalid_field",
                "Send response.reattach on a lane that has carried nothing yet (a new "
                "connection's first frame, or a new stream_id): the lane takes the Response's "
                "sequence numbers.",
                param="stream_id",
            )
        kept = self._responses.detached.find(event.response_id, self._owner)
        relay = kept.relay if kept is not None else None
        if relay is None or relay.loop is None or relay.done.is_set():
            raise ProtocolError(
                "response_not_found",
                f"No Response {quoted(event.response_id)} to reattach to: only one whose "
                "connection dropped mid-stream is kept, for --reattach-grace, and only for the "
                "key that created it.",
                param="response_id",
            )
        lane = self._lane(event.stream_id)
        loop = relay.loop
        lane.current, lane.relay = loop, relay  # before the replay: an append may follow it
        try:
            await relay.attach(lane.sink, event.starting_after)
        except ProtocolError:
            lane.current = lane.relay = None
            raise
        self._nursery.start_soon(self._follow, lane, loop, relay)

    async def _follow(self, lane: _Lane, loop: SamplingLoop, relay: Relay) -> None:
        """The lane of a kept Response, let go with it; if this connection ends first (its
        nursery cancelled, however), its relay is told: one that streams waits for a
        reattach (--reattach-grace), one that is suspended is let go at once, as before."""
        try:
            await relay.done.wait()
        finally:
            if not relay.done.is_set():
                relay.lost(lane.sink)
                self._holding.lost(relay)  # this connection stays open only for it
                stopping = self._responses.detached.stopping
                suspended = loop.machine.status is Status.SUSPENDED
                if relay.target is None and (stopping or suspended):
                    relay.cut()
            self._ended.add(loop.machine.id, lane.stream_id)
            self._let_go(lane, loop)

    def _let_go(self, lane: _Lane, loop: SamplingLoop) -> None:
        if lane.current is loop:
            lane.ended = Ended(loop.machine.id, loop.machine.status.value)
            lane.current = lane.relay = None

    async def _run(self, lane: _Lane, loop: SamplingLoop) -> None:
        """The rollout lives exactly as long as its one Response."""
        try:
            await loop.run_and_close()
        finally:
            self._ended.add(loop.machine.id, lane.stream_id)
            self._let_go(lane, loop)

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
        """Nothing outlives a Response here: each rollout closes with it (`run_and_close`),
        but for one kept for a reattach (`_follow`)."""


def _unsupported(field: str, why: str) -> ProtocolError:
    return ProtocolError(
        "invalid_field",
        f"`{field}` is not supported in the prototype dialect: {why}. Remove it, or connect "
        "without the prototype opt-in to use the launched dialect.",
        param=field,
    )
