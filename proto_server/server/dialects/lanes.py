"""What both WebSocket dialects share about lanes (`stream_id`) and `response.inject`.

A lane is a FIFO of Responses inside one connection: one in flight per lane, lanes run
concurrently, each lane's events carry its `stream_id` and are numbered from 0 on their own
(`Connection.lane`). A create without `stream_id` runs on the default lane, as before lanes.
How many named lanes a connection may use is bounded (`--max-lanes`); each dialect keeps its
own per-lane state (the launched dialect a queue and a warm cache, the prototype dialect the
open Response), so steering can later find a Response's lane and successor here too.

`response.inject` (the multi-agent beta, `OpenAI-Beta: responses_multi_agent=v1`) commits tool
outputs to a Response that waits on them: the prototype dialect's suspension and
`response.append`, named by response id. `serve_inject` is that one path for both dialects.

`response.steer` names a Response by id too, and its answers go to that Response's lane:
`serve_steer` is the one path for both dialects; what the steer does is the machine's
(`ResponseMachine.steer`), and each dialect says where a Response id is (`find`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from proto_server.core.conversation import decoded_bytes, render_items
from proto_server.core.ids import new_id
from proto_server.core.response import Mode, Steer, steer_failed
from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.process.memory import MemoryBudget
from proto_server.server.process.offload import Offload
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.store import ANONYMOUS
from proto_server.server.transport.outbox import LaneAnswers, LaneSink
from proto_server.wire.converter import steer_items
from proto_server.wire.errors import ProtocolError, SteerRefused, on_lane, quoted
from proto_server.wire.events import (
    InjectError,
    ResponseInject,
    ResponseInjectCreated,
    ResponseInjectFailed,
    ResponseSteer,
    ServerEvent,
)

if TYPE_CHECKING:
    import trio

    from proto_server.server.rollouts.responses import Responses
    from proto_server.server.transport.connection import ClientLanes

#: The `OpenAI-Beta` value of the multi-agent beta (`client.beta.responses.connect()` users
#: send it in `extra_headers`; the SDK does not add it by itself).
MULTI_AGENT_BETA = "responses_multi_agent=v1"
#: Ended Responses a connection remembers, to answer an inject with `response_already_completed`
#: rather than `response_not_found`.
REMEMBERED_ENDED = 256


def beta_values(header: str | None) -> list[str]:
    return (header or "").replace(" ", "").split(",")


class LaneNames:
    """The named lanes a connection has used; one past `limit` is refused. A name stays
    counted for the connection's life (its lane keeps state), as OpenAI counts them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def admit(self, stream_id: str | None) -> None:
        if stream_id is None or stream_id in self._seen:
            return
        if len(self._seen) >= self.limit:
            raise ProtocolError(
                "websocket_stream_limit_reached",
                f"This connection already uses {self.limit} named lanes (--max-lanes); "
                f"stream_id {quoted(stream_id)} would be one more. Reuse a lane, or open "
                "another connection.",
                param="stream_id",
                stream_id=stream_id,
            )
        self._seen.add(stream_id)


class EndedResponses:
    """The ids of the Responses that ended on a connection lately, and their lanes."""

    def __init__(self, limit: int = REMEMBERED_ENDED) -> None:
        self._limit = limit
        self._ended: collections.OrderedDict[str, str | None] = collections.OrderedDict()

    def add(self, response_id: str, stream_id: str | None) -> None:
        self._ended[response_id] = stream_id
        while len(self._ended) > self._limit:
            self._ended.popitem(last=False)

    def lane_of(self, response_id: str) -> tuple[bool, str | None]:
        """Whether it ended here, and on which lane."""
        if response_id in self._ended:
            return True, self._ended[response_id]
        return False, None


def require_beta(enabled: bool, what: str) -> None:
    if not enabled:
        raise ProtocolError(
            "unknown_event_type" if what == "response.inject" else "invalid_field",
            f"{what} belongs to the multi-agent beta; connect with the header "
            f"`OpenAI-Beta: {MULTI_AGENT_BETA}` to use it.",
            param="type" if what == "response.inject" else "multi_agent",
        )


