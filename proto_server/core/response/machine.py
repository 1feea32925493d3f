"""The Response state machine: where every streamed event is born.

One `ResponseMachine` per Response. The server calls it with what the generator produced (text,
tool calls, the end of a segment) and with what the client asked (append, cancel); each call
returns the events to send, in order. It never awaits and never reads a clock.

    in_progress --tool calls--> suspended --append answers all--> in_progress --> ...
    in_progress --no tool call--> completed
    in_progress | suspended --request_cancel / request_expire / request_fail--> ending
    ending --end()--> cancelled | incomplete | failed
    any open state --> failed | incomplete | cancelled

`ending`: the server decided to end the Response (the client cancelled it, the server expires
it, the generator failed) and its terminal event is not out yet; it takes nothing more (still
`in_progress` on the wire). Whether a Response is open is decided here alone.

Steering (`steer`): a steer is queued, and at the next safe point (between tokens, with no tool
call of the segment awaiting output: `steer_due`) `take_steers` applies it: a `successor`
Response ends `incomplete` (`steered`) and its steers go to the successor the dialect starts;
an `in_place` one (the prototype dialect) closes what streamed, takes the steer's messages, and
streams on as the same Response. A Response that stops for tool outputs keeps its steers
(`response.steer.pending`) until they arrive. One that ends otherwise fails them, input back.

A call that is not legal in the current state raises and changes nothing: a client's mistake is
a `ProtocolError` (it becomes an `error` event) or a `SteerRefused` (`response.steer.failed`),
a generator's is an `IllegalTransition` (a bug of the server, which fails the Response).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from proto_server.core import ids
from proto_server.core.conversation import TOKEN_BYTES, Conversation, RenderedItems
from proto_server.wire.errors import ErrorDetail, ProtocolError, SteerRefused, quoted, some_of
from proto_server.wire.events import (
    CompactionCompacting,
    ContentPartAdded,
    ContentPartDone,
    FailedSteer,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    RequiredInput,
    ResponseCancelled,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    ResponseSteerPending,
    ServerEvent,
    SteerError,
    SteerRef,
)
from proto_server.wire.items import (
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
    UnknownItem,
)
from proto_server.wire.response import InputTokensDetails, OutputTokensDetails, Response, Usage


class Status(enum.Enum):
    IN_PROGRESS = "in_progress"
    SUSPENDED = "suspended"
    #: Decided to end (cancelled, expired, failed); its terminal event is not out yet.
    ENDING = "ending"
    COMPLETED = "completed"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def wire(self) -> str:
        """What the Response object says: a suspended or ending one is still `in_progress`."""
        return "in_progress" if self in (Status.SUSPENDED, Status.ENDING) else self.value


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED})

TRANSITIONS: Mapping[Status, frozenset[Status]] = {
    Status.IN_PROGRESS: frozenset(
        {
            Status.SUSPENDED,
            Status.ENDING,
            Status.COMPLETED,
            Status.FAILED,
            Status.INCOMPLETE,
            Status.CANCELLED,
        }
    ),
    Status.SUSPENDED: frozenset(
        {Status.IN_PROGRESS, Status.ENDING, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED}
    ),
    Status.ENDING: frozenset({Status.FAILED, Status.INCOMPLETE, Status.CANCELLED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.INCOMPLETE: frozenset(),
    Status.CANCELLED: frozenset(),
}


_OUTPUTS = (FunctionCallOutput, CustomToolCallOutput)


class Mode(enum.Enum):
    """How a Response meets the tool calls its model makes: the dialect, as one value."""

    #: Launched (WebSocket mode, HTTP): the calls end the Response; the next create answers.
    SUCCESSOR = "successor"
    #: Prototype: it suspends, says `response.done`, and `response.append` resumes it.
    SUSPEND = "suspend"
    #: The multi-agent beta: it waits, silently, for `response.inject`; clients act on each
    #: call's `output_item.done`.
    WAIT = "wait"


class IllegalTransition(Exception):
    """The generator drove the machine somewhere it cannot go: a server bug, never the client's."""


#: `incomplete_details.reason` of a Response that a steer ended (its successor goes on).
STEERED = "steered"
#: How a Response takes a steer: it ends and a successor Response continues (the launched
#: dialect), it streams on as itself (the prototype dialect), or it takes none (the
#: multi-agent beta, as OpenAI: steering is for single-agent Responses).
Steering = Literal["successor", "in_place", "unsupported"]

