"""The launched dialect: every turn is a `response.create`, chained by `previous_response_id`.

The connection keeps its most recent Response's rollout warm (conversation, rendered tokens,
generator session). A follow-up that names it and sends only the new items extends that state:
the same warm rollout as the prototype dialect, with a new Response id per turn. A miss is served
from the persisted store when the request has `store: true` (cold: re-rendered, re-prefilled),
else refused with `previous_response_not_found`. A failed turn evicts what it chained from.
The store serves only the responses of the connection's owner (its API key); a store that cannot
answer is an `error` event (`store_unavailable`), and the connection lives on.

Lanes (`stream_id`): each lane serves its creates one at a time, in order (a create that waits
behind another gets `response.queued`, then its `response.created` when its turn comes), in a
bounded queue; lanes run concurrently. Each lane keeps its own last Response warm, and a create
may name another lane's last Response as `previous_response_id`: a fork, rebuilt from that
Response's items while it stays warm on its own lane (a failed fork evicts nothing).

With the multi-agent beta, a create with `multi_agent: {"enabled": true}` runs as the prototype
dialect's long-lived Response: on tool calls it waits, still `in_progress`, and
`response.inject` answers the calls and resumes it (lanes.py).

Steering (`response.steer`): a steered Response ends `incomplete` (`steered`) at a safe point,
and a successor with the same settings, `previous_response_id` the steered one and the steers'
messages as input, goes first in its lane's queue, served from the warm rollout (its
`response.created` commits the steers). A steer that comes too late to cut the Response
starts the successor after its completion all the same. A Response that completed with calls
awaiting output keeps its steers pending (`Awaiting`) for the create that answers them: they
follow that create's input; a create on the lane that does not continue it returns them.

A lane's queue, its warm rollout and the steers waiting on its last Response are one state that
each turn takes and hands on (`_serve_turn` takes the cache, `_follow` queues the successor or
parks the steers); `_Lane` closes the warm rollout, and only the dialect's turns take and keep
it. The steers held for a continuing create, and the successor of a steered Response, are
launched_steers.py's.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import attrs
import trio

from proto_server.core.ids import new_id
from proto_server.core.render import requested_effort
from proto_server.core.request import input_items, refuse_background, response_template
from proto_server.core.response import STEERED, Mode, Status, Steer
from proto_server.server.dialects.lanes import (
    DialectBase,
    NotStarted,
    SteerTarget,
    require_beta,
    serve_steer,
)
from proto_server.server.dialects.launched_steers import Awaiting, successor
from proto_server.server.process.logs import log
from proto_server.server.rollouts.responses import Responses
from proto_server.server.rollouts.rollout import Rollout
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.rollouts.turns import TurnSource
from proto_server.server.store import (
    ANONYMOUS,
    STORED,
    StoreUnavailable,
    history_of,
    previous_response_not_found,
)
from proto_server.server.transport.outbox import LaneSink
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseCreated,
    ResponseIncomplete,
    ResponseInject,
    ResponseQueued,
    ResponseSteer,
)
from proto_server.wire.reattach import ResponseReattach

if TYPE_CHECKING:
    from proto_server.server.transport.connection import ClientLanes


@attrs.frozen
class _Queued:
    """A create waiting for its turn on its lane: the bytes it is charged, its frame's size,
    and the id its `response.queued` announced (None: it did not wait)."""

    create: ResponseCreate
    waiting: int
    size: int
    response_id: str | None
    #: A steered Response's successor: the steers its `response.created` commits.
    steers: tuple[Steer, ...] = ()


@attrs.frozen
class Warm:
    """A lane's last completed Response and the rollout that holds it, warm for the next turn."""

    response_id: str
    rollout: Rollout