async def serve_inject(
    inject: ResponseInject,
    *,
    find: Callable[[str], tuple[SamplingLoop, LaneAnswers] | None],
    ended: EndedResponses,
    lane: Callable[[str | None], LaneSink],
    offload: Offload,
    size: int,
) -> None:
    """Commit `inject` to the Response it names, atomically, or refuse it whole.

    `response.inject.created` on the Response's lane once every item is committed; the
    Response resumes only after it. `response.inject.failed` (`response_not_found`,
    `response_already_completed`) returns the input as sent. Items that do not answer the
    Response's pending calls are an `error` (`unknown_call_id`, `duplicate_call_id`,
    `invalid_field`) on its lane; nothing was committed."""
    response_id = inject.response_id

    async def failed(code: str, message: str, sink: LaneAnswers) -> None:
        error = InjectError(code=code, message=message)
        await sink.send(
            ResponseInjectFailed(response_id=response_id, error=error, input=inject.raw_input)
        )

    def target() -> tuple[SamplingLoop, LaneAnswers] | None:
        found = find(response_id)
        if found is not None and not found[0].ending:
            return found
        return None

    found = find(response_id)
    if found is None or found[0].ending:
        known, stream_id = ended.lane_of(response_id)
        if found is not None or known:
            sink = found[1] if found is not None else lane(stream_id)
            message = f"Response {quoted(response_id)} already ended; nothing was committed."
            await failed("response_already_completed", message, sink)
        else:
            message = (
                f"No active Response {quoted(response_id)} on this connection; nothing was "
                "committed."
            )
            await failed("response_not_found", message, lane(None))
        return
    loop, sink = found
    if loop.machine.mode is Mode.SUCCESSOR:
        raise ProtocolError(
            "invalid_field",
            f"Response {quoted(response_id)} does not wait for injected input; create it with "
            '`multi_agent: {"enabled": true}` to answer its tool calls by response.inject.',
            param="response_id",
            stream_id=sink.stream_id,
        )
    with on_lane(sink.stream_id):
        loop.machine.check_inject(inject.input)  # before the work of rendering them
    conversation = loop.rollout.conversation
    # rendered after the conversation's last item now; if the segment streaming meanwhile adds
    # one, extend_rendered renders them again after it
    rendered = await offload.run(
        render_items, conversation.renderer, inject.input, conversation.render_after, size=size
    )
    if target() is None:  # it ended while the items were rendered
        message = f"Response {quoted(response_id)} ended; nothing was committed."
        await failed("response_already_completed", message, sink)
        return
    with on_lane(sink.stream_id):
        loop.machine.check_inject(inject.input)
        loop.inject(inject.input, rendered)
    await sink.send(ResponseInjectCreated(response_id=response_id))
    loop.wake()


class SteerTarget(Protocol):
    """What a steer can name: a Response that streams or waits (`SamplingLoop`), or one that
    a dialect keeps steers for. `steer` accepts (returning the events that say so) or raises
    `SteerRefused`, changing nothing."""

    def steer(self, steer: Steer) -> list[ServerEvent]: ...