#: How a Response of each mode is steered unless told: by a successor where calls end it, in
#: place where it suspends and says so, not at all in the multi-agent beta.
_STEERING: Mapping[Mode, Steering] = {
    Mode.SUCCESSOR: "successor", Mode.SUSPEND: "in_place", Mode.WAIT: "unsupported"
}  # fmt: skip


@attrs.frozen(kw_only=True)
class Steer:
    """An accepted `response.steer`: its id, its input as items, and as the client sent it
    (what a `response.steer.failed` returns)."""

    id: str
    previous_response_id: str
    items: tuple[Item, ...]
    raw_input: Any
    #: What it holds in memory (`decoded_bytes`): charged to the budgets while it waits.
    nbytes: int = 0

    @property
    def ref(self) -> SteerRef:
        return SteerRef(id=self.id, previous_response_id=self.previous_response_id)

    def failed(self, code: str, message: str) -> ResponseSteerFailed:
        return steer_failed(
            code, message, self.raw_input, self.previous_response_id, steer_id=self.id
        )


def steer_failed(
    code: str, message: str, raw_input: Any, response_id: str, *, steer_id: str | None = None
) -> ResponseSteerFailed:
    steer = FailedSteer(input=raw_input, previous_response_id=response_id, id=steer_id)
    return ResponseSteerFailed(error=SteerError(code=code, message=message), steer=steer)


@attrs.frozen
class _Ending:
    """Why an `ending` Response ends: its terminal status, and the reason or error it says."""

    to: Status
    reason: str | None = None
    error: ErrorDetail | None = None


#: The two items whose text streams: what the model says, and what it thinks first.
TextKind = Literal["message", "reasoning"]


@attrs.define
class _OpenText:
    """A message or reasoning item streaming: its text so far."""

    kind: TextKind
    item_id: str
    output_index: int
    deltas: list[str] = attrs.field(factory=list)

    def part(self) -> OutputText | ReasoningText:
        text = "".join(self.deltas)
        return OutputText(text=text) if self.kind == "message" else ReasoningText(text=text)

    def item(self, status: str, *, seal: Callable[[str], str] | None = None) -> Item:
        """The item with the text so far (none while `in_progress`); a finished reasoning
        item carries its `seal` when the client asked for it."""
        done = status != "in_progress"
        text = "".join(self.deltas)
        if self.kind == "message":
            content = (OutputText(text=text),) if done else ()
            return Message(id=self.item_id, role="assistant", content=content, status=status)
        return Reasoning(
            id=self.item_id,
            content=(ReasoningText(text=text),) if done else (),
            encrypted_content=seal(text) if seal is not None and done else None,
            status=status,
        )


@attrs.define
class _OpenCall:
    item_id: str
    output_index: int
    call_id: str
    name: str
    deltas: list[str] = attrs.field(factory=list)


