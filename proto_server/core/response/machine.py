"""The Response state machine: where every streamed event is born.

One `ResponseMachine` per Response. The server calls it with what the generator produced (text,
tool calls, the end of a segment) and with what the client asked (append, cancel); each call
returns the events to send, in order. It never awaits and never reads a clock.

    in_progress --tool calls--> suspended --append answers all--> in_progress --> ...
    in_progress --no tool call--> completed
    in_progress | suspended --request_cancel / request_expire / request_fail--> ending
    ending --end()--> cancelled | incomplete | failed
    any open state --> failed | incomplete | cancelled

Every status change is a move of `transitions.TABLE`. `ending`: the server decided to end the
Response and its terminal event is not out yet (`ending.py`); it takes nothing more (still
`in_progress` on the wire). Whether a Response is open is decided here alone. The parts it
composes: its output items (`items.py`), its usage (`usage.py`), its steers (`steering.py`),
outputs injected while a segment streams (`held.py`), what an append may answer
(`answers.py`); its calls for what the generator produced (`streaming.py`) and for a decided
end (`ending.py`) are its parts, each in the module of its idea.

A call that is not legal in the current state raises and changes nothing: a client's mistake is
a `ProtocolError` (it becomes an `error` event) or a `SteerRefused` (`response.steer.failed`),
a generator's is an `IllegalTransition` (a bug of the server, which fails the Response).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from proto_server.core import ids
from proto_server.core.conversation import Conversation, RenderedItems
from proto_server.core.response import steering, transitions
from proto_server.core.response.answers import Calls
from proto_server.core.response.ending import Ending, Ends
from proto_server.core.response.held import Held
from proto_server.core.response.items import OpenCall, OpenText, Output
from proto_server.core.response.mode import Mode
from proto_server.core.response.status import Status
from proto_server.core.response.steering import STEERED, STEERING, Queue, Steer, Steering
from proto_server.core.response.streaming import Streamed
from proto_server.core.response.transitions import Event, IllegalTransition
from proto_server.core.response.usage import Tokens
from proto_server.core.trace import Sampled
from proto_server.wire.errors import ErrorDetail, ProtocolError
from proto_server.wire.events import (
    RequiredInput,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseSteerAccepted,
    ServerEvent,
)
from proto_server.wire.items import (
    FunctionCall,
    Item,
    UnknownItem,
)
from proto_server.wire.response import Response, Usage


class ResponseMachine(Streamed, Ends):
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
        logprobs: bool = False,
        token_ids: bool = False,
    ) -> None:
        """`clock` (unix seconds) stamps `completed_at`; without one a Response completes at
        its `created_at`, so the machine stays deterministic where no clock is given.
        `compaction`: the item of a server-side compaction that made `conversation` (which
        holds it already); `start` streams it as the first output item. `steering`: by
        default a successor where calls end the Response, in place where they suspend it
        and it says so (the prototype dialect), none for the multi-agent beta. `new_id(prefix)`
        names the items it makes (`msg_...`, `fc_...`, `call_...`): random unless a test gives
        a counter. `seal(text)`: a finished reasoning item's `encrypted_content` (the client
        asked for it with `include`); without it the item carries none. `logprobs`: the client
        asked for them (`include`), so its messages' text carries the logprobs the generator
        says (none otherwise: no part or event carries them). `token_ids`: likewise, every item
        the model makes carries its token ids once done (`core/trace.py`)."""
        self.id = response.id
        self._clock = clock or (lambda: response.created_at)
        self.completed_at: int | None = None
        self._compaction = compaction
        self.mode = mode
        self._held = Held()
        self._template = response
        self.conversation = conversation
        self.status = Status.IN_PROGRESS
        self._calls = Calls(self.id, self._held)
        self.segments = 0
        self._items = Output(
            conversation, new_id=new_id, seal=seal, logprobs=logprobs, token_ids=token_ids
        )
        self._tokens = Tokens()
        self._tool_calls = 0
        self.error: ErrorDetail | None = None
        self.incomplete_reason: str | None = None
        self._ending: Ending | None = None
        if steering is None:
            steering = STEERING[mode]
        if compaction is not None:  # as OpenAI: a compacted Response is not steered
            steering = "unsupported"
        self.steering: Steering = steering
        self._steers = Queue(self.id, max_pending_steers)
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
        logprobs: bool = False,
        token_ids: bool = False,
    ) -> ResponseMachine:
        """A suspended Response rebuilt from its persisted suspension (`response`: its
        snapshot then, `conversation`: its items re-rendered), so that another connection or
        process serves its next segment: same id, output, usage and counts, waiting on the
        calls `pending` names. Nothing of the model's warm state comes back."""
        template = attrs.evolve(
            response, status="in_progress", output=(), usage=None, error=None,
            incomplete_details=None, completed_at=None,
        )  # fmt: skip
        machine = cls(
            response=template,
            conversation=conversation,
            clock=clock,
            new_id=new_id,
            logprobs=logprobs,
            token_ids=token_ids,
        )
        calls = {item.call_id: item for item in response.output if isinstance(item, FunctionCall)}
        missing = [call_id for call_id in pending if call_id not in calls]
        if missing:
            raise IllegalTransition(f"a suspension waits on calls it never made: {missing}")
        machine._move(Event.SUSPEND)  # as it did before it was stored
        machine._items.items = list(response.output)
        machine._calls.pending = {call_id: calls[call_id] for call_id in pending}
        machine._calls.answered = set(calls) - set(pending)
        machine.segments = segments
        machine._tool_calls = tool_calls
        machine._tokens = Tokens.of(response.usage)
        return machine

    # -- what the Response looks like ------------------------------------------------------

    @property
    def output(self) -> Sequence[Item]:
        return self._items.items

    @property
    def ending(self) -> bool:
        """Decided to end, or ended: it takes nothing more from the client."""
        return self.status is Status.ENDING or self.status.terminal

    @property
    def steers(self) -> tuple[Steer, ...]:
        """Accepted steers not yet applied, in the order they came."""
        return tuple(self._steers.steers)

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
        return self._tokens.output

    @property
    def tool_calls(self) -> int:
        """Tool calls this Response has made, every segment counted."""
        return self._tool_calls

    @property
    def pending_calls(self) -> dict[str, Item]:
        """The calls awaiting output, by `call_id`, in the order they were made."""
        return self._calls.pending

    @property
    def answered_calls(self) -> set[str]:
        return self._calls.answered

    @property
    def _open(self) -> OpenText | OpenCall | None:
        """The item streaming, if one is (the stateful tests look)."""
        return self._items.open

    @property
    def _held_ids(self) -> set[str]:
        """The calls whose injected outputs are held (the stateful tests look)."""
        return self._held.ids

    def usage(self) -> Usage:
        return self._tokens.usage()

    def snapshot(self) -> Response:
        return attrs.evolve(
            self._template,
            status=self.status.wire,
            output=tuple(self._items.items),
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
        if item is not None:
            events += self._items.compaction(item)
        return events

    def begin_segment(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        prompt_ids: tuple[int, ...] | None = None,
        weight_version: str | None = None,
    ) -> None:
        """The generator prefilled a prompt of which `cached_tokens` were already warm;
        `prompt_ids`: its ids, where the client asked for them, and the version of the weights
        it samples with, which its items carry beside their ids."""
        self._require_streaming("begin a segment")
        self._items.begin_segment(prompt_ids, weight_version)
        self.segment_open = True
        self.segments += 1
        self._tokens.begin_segment(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        self._items.conversation.open_turn()  # what the model writes now is one turn

    def report_cached(self, cached_tokens: int) -> None:
        """The engine said, once the segment ended, how much of its prompt it had cached."""
        self._tokens.report_cached(cached_tokens)

    def end_segment(self, *, tokens: int = 0, sampled: Sampled | None = None) -> list[ServerEvent]:
        """The model stopped (its last `tokens`, `sampled` their ids, carried no output):
        suspend if it called tools (prototype), otherwise complete.

        In the launched dialect (`Mode.SUCCESSOR`) a Response always completes;
        its tool calls are answered by the next `response.create`.
        """
        self._require_streaming("end a segment")
        if self._items.in_call:
            raise IllegalTransition("a segment ended inside a tool call")
        self._tokens.output += tokens
        self.segment_open = False
        self._items.end_segment(sampled)
        events = self._items.close_text()
        if self.pending_calls and self.mode is not Mode.SUCCESSOR:
            self._move(Event.SUSPEND)
            if self.mode is Mode.WAIT or self._calls.all_held:
                # silent: a beta client waits on no response.done, and a Response whose every
                # call was injected already resumes at once (`release_held`), waiting for nobody
                return events
            return [*events, ResponseDone(response=self.snapshot()), *self._tell_pending()]
        if self._steers and self.steering == "in_place":
            # it would complete, but a steer came: the same Response goes on with it
            return [*events, *self._apply_in_place()]
        self._move(Event.COMPLETE)
        self.completed_at = self._clock()
        # successor steering: the steers stay for the successor, or, if calls await output,
        # for the create that answers them
        return [*events, ResponseCompleted(response=self.snapshot()), *self._tell_pending()]

    def fail(self, error: ErrorDetail) -> list[ServerEvent]:
        self._move(Event.FAIL)
        events = self._items.abandon()
        self.error = error
        return [*events, ResponseFailed(response=self.snapshot()), *self._fail_steers()]

    def fail_unstored(self, error: ErrorDetail) -> list[ServerEvent]:
        """An ended `store: true` Response could not be stored: it fails instead of ending as
        decided, with its output kept, so no client is told that a lost response is done."""
        self._move(Event.FAIL_UNSTORED)
        self.error = error
        self.incomplete_reason = None
        failed = self._fail_steers("successor_creation_failed", "it could not be stored")
        return [ResponseFailed(response=self.snapshot()), *failed]

    def make_incomplete(
        self, reason: str, *, tokens: int = 0, sampled: Sampled | None = None
    ) -> list[ServerEvent]:
        self._move(Event.MAKE_INCOMPLETE)
        self._items.end_segment(sampled)
        events = self._items.abandon()
        self._tokens.output += tokens
        self.incomplete_reason = reason
        ended = [*events, ResponseIncomplete(response=self.snapshot())]
        return ended if reason == STEERED else [*ended, *self._fail_steers()]

    def cancel(self) -> list[ServerEvent]:
        """The client's `response.cancel`, at once (`request_cancel` and `end`, in one)."""
        self._refuse_if_ending("cancelled")
        return self._cancelled()

    # -- steering --------------------------------------------------------------------------------

    def steer(self, steer: Steer) -> list[ServerEvent]:
        """Accept `steer` (`response.steer.accepted`; `.pending` too while calls await output)
        or raise `SteerRefused`, changing nothing. It is applied at the next safe point
        (`take_steers`), or, if the Response waits on outputs, once they arrive."""
        steering.refuse(self.id, self.steering, self.status)
        self._steers.add(steer)
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
            events = self._items.abandon()
            return [*events, *self._apply_in_place()]
        return self.make_incomplete(STEERED)

    def hand_over_steers(self) -> tuple[Steer, ...]:
        """The steers a successor takes (this Response ended steered, or completed)."""
        if not self.status.terminal:
            raise IllegalTransition(f"steers are handed over at the end, not {self.status.value}")
        return tuple(self._steers.take())

    def required_input(self) -> tuple[RequiredInput, ...]:
        """Stubs of the outputs this Response waits for (none injected already)."""
        return self._calls.required_input()

    def _tell_pending(self) -> list[ServerEvent]:
        """`response.steer.pending`, once per steer, for those waiting on tool outputs."""
        if not self.pending_calls:
            return []
        return self._steers.tell_pending(self.required_input())

    def _apply_in_place(self) -> list[ServerEvent]:
        """The steers' messages join the conversation; the Response streams on with them."""
        self.segment_open = False
        for steer in self._steers.take():
            self.conversation.extend(steer.items)
        return [ResponseInProgress(response=self.snapshot())]

    def _fail_steers(
        self, code: str = "response_not_active", why: str | None = None
    ) -> list[ServerEvent]:
        return self._steers.fail(code, why or f"it ended {self.status.value}")

    # -- what the client sent --------------------------------------------------------------------

    def check_append(self, items: Sequence[Item]) -> None:
        """Raise the `ProtocolError` that `append(items)` would raise, changing nothing."""
        self._refuse_if_ending("appended to")
        if self.status is not Status.SUSPENDED:
            raise ProtocolError(
                "response_in_progress",
                f"Response {self.id} is still streaming; wait for response.done, then append.",
            )
        self._calls.check_append(items)

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
        self._calls.answer(items)
        if rendered is None:
            self.conversation.extend(items)
        else:
            self.conversation.extend_rendered(rendered)
        if self.pending_calls:
            return []
        self._move(Event.RESUME)
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
        self._calls.check_inject(items)

    def inject(
        self, items: Sequence[Item], rendered: RenderedItems | None = None
    ) -> list[ServerEvent]:
        """Commit tool outputs: as an append if the Response is suspended; held until the
        segment ends if it still streams (`release_held` applies them). Returns the events
        that announce a resumption, if this answered the last call."""
        self.check_inject(items)
        if self.status is Status.SUSPENDED:
            return self.append(items, rendered)
        self._held.hold(items, rendered)
        return []

    @property
    def holds_injected(self) -> bool:
        return bool(self._held)

    @property
    def held_bytes(self) -> int:
        """What the outputs held for the segment's end take in memory (once rendered), and the
        steers not yet applied, so the memory budget counts them before they join the
        conversation (or go back)."""
        return self._held.nbytes + self._steers.nbytes

    def release_held(self) -> list[ServerEvent]:
        """At a suspension: what was injected while the segment streamed joins the
        conversation now; returns the events of a resumption if that answered every call."""
        if self.status is not Status.SUSPENDED:
            raise IllegalTransition(f"cannot release injected outputs while {self.status.value}")
        events: list[ServerEvent] = []
        for items, rendered in self._held.release():
            events = self.append(items, rendered)
        return events

    # -- internals -------------------------------------------------------------------------------

    def _move(self, event: Event) -> None:
        """The only place the status changes: where the table takes it."""
        self.status = transitions.move(self.status, event)