class NotStarted:
    """A Response announced by `response.queued` that has not begun: nothing to steer yet."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id

    def steer(self, steer: Steer) -> list[ServerEvent]:
        raise SteerRefused(
            "response_not_active",
            f"Response {quoted(self.response_id)} is queued and has not started; steer it "
            "once its response.created has come, or add the input to a response.create.",
        )


async def serve_steer(
    frame: ResponseSteer,
    *,
    find: Callable[[str], tuple[SteerTarget, LaneAnswers] | None],
    ended: EndedResponses,
    lane: Callable[[str | None], LaneSink],
    budget: MemoryBudget,
) -> None:
    """Queue `frame` on the Response it names, or return its input with the reason.

    Every answer goes to that Response's lane (an unknown one's to the default lane):
    `response.steer.accepted` (and `.pending` if the Response waits on tool outputs), or
    `response.steer.failed` with the input as sent: `invalid_input` (not a string or user
    messages, or sent with a `stream_id`), `response_not_found`, `response_already_completed`,
    what the Response itself refuses (`ResponseMachine.steer`), and the memory budget's own
    codes (`connection_memory_limit`, `server_busy`) for one that does not fit `budget`. No
    steer goes unanswered. An accepted steer is charged to `budget` by what holds it (the
    Response's rollout, `held_bytes`; a lane's queue) until it is applied or fails."""
    response_id = frame.previous_response_id
    found = find(response_id)
    known, stream_id = ended.lane_of(response_id)
    sink = found[1] if found is not None else lane(stream_id if known else None)

    async def failed(code: str, message: str) -> None:
        await sink.send(steer_failed(code, message, frame.input, response_id))

    if frame.stream_id is not None:
        await failed(
            "invalid_input",
            "Send response.steer without `stream_id`: the Response it steers decides the lane.",
        )
        return
    try:
        items = steer_items(frame.input)
    except SteerRefused as exc:
        await failed(exc.code, exc.message)
        return
    if found is None:
        if known:
            await failed(
                "response_already_completed",
                f"Response {quoted(response_id)} already ended; nothing was queued.",
            )
        else:
            await failed(
                "response_not_found",
                f"No Response {quoted(response_id)} is active on this connection; nothing "
                "was queued.",
            )
        return
    nbytes = decoded_bytes(items, text=isinstance(frame.input, str))
    try:
        budget.check(nbytes, "This steer")
    except ProtocolError as exc:
        code = exc.detail.code
        metrics.ERRORS.labels(code).inc()
        log.warning(
            "steer.refused",
            extra={"response": response_id, "code": code, "needed": nbytes, "used": budget.used},
        )
        await failed(code, exc.detail.message)
        return
    steer = Steer(
        id=new_id("steer"),
        previous_response_id=response_id,
        items=items,
        raw_input=frame.input,
        nbytes=nbytes,
    )
    try:
        # nothing awaits between the check and the holder's charge: what fit still fits
        events = found[0].steer(steer)
    except SteerRefused as exc:
        await failed(exc.code, exc.message)
        return
    for event in events:  # before any event of the cut it may bring (the channel is FIFO)
        await sink.send(event)


class OpenLane(Protocol):
    """A lane as both dialects keep it: where its events go, and its Response in flight."""

    sink: LaneSink
    current: SamplingLoop | None


L = TypeVar("L", bound=OpenLane)


class DialectBase(Generic[L]):
    """What both WebSocket dialects hold for a connection and serve alike: the lane table
    (each dialect's own kind of lane, `L`), the lanes' names and the Responses that ended,
    finding a Response in flight by id, and `response.inject`."""

    def __init__(
        self,
        responses: Responses,
        connection: ClientLanes,
        nursery: trio.Nursery,
        *,
        owner: str = ANONYMOUS,
        multi_agent: bool = False,
    ) -> None:
        self._responses = responses
        self._connection = connection
        self._nursery = nursery
        self._owner = owner
        #: The connection opted into the multi-agent beta: `response.inject` is served.
        self._multi_agent = multi_agent
        self._lanes: dict[str | None, L] = {}
        self._names = LaneNames(responses.config.max_lanes)
        self._ended = EndedResponses()

    @property
    def current(self) -> SamplingLoop | None:
        """The default lane's Response in flight."""
        lane = self._lanes.get(None)
        return lane.current if lane is not None else None

    def _find(self, response_id: str) -> tuple[SamplingLoop, LaneAnswers] | None:
        """The Response in flight with this id, and where answers about it go."""
        for lane in self._lanes.values():
            if lane.current is not None and lane.current.machine.id == response_id:
                return lane.current, self._answers(lane)
        return None

    def _answers(self, lane: L) -> LaneAnswers:
        """Where answers about `lane`'s Response go: the lane."""
        return lane.sink

    async def _inject(self, inject: ResponseInject, frame_bytes: int) -> None:
        require_beta(self._multi_agent, "response.inject")
        await serve_inject(
            inject,
            find=self._find,
            ended=self._ended,
            lane=self._connection.lane,
            offload=self._responses.offload,
            size=frame_bytes,
        )