class _Lane:
    """One lane: its creates in order, the one in flight, its last completed Response warm.

    The lane owns that warm rollout (`cached`): it is closed here and only here, when a newer
    one replaces it (`keep`), when the lane lets it go (`drop`, `evict`), or by the turn that
    `take`s it. It is what the memory budget lets go of when its cache sits idle (`evict`)."""

    def __init__(self, stream_id: str | None, sink: LaneSink, nursery: trio.Nursery) -> None:
        self.stream_id = stream_id
        self.sink = sink
        self._nursery = nursery
        self.queue: collections.deque[_Queued] = collections.deque()
        self.current: SamplingLoop | None = None
        self.cached: Warm | None = None
        self.serving = False  # its task runs (serving the queue's creates one by one)
        self.preparing = False  # the create at the head is being prepared
        self.awaiting: Awaiting | None = None

    @property
    def busy(self) -> bool:
        """Whether a new create waits behind another: one queued, one being prepared, or a
        Response that has not ended (one whose terminal event is out waits for nothing)."""
        if self.queue or self.preparing:
            return True
        return self.current is not None and not self.current.ended

    async def keep(self, response_id: str, rollout: Rollout) -> None:
        """`rollout` (of `response_id`, just completed) is the lane's warm state now; the one
        it replaces (a miss, a fork or the store left that in place) goes."""
        replaced, self.cached = self.cached, Warm(response_id, rollout)
        if replaced is not None:
            await replaced.rollout.aclose()

    def take(self) -> Warm | None:
        """The warm rollout, for a turn that now owns it (and closes it, or keeps it again)."""
        cached, self.cached = self.cached, None
        return cached

    async def drop(self) -> None:
        """Let the warm rollout go (a fresh conversation, or the connection ended)."""
        cached, self.cached = self.cached, None
        if cached is not None:
            await cached.rollout.aclose()

    def evict(self, reason: str) -> None:
        """A memory budget lets the cached rollout go; a follow-up that names it is served from
        the store, or refused with `previous_response_not_found`."""
        cached, self.cached = self.cached, None
        if cached is not None:
            log.info(
                "cache.evicted",
                extra={
                    "response": cached.response_id,
                    "reason": reason,
                    "stream_id": self.stream_id,
                },
            )
            cached.rollout.release_budget()
            self._nursery.start_soon(cached.rollout.aclose)