class ResponseMachine:
    def __init__(
        self,
        *,
        response: Response,
        conversation: Conversation,
        mode: Mode = Mode.SUSPEND,
        clock: Callable[[], int] | None = None,
        compaction: UnknownItem | None = None,
        steering: Steering | None = None,
        max_pending_steers: int = 8,
        new_id: Callable[[str], str] = ids.new_id,
        seal: Callable[[str], str] | None = None,
    ) -> None:
        """`clock` (unix seconds) stamps `completed_at`; without one a Response completes at
        its `created_at`, so the machine stays deterministic where no clock is given.
        `compaction`: the item of a server-side compaction that made `conversation` (which
        holds it already); `start` streams it as the first output item. `steering`: by
        default a successor where calls end the Response, in place where they suspend it
        and it says so (the prototype dialect), none for the multi-agent beta. `new_id(prefix)`
        names the items it makes (`msg_...`, `fc_...`, `call_...`): random unless a test gives
        a counter. `seal(text)`: a finished reasoning item's `encrypted_content` (the client
        asked for it with `include`); without it the item carries none."""
        self.id = response.id
        self._clock = clock or (lambda: response.created_at)
        self._new_id = new_id
        self._seal = seal
        self.completed_at: int | None = None
        self._compaction = compaction
        self.mode = mode
        #: Outputs injected while the segment that called them still streamed, in order: they
        #: join the conversation when it suspends (after the calls, never among them).
        self._held: list[tuple[tuple[Item, ...], RenderedItems | None]] = []
        self._held_ids: set[str] = set()
        self._template = response
        self.conversation = conversation
        self.status = Status.IN_PROGRESS
        self.pending_calls: dict[str, Item] = {}
        self.answered_calls: set[str] = set()
        self.segments = 0
        self._output: list[Item] = []
        self._open: _OpenText | _OpenCall | None = None
        self._input_tokens = 0
        self._cached_tokens = 0
        self._segment_cached = 0
        self._output_tokens = 0
        self._reasoning_tokens = 0
        self._tool_calls = 0
        self.error: ErrorDetail | None = None
        self.incomplete_reason: str | None = None
        self._ending: _Ending | None = None
        if steering is None:
            steering = _STEERING[mode]
        if compaction is not None:  # as OpenAI: a compacted Response is not steered
            steering = "unsupported"
        self.steering: Steering = steering
        self.max_pending_steers = max_pending_steers
        #: Accepted steers not yet applied, in order; those already told they are pending.
        self._steers: list[Steer] = []
        self._pending_told: set[str] = set()
        #: A generator segment is streaming (between `begin_segment` and its end or cut).
        self.segment_open = False

    @classmethod
    def restore(
        cls,
        *,
        response: Response,
        conversation: Conversation,
        pending: Sequence[str],
        segments: int,
        tool_calls: int,
        clock: Callable[[], int] | None = None,
        new_id: Callable[[str], str] = ids.new_id,
    ) -> ResponseMachine:
        """A suspended Response rebuilt from its persisted suspension (`response`: its
        snapshot then, `conversation`: its items re-rendered), so that another connection or
        process serves its next segment: same id, output, usage and counts, waiting on the
        calls `pending` names. Nothing of the model's warm state comes back."""
        template = attrs.evolve(
            response, status="in_progress", output=(), usage=None, error=None,
            incomplete_details=None, completed_at=None,
        )  # fmt: skip
        machine = cls(response=template, conversation=conversation, clock=clock, new_id=new_id)
        machine.status = Status.SUSPENDED
        machine._output = list(response.output)
        calls = {item.call_id: item for item in response.output if isinstance(item, FunctionCall)}
        missing = [call_id for call_id in pending if call_id not in calls]
        if missing:
            raise IllegalTransition(f"a suspension waits on calls it never made: {missing}")
        machine.pending_calls = {call_id: calls[call_id] for call_id in pending}
        machine.answered_calls = set(calls) - set(pending)
        machine.segments = segments
        machine._tool_calls = tool_calls
        if response.usage is not None:
            usage = response.usage
            machine._input_tokens = usage.input_tokens
            machine._cached_tokens = usage.input_tokens_details.cached_tokens
            machine._output_tokens = usage.output_tokens
            machine._reasoning_tokens = usage.output_tokens_details.reasoning_tokens
        return machine

    # -- what the Response looks like ------------------------------------------------------

    @property
    def output(self) -> Sequence[Item]:
        return self._output

    @property
    def ending(self) -> bool:
        """Decided to end, or ended: it takes nothing more from the client."""
        return self.status is Status.ENDING or self.status.terminal

    @property
    def steers(self) -> tuple[Steer, ...]:
        """Accepted steers not yet applied, in the order they came."""
        return tuple(self._steers)

    @property
    def steer_due(self) -> bool:
        """A steer waits and this is a safe point for it: streaming, no call awaiting output."""
        return bool(self._steers) and self.status is Status.IN_PROGRESS and not self.pending_calls

    @property
    def template(self) -> Response:
        """The Response as created: what the client asked for (limits included)."""
        return self._template

    @property
    def output_tokens(self) -> int:
        return self._output_tokens

    @property
    def tool_calls(self) -> int:
        """Tool calls this Response has made, every segment counted."""
        return self._tool_calls

    def usage(self) -> Usage:
        return Usage(
            input_tokens=self._input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=self._cached_tokens),
            output_tokens=self._output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens),
            total_tokens=self._input_tokens + self._output_tokens,
        )

    def snapshot(self) -> Response:
        return attrs.evolve(
            self._template,
            status=self.status.wire,
            output=tuple(self._output),
            error=self.error,
            incomplete_details=(
                {"reason": self.incomplete_reason} if self.incomplete_reason is not None else None
            ),
            usage=self.usage(),
            completed_at=self.completed_at if self.status is Status.COMPLETED else None,
        )

    # -- the Response's life -----------------------------------------------------------------

    def start(self) -> list[ServerEvent]:
        snapshot = self.snapshot()
        events: list[ServerEvent] = [
            ResponseCreated(response=snapshot),
            ResponseInProgress(response=snapshot),
        ]
        item, self._compaction = self._compaction, None
        if item is not None:  # in the conversation already: only the output gets it
            index = len(self._output)
            self._output.append(item)
            item_id = str(item.raw.get("id"))
            events += [
                OutputItemAdded(output_index=index, item=item),
                CompactionCompacting(item_id=item_id, output_index=index),
                OutputItemDone(output_index=index, item=item),
            ]
        return events

    def begin_segment(self, *, prompt_tokens: int, cached_tokens: int) -> None:
        """The generator prefilled a prompt of which `cached_tokens` were already warm."""
        self._require_streaming("begin a segment")
        self.segment_open = True
        self.segments += 1
        self._input_tokens += prompt_tokens
        self._cached_tokens += cached_tokens
        self._segment_cached = cached_tokens

    def report_cached(self, cached_tokens: int) -> None:
        """The engine said, once the segment ended, how much of its prompt it had cached."""
        self._cached_tokens += cached_tokens - self._segment_cached
        self._segment_cached = cached_tokens

    def end_segment(self, *, tokens: int = 0) -> list[ServerEvent]:
        """The model stopped (its last `tokens` carried no output): suspend if it called tools
        (prototype), otherwise complete.

        In the launched dialect (`Mode.SUCCESSOR`) a Response always completes;
        its tool calls are answered by the next `response.create`.
        """
        self._require_streaming("end a segment")
        if isinstance(self._open, _OpenCall):
            raise IllegalTransition("a segment ended inside a tool call")
        self._output_tokens += tokens
        self.segment_open = False
        events = self._close_text()
        if self.pending_calls and self.mode is not Mode.SUCCESSOR:
            self._move(Status.SUSPENDED)
            if self.mode is Mode.WAIT or self.pending_calls.keys() <= self._held_ids:
                # silent: a beta client waits on no response.done, and a Response whose every
                # call was injected already resumes at once (`release_held`), waiting for nobody
                return events
            return [*events, ResponseDone(response=self.snapshot()), *self._tell_pending()]
        if self._steers and self.steering == "in_place":
            # it would complete, but a steer came: the same Response goes on with it
            return [*events, *self._apply_in_place()]
        self._move(Status.COMPLETED)
        self.completed_at = self._clock()
        # successor steering: the steers stay for the successor, or, if calls await output,
        # for the create that answers them
        return [*events, ResponseCompleted(response=self.snapshot()), *self._tell_pending()]

    def fail(self, error: ErrorDetail) -> list[ServerEvent]:
        events = self._abandon_open_item()
        self._move(Status.FAILED)
        self.error = error
        return [*events, ResponseFailed(response=self.snapshot()), *self._fail_steers()]

    def fail_unstored(self, error: ErrorDetail) -> list[ServerEvent]:
        """An ended `store: true` Response could not be stored: it fails instead of ending as
        decided, with its output kept, so no client is told that a lost response is done."""
        if self.status not in (Status.COMPLETED, Status.INCOMPLETE, Status.CANCELLED):
            raise IllegalTransition(f"cannot fail an unstored Response while {self.status.value}")
        self.status = Status.FAILED
        self.error = error
        self.incomplete_reason = None
        failed = self._fail_steers("successor_creation_failed", "it could not be stored")
        return [ResponseFailed(response=self.snapshot()), *failed]

    def make_incomplete(self, reason: str, *, tokens: int = 0) -> list[ServerEvent]:
        events = self._abandon_open_item()
        self._output_tokens += tokens
        self._move(Status.INCOMPLETE)
        self.incomplete_reason = reason
        ended = [*events, ResponseIncomplete(response=self.snapshot())]
        return ended if reason == STEERED else [*ended, *self._fail_steers()]

    def cancel(self) -> list[ServerEvent]:
        """The client's `response.cancel`, at once (`request_cancel` and `end`, in one)."""
        self.request_cancel()
        return self.end()

    # -- ending: decided now, said at the next safe point ------------------------------------------

    def request_cancel(self) -> None:
        """The client's `response.cancel`: refused once the Response is ending or ended."""
        self._refuse_if_ending("cancelled")
        self._move(Status.ENDING)
        self._ending = _Ending(Status.CANCELLED)

    def request_expire(self, reason: str) -> bool:
        """The server ends the Response `incomplete` (`reason`); False if it is ending already."""
        if self.ending:
            return False
        self._move(Status.ENDING)
        self._ending = _Ending(Status.INCOMPLETE, reason=reason)
        return True

    def request_fail(self, error: ErrorDetail) -> bool:
        """The generator failed: the Response fails, unless it is ending already."""
        if self.ending:
            return False
        self._move(Status.ENDING)
        self._ending = _Ending(Status.FAILED, error=error)
        return True

    def end(self) -> list[ServerEvent]:
        """Say the end that was decided: open items close as incomplete, then the terminal."""
        ending = self._ending
        if self.status is not Status.ENDING or ending is None:
            raise IllegalTransition(f"cannot end a Response that is {self.status.value}")
        self._ending = None
        if ending.to is Status.FAILED:
            assert ending.error is not None
            return self.fail(ending.error)
        if ending.to is Status.INCOMPLETE:
            assert ending.reason is not None
            return self.make_incomplete(ending.reason)
        events = self._abandon_open_item()
        self._move(Status.CANCELLED)
        return [*events, ResponseCancelled(response=self.snapshot()), *self._fail_steers()]

    def _refuse_if_ending(self, what: str) -> None:
        if self.status.terminal:
            raise ProtocolError(
                "no_open_response",
                f"Response {self.id} already ended ({self.status.value}); it cannot be {what}. "
                "Start a new one with response.create.",
            )
        if self._ending is not None:
            why = "cancelled" if self._ending.to is Status.CANCELLED else "ended"
            if self._ending.reason is not None:
                why = f"ended ({self._ending.reason})"
            raise ProtocolError(
                "no_open_response",
                f"Response {self.id} is being {why}; it cannot be {what}. Start a new one "
                "with response.create.",
            )

    # -- steering --------------------------------------------------------------------------------

    def steer(self, steer: Steer) -> list[ServerEvent]:
        """Accept `steer` (`response.steer.accepted`; `.pending` too while calls await output)
        or raise `SteerRefused`, changing nothing. It is applied at the next safe point
        (`take_steers`), or, if the Response waits on outputs, once they arrive."""
        if self.steering == "unsupported":
            raise SteerRefused(
                "steering_not_supported",
                f"Response {self.id} cannot be steered: multi-agent and compacted Responses "
                "take no steering input.",
            )
        if self.status.terminal:
            raise SteerRefused(
                "response_already_completed",
                f"Response {self.id} already ended ({self.status.value}); nothing was queued.",
            )
        if self.status is Status.ENDING:
            raise SteerRefused(
                "response_not_active",
                f"Response {self.id} is ending; it takes no more steering input.",
            )
        if len(self._steers) >= self.max_pending_steers:
            raise SteerRefused(
                "too_many_pending_steers",
                f"Response {self.id} already has {len(self._steers)} steers waiting "
                "(--max-pending-steers); wait for one to be applied.",
            )
        self._steers.append(steer)
        events: list[ServerEvent] = [ResponseSteerAccepted(steer=steer.ref)]
        if self.status is Status.SUSPENDED:
            events += self._tell_pending()
        return events

    def take_steers(self) -> list[ServerEvent]:
        """At a safe point (`steer_due`), apply the steers: a successor Response ends
        `incomplete` (`steered`; the dialect takes `steers` for the successor), an in-place
        one closes what streamed and goes on with the steers' messages."""
        if not self.steer_due:
            raise IllegalTransition("no steer is due")
        if self.steering == "in_place":
            events = self._abandon_open_item()
            return [*events, *self._apply_in_place()]
        return self.make_incomplete(STEERED)

    def hand_over_steers(self) -> tuple[Steer, ...]:
        """The steers a successor takes (this Response ended steered, or completed)."""
        if not self.status.terminal:
            raise IllegalTransition(f"steers are handed over at the end, not {self.status.value}")
        steers, self._steers = tuple(self._steers), []
        return steers

    def required_input(self) -> tuple[RequiredInput, ...]:
        """Stubs of the outputs this Response waits for (none injected already)."""
        return tuple(
            RequiredInput(call_id=call_id, name=getattr(item, "name", ""))
            for call_id, item in self.pending_calls.items()
            if call_id not in self._held_ids
        )

    def _tell_pending(self) -> list[ServerEvent]:
        """`response.steer.pending`, once per steer, for those waiting on tool outputs."""
        if not self.pending_calls:
            return []
        required = self.required_input()
        untold = [s for s in self._steers if s.id not in self._pending_told]
        self._pending_told.update(s.id for s in untold)
        return [ResponseSteerPending(required_input=required, steer=s.ref) for s in untold]

    def _apply_in_place(self) -> list[ServerEvent]:
        """The steers' messages join the conversation; the Response streams on with them."""
        steers, self._steers = self._steers, []
        self.segment_open = False
        for steer in steers:
            self.conversation.extend(steer.items)
        return [ResponseInProgress(response=self.snapshot())]

    def _fail_steers(
        self, code: str = "response_not_active", why: str | None = None
    ) -> list[ServerEvent]:
        """The Response ended without its steers: each comes back, none is lost."""
        steers, self._steers = self._steers, []
        reason = why or f"it ended {self.status.value}"
        message = f"Response {self.id} ended before the steer was applied ({reason})."
        return [steer.failed(code, message) for steer in steers]

    # -- what the generator produced -------------------------------------------------------------

    def text_delta(self, delta: str, *, tokens: int) -> list[ServerEvent]:
        """The model speaks: an assistant message opens (closing reasoning before it) and grows."""
        return self._stream_text("message", delta, tokens)

    def reasoning_delta(self, delta: str, *, tokens: int) -> list[ServerEvent]:
        """The model thinks: a `reasoning` item opens (closing text before it) and grows; its
        tokens are reasoning tokens too."""
        events = self._stream_text("reasoning", delta, tokens)
        self._reasoning_tokens += tokens
        return events

    def _stream_text(self, kind: TextKind, delta: str, tokens: int) -> list[ServerEvent]:
        self._require_streaming(f"stream {kind} text")
        if isinstance(self._open, _OpenCall):
            raise IllegalTransition(f"{kind} text arrived inside a tool call")
        if self.pending_calls:
            # a suspension must follow the calls it waits for (`response.done` ends on them)
            raise IllegalTransition(
                f"{kind} text arrived after a tool call; a segment's calls come last"
            )
        events: list[ServerEvent] = []
        if self._open is not None and self._open.kind != kind:
            events += self._close_text()
        if self._open is None:
            item_id = self._new_id("msg" if kind == "message" else "rs")
            index = len(self._output)
            self._open = _OpenText(kind, item_id, index)
            events.append(OutputItemAdded(output_index=index, item=self._open.item("in_progress")))
            events.append(
                ContentPartAdded(
                    item_id=item_id, output_index=index, content_index=0, part=self._open.part()
                )
            )
        text = self._open
        text.deltas.append(delta)
        self._output_tokens += tokens
        delta_event = OutputTextDelta if kind == "message" else ReasoningTextDelta
        events.append(
            delta_event(
                item_id=text.item_id, output_index=text.output_index, content_index=0, delta=delta
            )
        )
        return events

    def begin_function_call(self, name: str, *, tokens: int = 0) -> list[ServerEvent]:
        self._require_streaming("call a tool")
        if isinstance(self._open, _OpenCall):
            raise IllegalTransition("a tool call began inside another")
        events = self._close_text()
        call = _OpenCall(self._new_id("fc"), len(self._output), self._new_id("call"), name)
        self._open = call
        self._output_tokens += tokens
        item = FunctionCall(
            id=call.item_id, call_id=call.call_id, name=name, arguments="", status="in_progress"
        )
        events.append(OutputItemAdded(output_index=call.output_index, item=item))
        return events

    def function_call_arguments_delta(self, delta: str, *, tokens: int) -> list[ServerEvent]:
        call = self._require_open_call()
        call.deltas.append(delta)
        self._output_tokens += tokens
        return [
            FunctionCallArgumentsDelta(
                item_id=call.item_id, output_index=call.output_index, delta=delta
            )
        ]

    def end_function_call(self) -> list[ServerEvent]:
        call = self._require_open_call()
        arguments = "".join(call.deltas)
        item = FunctionCall(
            id=call.item_id,
            call_id=call.call_id,
            name=call.name,
            arguments=arguments,
            status="completed",
        )
        self._open = None
        self._finish(item)
        self.pending_calls[call.call_id] = item
        self._tool_calls += 1
        return [
            FunctionCallArgumentsDone(
                item_id=call.item_id,
                output_index=call.output_index,
                name=call.name,
                arguments=arguments,
            ),
            OutputItemDone(output_index=call.output_index, item=item),
        ]

    # -- what the client sent --------------------------------------------------------------------

    def check_append(self, items: Sequence[Item]) -> None:
        """Raise the `ProtocolError` that `append(items)` would raise, changing nothing."""
        self._refuse_if_ending("appended to")
        if self.status is not Status.SUSPENDED:
            raise ProtocolError(
                "response_in_progress",
                f"Response {self.id} is still streaming; wait for response.done, then append.",
            )
        if not items:
            raise ProtocolError(
                "invalid_field", "`input` is empty; append at least one item.", param="input"
            )
        answering: set[str] = set()
        has_message = False
        for index, item in enumerate(items):
            param = f"input[{index}]"
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                self._check_output(item.call_id, param, answering)
            elif isinstance(item, Message) and item.role != "assistant":
                has_message = True
            else:
                raise ProtocolError(
                    "invalid_field",
                    f"`{param}` is a {item.type!r} item; response.append takes "
                    "function_call_output, custom_tool_call_output and message items.",
                    param=f"{param}.type",
                )
        still_pending = self.pending_calls.keys() - answering
        if has_message and still_pending:
            raise ProtocolError(
                "missing_tool_output",
                "A new message cannot resume the Response while calls await output: "
                f"{some_of(sorted(still_pending))}. Send their outputs first or in the same "
                "append.",
                param="input",
            )

    def append(
        self,
        items: Sequence[Item],
        rendered: RenderedItems | None = None,
        *,
        tool_choice: Any = None,
    ) -> list[ServerEvent]:
        """Record tool outputs (and messages); resume once no call awaits output.

        `rendered`: the items already rendered (`render_items`, off the event loop for large
        ones). `tool_choice` (already checked), if set, holds for the rest of the Response.
        Returns the events that announce the resumption, or nothing while calls are pending.
        """
        self.check_append(items)
        if tool_choice is not None:
            self._template = attrs.evolve(self._template, tool_choice=tool_choice)
        for item in items:
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                del self.pending_calls[item.call_id]
                self.answered_calls.add(item.call_id)
        if rendered is None:
            self.conversation.extend(items)
        else:
            self.conversation.extend_rendered(rendered)
        if self.pending_calls:
            return []
        self._move(Status.IN_PROGRESS)
        if self._steers:  # steers that waited for these outputs: after them, and resume
            return self._apply_in_place()
        return [ResponseInProgress(response=self.snapshot())]

    def check_inject(self, items: Sequence[Item]) -> None:
        """Raise the `ProtocolError` that `inject(items)` would raise, changing nothing.

        An inject (the multi-agent beta) carries only tool outputs, and, unlike an append, may
        arrive while the segment still streams: an output for a call already emitted is valid
        then. An ended Response is `response_already_completed`."""
        if self.ending:
            raise ProtocolError(
                "response_already_completed",
                f"Response {self.id} already ended ({self.status.value}); nothing can be "
                "injected into it.",
            )
        if not items:
            raise ProtocolError(
                "invalid_field", "`input` is empty; inject at least one item.", param="input"
            )
        answering: set[str] = set()
        for index, item in enumerate(items):
            param = f"input[{index}]"
            if not isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                raise ProtocolError(
                    "invalid_field",
                    f"`{param}` is a {item.type!r} item; response.inject takes client tool "
                    "outputs (function_call_output, custom_tool_call_output).",
                    param=f"{param}.type",
                )
            self._check_output(item.call_id, param, answering)

    def _check_output(self, call_id: str, param: str, answering: set[str]) -> None:
        """One output of an append or an inject answers a call that awaits it, once (an output
        held while its segment streams counts as given); it joins `answering`."""
        if call_id in answering or call_id in self.answered_calls or call_id in self._held_ids:
            raise ProtocolError(
                "duplicate_call_id",
                f"Call {quoted(call_id)} was already answered; send each output once.",
                param=f"{param}.call_id",
            )
        if call_id not in self.pending_calls:
            raise ProtocolError(
                "unknown_call_id",
                f"No call {quoted(call_id)} is awaiting output in response {self.id}; "
                f"awaiting: {some_of([c for c in self.pending_calls if c not in self._held_ids])}.",
                param=f"{param}.call_id",
            )
        answering.add(call_id)

    def inject(
        self, items: Sequence[Item], rendered: RenderedItems | None = None
    ) -> list[ServerEvent]:
        """Commit tool outputs: as an append if the Response is suspended; held until the
        segment ends if it still streams (`release_held` applies them). Returns the events
        that announce a resumption, if this answered the last call."""
        self.check_inject(items)
        if self.status is Status.SUSPENDED:
            return self.append(items, rendered)
        self._held.append((tuple(items), rendered))
        self._held_ids.update(item.call_id for item in items if isinstance(item, _OUTPUTS))
        return []

    @property
    def holds_injected(self) -> bool:
        return bool(self._held)

    @property
    def held_bytes(self) -> int:
        """What the outputs held for the segment's end take in memory (once rendered), and the
        steers not yet applied, so the memory budget counts them before they join the
        conversation (or go back)."""
        outputs = sum(
            rendered.nbytes + TOKEN_BYTES * len(rendered.tokens)
            for _, rendered in self._held
            if rendered is not None
        )
        return outputs + sum(steer.nbytes for steer in self._steers)

    def release_held(self) -> list[ServerEvent]:
        """At a suspension: what was injected while the segment streamed joins the
        conversation now; returns the events of a resumption if that answered every call."""
        if self.status is not Status.SUSPENDED:
            raise IllegalTransition(f"cannot release injected outputs while {self.status.value}")
        held, self._held = self._held, []
        self._held_ids = set()
        events: list[ServerEvent] = []
        for items, rendered in held:
            events = self.append(items, rendered)
        return events

    # -- internals -------------------------------------------------------------------------------

    def _move(self, to: Status) -> None:
        if to not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"{self.status.value} -> {to.value}")
        self.status = to

    def _require_streaming(self, what: str) -> None:
        if self.status is not Status.IN_PROGRESS:
            raise IllegalTransition(f"cannot {what} while {self.status.value}")

    def _require_open_call(self) -> _OpenCall:
        self._require_streaming("stream tool-call arguments")
        if not isinstance(self._open, _OpenCall):
            raise IllegalTransition("no tool call is open")
        return self._open

    def _finish(self, item: Item) -> None:
        self._output.append(item)
        self.conversation.extend((item,))

    def _close_text(self, status: str = "completed") -> list[ServerEvent]:
        """Close the message or reasoning item that is streaming, if one is."""
        text = self._open
        if not isinstance(text, _OpenText):
            return []
        self._open = None
        item = text.item(status, seal=self._seal)
        part = text.part()
        self._finish(item)
        item_id, index = text.item_id, text.output_index
        done_event = OutputTextDone if text.kind == "message" else ReasoningTextDone
        return [
            done_event(item_id=item_id, output_index=index, content_index=0, text=part.text),
            ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=part),
            OutputItemDone(output_index=index, item=item),
        ]

    def _abandon_open_item(self) -> list[ServerEvent]:
        """Close whatever was streaming as `incomplete`, so every `added` gets its `done`."""
        if self.status.terminal:
            raise IllegalTransition(f"Response already {self.status.value}")
        call = self._open
        if not isinstance(call, _OpenCall):
            return self._close_text("incomplete")
        self._open = None
        item = FunctionCall(
            id=call.item_id,
            call_id=call.call_id,
            name=call.name,
            arguments="".join(call.deltas),
            status="incomplete",
        )
        self._output.append(item)  # never answered, so kept out of the conversation
        return [OutputItemDone(output_index=call.output_index, item=item)]
