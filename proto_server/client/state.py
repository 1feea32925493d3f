"""What a client knows about one rollout, kept without I/O: state, pending calls, timings.

A *segment* is everything the server streams in answer to one client send (a create, or the
append that resumes the rollout) up to the next suspension or the end (segment.py). The
tracker is fed the sends and the received events with their (client-side) times and keeps the
record; the trio `Rollout` only moves bytes. Every dialect suspends the same way from the
client's point of view:

- prototype: `response.done` ends a segment with calls pending; the same Response resumes;
- launched and HTTP: `response.completed` whose output ends in calls not yet answered is a
  suspension of the *rollout*; the next turn is a new Response chained onto it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from proto_server.client.dialects import Dialect, rules
from proto_server.client.segment import Received, Segment
from proto_server.wire.errors import ErrorDetail
from proto_server.wire.events import (
    ErrorEvent,
    OutputItemDone,
    ResponseCancelled,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ServerEvent,
)
from proto_server.wire.items import (
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    ToolCall,
    ToolOutput,
)
from proto_server.wire.response import Response, Usage


class RolloutState(enum.Enum):
    STREAMING = "streaming"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self not in (RolloutState.STREAMING, RolloutState.SUSPENDED)


_ENDINGS: Mapping[type[ServerEvent], RolloutState] = {
    ResponseFailed: RolloutState.FAILED,
    ResponseIncomplete: RolloutState.INCOMPLETE,
    ResponseCancelled: RolloutState.CANCELLED,
}


class OutputsRefused(ValueError):
    """Outputs that do not answer the pending calls; nothing was sent."""


class RolloutTracker:
    """The client's view of one rollout, fed by sends and received events."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._one_response = rules(dialect).one_response
        self.state = RolloutState.STREAMING
        self.segments: list[Segment] = []
        #: The latest Response object the server sent (launched/HTTP: this turn's Response).
        self.response: Response | None = None
        #: Every response id in the rollout, in order (prototype: one).
        self.response_ids: list[str] = []
        #: Every item finished in the rollout, across turns, in order.
        self.output: list[Item] = []
        self.pending_calls: dict[str, ToolCall] = {}
        self.error: ErrorDetail | None = None
        self._usage_base = Usage()
        #: Where the rollout was before the first answer of this suspension, to go back to if
        #: the server refuses the resuming send.
        self._restore: tuple[RolloutState, dict[str, ToolCall]] | None = None
        self._before_send: tuple[RolloutState, dict[str, ToolCall]] | None = None
        #: Bytes of sends that answered only some calls (prototype), counted with the resume.
        self._partial_bytes = 0
        #: Resumed by id on a new connection: its usage so far is the first snapshot's.
        self.resumed = False

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    # -- sends ---------------------------------------------------------------------------------

    def sent(self, *, at: float, size: int) -> Segment:
        """The create, or the send that answered the last pending call: a segment begins."""
        previous = self.current
        segment = Segment(
            index=len(self.segments),
            request="start" if previous is None else "resume",
            sent_at=at,
            sent_bytes=size + self._partial_bytes,
            previous_end=previous.ended_at if previous is not None else None,
        )
        self.segments.append(segment)
        self._before_send, self._restore = self._restore, None
        self._partial_bytes = 0
        self.state = RolloutState.STREAMING
        return segment

    def sent_partial(self, *, size: int) -> None:
        """A send that answered only some calls: the server holds them, nothing streams yet."""
        self._partial_bytes += size

    def outputs(self, outputs: Mapping[str, str] | Sequence[ToolOutput]) -> list[ToolOutput]:
        """Outputs for pending calls, as items; `OutputsRefused` if one answers no pending call."""
        if self.state is not RolloutState.SUSPENDED:
            raise OutputsRefused(
                f"the rollout is {self.state.value}, not suspended: only a suspended rollout "
                "takes tool outputs (step() until it suspends)."
            )
        if isinstance(outputs, Mapping):
            items: list[ToolOutput] = [
                self._output_item(call_id, text) for call_id, text in outputs.items()
            ]
        else:
            items = list(outputs)
        seen: set[str] = set()
        for item in items:
            if item.call_id not in self.pending_calls or item.call_id in seen:
                waiting = ", ".join(self.pending_calls) or "none"
                raise OutputsRefused(
                    f"{item.call_id!r} answers no pending call (pending: {waiting}); "
                    "answer each pending call once."
                )
            seen.add(item.call_id)
        return items

    def _output_item(self, call_id: str, text: str) -> ToolOutput:
        call = self.pending_calls.get(call_id)
        if isinstance(call, CustomToolCall):
            return CustomToolCallOutput(call_id=call_id, output=text)
        return FunctionCallOutput(call_id=call_id, output=text)

    def answered(self, items: Sequence[ToolOutput]) -> bool:
        """Record outputs the client has given; True once no call is left pending."""
        # The prototype server keeps each partial answer it accepted; the others see nothing
        # until the rollout resumes.
        if self._restore is None or self._one_response:
            self._restore = (self.state, dict(self.pending_calls))
        for item in items:
            del self.pending_calls[item.call_id]
        return not self.pending_calls

    def cancelled_locally(self) -> None:
        """A rollout between turns (launched, HTTP) has nothing open on the server to cancel."""
        self.state = RolloutState.CANCELLED

    # -- events --------------------------------------------------------------------------------

    def received(self, received: Received) -> None:
        """One event of the current segment; ends the segment when it suspends or ends."""
        segment = self.current
        if segment is None or self.state is not RolloutState.STREAMING:
            raise RuntimeError(f"an event arrived while the rollout is {self.state.value}")
        segment.events.append(received)
        event = received.event
        match event:
            case ResponseCreated(response=response) | ResponseInProgress(response=response):
                if self.resumed and not self.response_ids:
                    self._usage_base = response.usage or Usage()  # spent before this connection
                self._saw(response)
            case OutputItemDone(item=item):
                self.output.append(item)
                if isinstance(item, FunctionCall | CustomToolCall):
                    self.pending_calls[item.call_id] = item
            case ResponseDone(response=response):
                self._end_segment(segment, response, RolloutState.SUSPENDED, received.at)
            case ResponseCompleted(response=response):
                chained = not self._one_response and self.pending_calls
                state = RolloutState.SUSPENDED if chained else RolloutState.COMPLETED
                self._end_segment(segment, response, state, received.at)
            case (
                ResponseFailed(response=response)
                | ResponseIncomplete(response=response)
                | ResponseCancelled(response=response)
            ):
                self.error = response.error
                self._end_segment(segment, response, _ENDINGS[type(event)], received.at)
            case ErrorEvent(error=error):
                # A refused frame changes nothing on the server: back to where we were.
                self.error = error
                if self._before_send is None:
                    self.state = RolloutState.FAILED
                else:
                    self.state, self.pending_calls = self._before_send
                segment.ended_at = received.at

    def _saw(self, response: Response) -> None:
        if response.id not in self.response_ids:
            self.response_ids.append(response.id)
        self.response = response

    def _end_segment(
        self, segment: Segment, response: Response, state: RolloutState, at: float
    ) -> None:
        self._saw(response)
        usage = response.usage or Usage()
        base = self._usage_base
        segment.response_id = response.id
        segment.input_tokens = usage.input_tokens - base.input_tokens
        segment.cached_tokens = (
            usage.input_tokens_details.cached_tokens - base.input_tokens_details.cached_tokens
        )
        segment.output_tokens = usage.output_tokens - base.output_tokens
        # The prototype's usage adds up over segments of one Response; a new turn starts at 0.
        self._usage_base = usage if self._one_response else Usage()
        segment.ended_at = at
        self.state = state