class LaunchedDialect(DialectBase[_Lane]):
    def __init__(
        self,
        responses: Responses,
        connection: ClientLanes,
        nursery: trio.Nursery,
        *,
        owner: str = ANONYMOUS,
        multi_agent: bool = False,
    ) -> None:
        super().__init__(responses, connection, nursery, owner=owner, multi_agent=multi_agent)
        self._serving = 0
        self._idle = trio.Event()
        self._idle.set()
        self._expired: str | None = None
        self._gone = False

    # -- the default lane, as before lanes (tests and callers read these) ----------------------

    @property
    def cached(self) -> Warm | None:
        lane = self._lanes.get(None)
        return lane.cached if lane is not None else None

    # -- frames ---------------------------------------------------------------------------------

    async def handle(self, event: ClientEvent, frame_bytes: int) -> None:
        match event:
            case ResponseCreate():
                await self._create(event, frame_bytes)
            case ResponseAppend():
                raise ProtocolError(
                    "unknown_event_type",
                    "response.append belongs to the prototype dialect; on this connection send "
                    "response.create with previous_response_id and only the new items, or "
                    "reconnect with the prototype opt-in.",
                    param="type",
                )
            case ResponseCancel(stream_id=stream_id):
                lane = self._lanes.get(stream_id)
                current = lane.current if lane is not None else None
                if current is None:
                    where = "this connection" if stream_id is None else f"lane {stream_id!r}"
                    raise ProtocolError("no_open_response", f"No response is in flight on {where}.")
                current.cancel()  # its machine refuses one that is ending or ended
            case ResponseReattach():
                why = "response.reattach is the prototype dialect's; here, reattach over HTTP."
                raise ProtocolError("unknown_event_type", why, param="type")
            case ResponseInject():
                await self._inject(event, frame_bytes)
            case ResponseSteer():
                await serve_steer(
                    event,
                    find=self._steerable,
                    ended=self._ended,
                    lane=self._connection.lane,
                    budget=self._connection.budget,
                )

    async def _create(self, create: ResponseCreate, frame_bytes: int) -> None:
        if create.waits_for_injects:
            require_beta(self._multi_agent, "`multi_agent`")
        self._names.admit(create.stream_id)
        lane = self._lane(create.stream_id)
        limit = self._responses.config.max_queued_requests  # at least 1 (ServerConfig)
        if len(lane.queue) >= limit:
            where = "" if create.stream_id is None else f" on lane {create.stream_id!r}"
            raise ProtocolError(
                "concurrent_request",
                f"{limit} response.create frames are already waiting behind the one in "
                f"flight{where}; wait for a response.completed before sending more.",
            )
        refuse_background(create)
        waiting = await self._responses.check(create, size=frame_bytes)
        if len(lane.queue) >= limit:  # filled while this one was checked off the event loop
            raise ProtocolError(
                "concurrent_request",
                f"{limit} response.create frames are already waiting; wait for a "
                "response.completed before sending more.",
            )
        self._connection.budget.admit(waiting, "This response.create")
        response_id = None
        if lane.busy:  # it waits behind another: say so now, with the id it will have
            response_id = new_id("resp")
            template = response_template(
                create,
                response_id=response_id,
                created_at=int(time.time()),
                default_model=self._responses.config.default_model,
            )
            lane.queue.append(_Queued(create, waiting, frame_bytes, response_id))
            await lane.sink.send(ResponseQueued(response=attrs.evolve(template, status="queued")))
        else:
            lane.queue.append(_Queued(create, waiting, frame_bytes, None))
        if not lane.serving:
            lane.serving = True
            self._serving += 1
            self._idle = trio.Event()
            self._nursery.start_soon(self._serve_lane, lane)

    def _lane(self, stream_id: str | None) -> _Lane:
        lane = self._lanes.get(stream_id)
        if lane is None:
            sink = self._connection.lane(stream_id)
            lane = self._lanes[stream_id] = _Lane(stream_id, sink, self._nursery)
        return lane

    def _steerable(self, response_id: str) -> tuple[SteerTarget, LaneSink] | None:
        """What a steer naming `response_id` reaches: a Response in flight, one that waits for
        its outputs' create, or one still queued."""
        for lane in self._lanes.values():
            if lane.current is not None and lane.current.machine.id == response_id:
                return lane.current, lane.sink
            if lane.awaiting is not None and lane.awaiting.response_id == response_id:
                return lane.awaiting, lane.sink
            if any(queued.response_id == response_id for queued in lane.queue):
                return NotStarted(response_id), lane.sink
        return None

    # -- the connection's end -----------------------------------------------------------------

    async def drain(self) -> None:
        """Serve what is already queued, accept nothing more."""
        await self._idle.wait()

    async def expire(self, reason: str) -> None:
        """Start no queued turn; end the ones in flight with `response.incomplete`."""
        self._expired = reason
        for lane in self._lanes.values():
            if lane.current is not None:
                lane.current.expire(reason)
        await self._idle.wait()

    # -- serving a lane -------------------------------------------------------------------------

    async def _serve_lane(self, lane: _Lane) -> None:
        try:
            while lane.queue:
                queued = lane.queue.popleft()
                self._connection.budget.charge(-queued.waiting)  # the rollout is charged instead
                if self._expired is None:
                    await self._serve_turn(lane, queued)
                elif queued.steers:  # a successor that will not start: its steers come back
                    await _fail_steers(lane.sink, queued.steers, "response_not_active")
                else:  # the connection is closing: what still waits is told it ends unserved
                    await self._end_unserved(lane, queued, self._expired)
                del queued  # an idle lane holds no request: only its cache, if any
        finally:
            for queued in lane.queue:  # cancelled: what still waited is no longer counted
                self._connection.budget.charge(-queued.waiting)
            lane.queue.clear()
            lane.serving = False
            self._serving -= 1
            if not self._serving:
                self._idle.set()

    async def _end_unserved(self, lane: _Lane, queued: _Queued, reason: str) -> None:
        """A create that waited and will never be served (the server stops): it becomes a
        Response that ends at once, `response.incomplete` with `reason`, so no create that
        was accepted goes unanswered."""
        template = response_template(
            queued.create,
            response_id=queued.response_id or new_id("resp"),
            created_at=int(time.time()),
            default_model=self._responses.config.default_model,
        )
        await lane.sink.send(ResponseCreated(response=template))
        ended = attrs.evolve(template, status="incomplete", incomplete_details={"reason": reason})
        await lane.sink.send(ResponseIncomplete(response=ended))

    async def _serve_turn(self, lane: _Lane, queued: _Queued) -> None:
        """One turn; the rollout goes to its lane's cache if it completed. Nothing of the turn
        is kept once it returns but the cache, which a memory budget can let go."""
        create, steers = queued.create, queued.steers
        awaiting, lane.awaiting = lane.awaiting, None
        if awaiting is not None and awaiting.steers:
            if create.previous_response_id == awaiting.response_id:
                # the outputs it waited for: the pending steers follow them (still charged
                # while the create is prepared; its rollout holds them after)
                steers = tuple(awaiting.steers)
                items = (*input_items(create), *(i for steer in steers for i in steer.items))
                create = attrs.evolve(create, input=items)
            else:
                await _fail_steers(
                    lane.sink,
                    awaiting.release(),
                    "response_not_active",
                    f"the next create on its lane did not continue {awaiting.response_id}",
                )
        lane.preparing = True
        try:
            loop = await self._begin(lane, create, queued.size, queued.response_id)
        except (ProtocolError, StoreUnavailable) as exc:
            lane.preparing = False
            await lane.sink.refuse(exc)
            await _fail_steers(lane.sink, steers, "successor_creation_failed", exc.detail.message)
            return
        finally:
            lane.preparing = False
            if awaiting is not None:
                awaiting.release()
        if self._expired is not None:  # the server began stopping while it prepared
            await loop.close()
            await _fail_steers(lane.sink, steers, "response_not_active", self._expired)
            return
        lane.current = loop
        completed = False
        try:
            await loop.run()
            machine = loop.machine
            completed = machine.status is Status.COMPLETED or (
                machine.status is Status.INCOMPLETE and machine.incomplete_reason == STEERED
            )
        finally:
            lane.current = None
            self._ended.add(loop.machine.id, lane.stream_id)
            if completed and not self._gone:  # once the connection closed, nothing is kept
                self._connection.budget.idle(lane)
                await lane.keep(loop.machine.id, loop.rollout)
            else:
                log.info("cache.evicted", extra={"response": loop.machine.id})
                await loop.close()
        if completed and not self._gone:
            self._follow(lane, create, loop)

    def _follow(self, lane: _Lane, create: ResponseCreate, loop: SamplingLoop) -> None:
        """After a Response that ended steered or completed: its steers start a successor
        first in the lane's queue, or, if calls await output, wait for the create with them."""
        machine = loop.machine
        steers = machine.hand_over_steers()
        # the steers' charge moves from the rollout (`held_bytes`) to what holds them now
        loop.rollout.account(machine.held_bytes)
        budget = self._connection.budget
        if machine.status is Status.COMPLETED and machine.pending_calls:
            limit = self._responses.config.max_pending_steers
            required = machine.required_input()
            lane.awaiting = Awaiting(machine.id, required, list(steers), limit, budget)
        elif steers:
            waiting = sum(steer.nbytes for steer in steers)  # released as its turn begins
            budget.charge(waiting)
            lane.queue.appendleft(
                _Queued(successor(create, machine.id, steers), waiting, waiting, None, steers)
            )

    async def _begin(
        self, lane: _Lane, create: ResponseCreate, size: int, response_id: str | None
    ) -> SamplingLoop:
        responses = self._responses
        budget = self._connection.budget
        owner = self._owner
        previous = create.previous_response_id

        async def begin(source: TurnSource, **state: Any) -> SamplingLoop:
            return await responses.begin(
                create,
                lane.sink,
                budget=budget,
                source=source,
                size=size,
                owner=owner,
                response_id=response_id,
                mode=Mode.WAIT if create.waits_for_injects else Mode.SUCCESSOR,
                **state,
            )

        budget.busy(lane)
        cached = lane.take()  # whatever happens, this turn takes it
        if previous is None:
            if cached is not None:
                await cached.rollout.aclose()
            return await begin(TurnSource.FRESH)
        if cached is not None and cached.response_id == previous:
            rollout = cached.rollout
            if rollout.serves(
                create.instructions, create.tools, requested_effort(create.reasoning)
            ):
                try:
                    return await begin(TurnSource.CACHE, rollout=rollout)
                except BaseException:
                    await rollout.aclose()  # refused (or cancelled): the state goes with it
                    raise
            # new instructions, tools or effort: the prefix changed, so re-render everything
            history = list(rollout.conversation.items)
            await rollout.aclose()
            return await begin(TurnSource.REBUILT, history=history)
        lane.cached = cached  # a miss leaves the cache as it was
        if cached is not None:
            budget.idle(lane)
        parent = self._cached_elsewhere(previous, lane)
        if parent is not None:
            # a fork: the parent stays warm on its own lane; this one starts from its items
            return await begin(TurnSource.FORK, history=list(parent.conversation.items))
        lanes = "the most recent response of a lane of this connection"
        if create.store is False:  # with store: false only what this connection keeps
            raise previous_response_not_found(previous, f"{lanes} (store: false)")
        where = f"{lanes}, nor {STORED}"
        history = await history_of(responses.store, previous, owner=owner, where=where)
        return await begin(TurnSource.STORE, history=history)

    def _cached_elsewhere(self, response_id: str, lane: _Lane) -> Rollout | None:
        for other in self._lanes.values():
            if (
                other is not lane
                and other.cached is not None
                and other.cached.response_id == response_id
            ):
                return other.cached.rollout
        return None

    async def aclose(self) -> None:
        """The connection ended: every lane's warm state goes (its owner, `app.py`, holds this
        dialect in `contextlib.aclosing`, so this runs however the connection ends)."""
        self._gone = True  # a lane's turn that ends after this closes its rollout itself
        for lane in self._lanes.values():
            if lane.awaiting is not None:
                lane.awaiting.release()
            self._connection.budget.busy(lane)
            await lane.drop()


async def _fail_steers(
    sink: LaneSink, steers: tuple[Steer, ...], code: str, why: str | None = None
) -> None:
    """Steers that no Response will take: each comes back with its input."""
    for steer in steers:
        message = f"The steer of {steer.previous_response_id} was not applied"
        await sink.send(steer.failed(code, f"{message}: {why}." if why else f"{message}."))
