"""The event-ordering invariants of a Responses connection, checked as the events arrive.

    checker = StreamChecker(dialect="prototype", count_tokens=o200k_count)
    checker.sent(frame)        # every frame the client sent, in order
    checker.received(event)    # every event it received (a decoded JSON object or frame text)
    checker.finish()           # the client is done: every frame must have been answered

The checker keeps a model of what the server must have done, built only from the frames and
events themselves (not from this server's code), and raises `InvariantViolation` at the first
event that breaks one of `INVARIANTS`, naming the invariant, the event and its sequence number.

Frames race the stream: an append sent while a segment streams may reach the server before or
after the segment suspends. So each frame keeps the set of answers that were legal in every
state the server went through between its sending and its answer, and an `error` is matched to
the oldest unanswered frame that may earn that code. A frame sent while the connection is
settled (nothing streaming, no earlier frame in doubt) has exactly one legal answer.

Two dialects: `prototype` (one Response per rollout, `response.done` suspends it and an append
resumes it) and `launched` (many Responses, one at a time, each a plain create-to-terminal run;
a create sent while one runs is served after it, announced by `response.queued`).

Lanes: `LaneChecker` holds a `StreamChecker` per `stream_id` (a lane is a connection of its own:
its events are numbered from 0, its Responses one at a time) and routes each frame and event to
its lane. `response.inject` (the multi-agent beta) is answered by `response.inject.created`,
whose outputs must answer calls that are waiting, or `response.inject.failed`, which returns the
input as sent; a Response created with `multi_agent.enabled` waits silently on its calls (no
`response.done`) and resumes with `response.in_progress` only once every one is answered.

Steering: a `response.steer` goes to the lane of the Response it names and is answered by
`response.steer.accepted` (the Response is active, or completed with calls awaiting output)
or `response.steer.failed` (the input as sent, a known code). An accepted steer is then
committed (launched: the Response ends `incomplete` with reason `steered`, or completes, and
the next `response.created` on the lane is its successor, `previous_response_id` the steered
one, asked for by no create; or the create that continues a Response it was pending for;
prototype: the same Response's next `response.in_progress`), or it fails, with its id and its
input back; `response.steer.pending` only while its Response waits on calls, naming them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import attrs
import orjson

from proto_server.core.request import check_create, input_items, is_warmup, parse_tool_choice
from proto_server.wire.converter import decode_client_event, unstructure
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseInject,
    ResponseSteer,
)
from proto_server.wire.items import CustomToolCallOutput, FunctionCallOutput, Message, UnknownItem

if TYPE_CHECKING:
    from proto_server.testing.schema import Transport, WireSchema

Dialect = Literal["prototype", "launched"]

INVARIANTS: Mapping[int, str] = {
    1: "sequence_number starts at 0 and rises by exactly 1",
    2: "each Response begins with response.created; nothing of it follows its terminal event",
    3: "items open and close in order, deltas fall inside them, and done texts equal the deltas",
    4: "response.done follows tool calls; the Response waits for an accepted append to resume",
    5: "every answered call_id belonged to a call that was emitted and not yet answered",
    6: "usage adds up",
    7: "every client frame gets its effect or exactly one error; a refused frame changes nothing",
    8: "every event validates against the published schema (checked when a schema is given)",
    9: "each lane's events carry its stream_id, and a Response lives on one lane",
}

TERMINAL_EVENTS: Mapping[str, str] = {
    "response.completed": "completed",
    "response.failed": "failed",
    "response.incomplete": "incomplete",
    "response.cancelled": "cancelled",
}
CALL_TYPES = frozenset({"function_call", "custom_tool_call"})
#: The `error` codes an append that names its Response (`response_id`) may earn as well: the
#: store decides whether a Response suspended on another connection can be resumed here.
RESUME_ERRORS = frozenset(
    {"response_not_found", "response_already_completed", "response_already_resumed",
     "store_unavailable"}
)  # fmt: skip
#: The `error` codes a `response.inject` may earn (its other answers are its own events).
INJECT_ERRORS = frozenset(
    {"unknown_call_id", "duplicate_call_id", "invalid_field", "unknown_event_type"}
)
#: The codes of `response.steer.failed` (openai-python 3.57's `ResponseSteerErrorCode`).
STEER_CODES = frozenset(
    {
        "response_not_found",
        "invalid_input",
        "steering_not_supported",
        "too_many_pending_steers",
        "response_already_completed",
        "response_not_active",
        "successor_creation_failed",
    }
)


@attrs.define
class _Steer:
    """An accepted steer: the Response it steers, its frame, and what became of it."""

    response_id: str
    frame: int
    state: str = "queued"  # queued | committed | failed
    told_pending: bool = False


class InvariantViolation(AssertionError):
    """The stream broke a promise; `invariant` is its number in `INVARIANTS`."""

    def __init__(
        self, invariant: int, detail: str, *, sequence_number: int | None, event: Any
    ) -> None:
        where = "at the end of the stream" if event is None else f"at event #{sequence_number}"
        shown = "" if event is None else f": {_short(event)}"
        super().__init__(
            f"invariant {invariant} ({INVARIANTS[invariant]}): {detail}; {where}{shown}"
        )
        self.invariant = invariant
        self.detail = detail
        self.sequence_number = sequence_number
        self.event = event


def _short(value: Any, limit: int = 300) -> str:
    text = orjson.dumps(value, default=repr).decode() if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


@functools.cache
def _encoding() -> Any:
    from proto_server.core.tokenizer import o200k_base

    return o200k_base()


def o200k_count(text: str) -> int:
    """Tokens in `text` by OpenAI's o200k_base: what this server counts `output_tokens` with."""
    return len(_encoding().encode_ordinary(text))


# -- the model of one Response ----------------------------------------------------------------


@attrs.define
class _Item:
    index: int
    id: str
    type: str
    call_id: str | None
    name: str | None
    parts: list[list[str]] = attrs.field(factory=list)  # message: deltas per content part
    parts_open: set[int] = attrs.field(factory=set)
    texts_done: set[int] = attrs.field(factory=set)
    arguments: list[str] = attrs.field(factory=list)  # tool call: argument (or input) deltas
    arguments_done: bool = False
    done: bool = False


@attrs.define
class _Response:
    id: str
    phase: str = "streaming"  # streaming | suspended | resuming | a terminal status
    items: list[_Item] = attrs.field(factory=list)
    segment_start: int = 0
    pending: dict[str, int] = attrs.field(factory=dict)  # call_id -> output_index
    answered: set[str] = attrs.field(factory=set)
    cancel_frame: int | None = None  # the accepted response.cancel, until it takes effect
    usage: tuple[int, int, int] = (0, 0, 0)  # input, cached, output
    segment_base: tuple[int, int] = (0, 0)
    last_prompt: int | None = None
    told_ended: int | None = None  # a frame refused as too late while it still streamed
    waits: bool = False  # multi-agent beta: it waits silently on its calls for injects
    injected: bool = False  # outputs were injected while this segment streamed

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_EVENTS.values()

    @property
    def open_item(self) -> _Item | None:
        return next((item for item in self.items if not item.done), None)


# -- the ledger of client frames --------------------------------------------------------------


@attrs.frozen
class _View:
    """What the server's state looked like to a frame: enough to know how it must answer."""

    phase: str  # none | streaming | suspended | ending
    pending: frozenset[str] = frozenset()
    answered: frozenset[str] = frozenset()


@attrs.define
class _Frame:
    number: int
    kind: str  # the event type, or "undecodable"
    event: ClientEvent | None
    codes: set[str] = attrs.field(factory=set)  # refusals it may earn
    can_accept: bool = False
    wild: bool = False  # sent while an earlier frame's effect was unknown: any state will do
    outcome: str | None = None  # accepted | refused
    unconfirmed_in: str | None = None  # accepted by prediction; the Response it touched
    raw: Any = None  # the frame as a JSON value (what an inject.failed must return)
    queued_as: str | None = None  # the id its response.queued announced

    def describe(self) -> str:
        return f"frame #{self.number} ({self.kind})"


class StreamChecker:
    """Checks one connection's events, and how they answer the frames the client sent."""

    def __init__(
        self,
        *,
        dialect: Dialect = "prototype",
        count_tokens: Callable[[str], int] | None = None,
        unsolicited_errors: Iterable[str] = ("websocket_connection_limit_reached",),
        schema: WireSchema | None = None,
        transport: Transport = "websocket",
    ) -> None:
        """`count_tokens` (e.g. `o200k_count`) makes `output_tokens` checked exactly;
        `unsolicited_errors` are error codes the server may send without a frame asking;
        `schema` (`proto_server.testing.schema.wire_schema()`, needs `jsonschema`) checks every
        event against the published schema too (invariant 8), as sent over `transport`."""
        self.dialect = dialect
        self.schema = schema
        self.transport: Transport = transport
        self.count_tokens = count_tokens
        self.unsolicited_errors = frozenset(unsolicited_errors)
        self.next_sequence = 0
        self.responses: dict[str, _Response] = {}
        self.current: _Response | None = None
        self.frames: list[_Frame] = []
        self._expected_creates = 0
        self._accepted_create: _Frame | None = None  # the create predicted accepted, if any
        self._event: Any = None
        self.violation: InvariantViolation | None = None
        self.finished = False
        self.stream_id: str | None = None  # the lane it checks (LaneChecker sets it)
        self.steers: dict[str, _Steer] = {}
        #: The Response whose successor the next response.created must be (launched).
        self._successor_of: str | None = None

    def resuming(self, response: Mapping[str, Any]) -> None:
        """This connection resumes by id a Response another connection saw suspend:
        `response` is the Response object of the last `response.done` it received. The model
        starts from that suspension: its output (closed), its usage, and the calls of its last
        segment waiting; the connection's own events are numbered from 0."""
        rid = response.get("id")
        if not isinstance(rid, str) or rid in self.responses:
            raise ValueError(f"cannot resume {rid!r} on this checker")
        r = _Response(rid, phase="suspended")
        output = [item for item in response.get("output") or () if isinstance(item, Mapping)]
        for index, item in enumerate(output):
            adopted = _Item(index, str(item.get("id")), str(item.get("type")),
                            item.get("call_id"), item.get("name"), done=True)  # fmt: skip
            if adopted.type == "message":
                adopted.parts = [[part.get("text", "")] for part in item.get("content") or ()]
            elif adopted.type in CALL_TYPES:
                adopted.arguments = [str(item.get("arguments", item.get("input", "")))]
                adopted.arguments_done = True
            r.items.append(adopted)
        waiting = len(r.items)
        while waiting and r.items[waiting - 1].type in CALL_TYPES:
            waiting -= 1  # a segment's calls come last: those of the last one wait
        r.pending = {i.call_id: i.index for i in r.items[waiting:] if i.call_id is not None}
        r.answered = {i.call_id for i in r.items[:waiting] if i.call_id is not None}
        r.segment_start = len(r.items)
        usage = response.get("usage")
        if isinstance(usage, Mapping):
            r.usage = (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                       usage["output_tokens"])  # fmt: skip
            r.segment_base = r.usage[:2]
        self.responses[rid] = r
        self.current = r

    # -- what the client sent ------------------------------------------------------------------

    def sent(self, frame: Mapping[str, Any] | ClientEvent | str | bytes) -> None:
        """A frame the client sent: a JSON object, a typed event, or the raw text or bytes."""
        record = _Frame(len(self.frames), "undecodable", None)
        try:
            if isinstance(frame, bytes):
                raise ProtocolError("invalid_frame", "binary frame")
            if isinstance(frame, ResponseCreate | ResponseAppend | ResponseCancel | ResponseInject):
                frame = unstructure(frame)
            text = frame if isinstance(frame, str) else orjson.dumps(frame).decode()
            record.event = decode_client_event(text)
            record.raw = frame if not isinstance(frame, str) else orjson.loads(frame)
            record.kind = record.event.type
        except ProtocolError as exc:
            record.codes = {exc.detail.code}
        self.frames.append(record)
        if record.event is None:
            return
        if isinstance(record.event, ResponseSteer):
            return  # answered by its own events, whatever the state: accepted or failed
        if any(f.outcome is None and (f.can_accept or f.wild) for f in self.frames[:-1]):
            record.wild = True
            record.can_accept, codes = self._possible(record.event)
            record.codes = set(codes)
            return
        view = self._view()
        accept, codes = self._answers(record.event, view)
        record.can_accept = accept
        record.codes = set(codes)
        if accept and not codes and view.phase in ("none", "suspended"):
            self._accept(record)

    # -- what the server sent ------------------------------------------------------------------

    def received(self, event: Mapping[str, Any] | str | bytes) -> None:
        """An event the server sent, as its frame text or decoded into a JSON object."""
        obj: Mapping[str, Any] = orjson.loads(event) if isinstance(event, str | bytes) else event
        self._event = obj
        if self.schema is not None:
            errors = self.schema.event_errors(obj, transport=self.transport)
            if errors:
                self._fail(8, "; ".join(errors[:3]))
        if obj.get("stream_id") != self.stream_id:
            self._fail(9, f"an event of lane {self.stream_id!r} says {obj.get('stream_id')!r}")
        number = obj.get("sequence_number")
        if number != self.next_sequence:
            self._fail(1, f"expected sequence_number {self.next_sequence}, got {number!r}")
        self.next_sequence += 1
        kind = obj.get("type")
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            if isinstance(kind, str) and kind.startswith("response."):
                self._item_event(obj)  # an item event of a kind this checker does not know
                return
            self._fail(2, f"an event of unknown type {kind!r}")
        handler(self, obj)

    def received_typed(self, event: Any, sequence_number: int | None = None) -> None:
        """A typed server event (as the state machine returns it, before a writer numbers it)."""
        obj = unstructure(event)
        obj["sequence_number"] = self.next_sequence if sequence_number is None else sequence_number
        self.received(obj)

    def finish(self, *, closed: bool = False) -> None:
        """The stream is over. `closed`: the connection ended, so unanswered frames may never
        have been read; otherwise every frame must have had its effect or its error. After a
        violation there is nothing more to say: the first one stands."""
        self._event = None
        if self.finished or self.violation is not None:
            return
        self.finished = True
        if closed:
            return
        current = self.current
        waiting = False  # a beta Response waits silently for its calls' outputs
        if current is not None and not current.terminal:
            waiting = bool(current.waits and current.pending and current.open_item is None)
            if current.phase == "streaming" and not waiting:
                self._fail(2, f"Response {current.id} is still streaming")
            for frame in self._unanswered():
                if self._append_fits(frame):
                    self._accept(frame)  # a partial answer: accepted without a word
            if current.phase == "resuming":
                self._fail(4, f"every call of Response {current.id} was answered; it never resumed")
        if self._expected_creates:
            self._fail(7, f"{self._expected_creates} accepted response.create got no Response")
        for steer_id, steer in self.steers.items():
            if steer.state == "queued" and not self._may_wait(steer):
                self._fail(7, f"steer {steer_id} was accepted but neither applied nor returned")
        if self._successor_of is not None:
            self._fail(7, f"Response {self._successor_of} was steered but no successor came")
        if current is not None and current.cancel_frame is not None:
            self._fail(7, f"response.cancel was accepted but Response {current.id} never ended")
        for frame in self._unanswered():
            if frame.kind == "response.append" and frame.can_accept:
                continue  # accepted before the Response ended: its effect was silent
            if waiting and frame.kind == "response.create" and frame.can_accept:
                continue  # it waits behind the waiting Response, as long as that waits
            wanted = " or ".join(sorted(frame.codes)) or "an error"
            self._fail(7, f"{frame.describe()} got neither its effect nor an error ({wanted})")

    # -- events of a Response ------------------------------------------------------------------

    def _created(self, obj: Mapping[str, Any]) -> None:
        response = self._response_object(obj)
        rid = response.get("id")
        if not isinstance(rid, str) or rid in self.responses:
            self._fail(2, f"response.created for an id that is missing or not new: {rid!r}")
        successor_of, self._successor_of = self._successor_of, None
        waiting = self._first(lambda f: f.kind == "response.create" and f.can_accept)
        if successor_of is None and waiting is not None and waiting.queued_as not in (None, rid):
            self._fail(2, f"the create queued as {waiting.queued_as} was created as {rid}")
        current = self.current
        if current is not None and not current.terminal:
            self._fail(2, f"response.created while Response {current.id} is still {current.phase}")
        if response.get("status") not in ("in_progress", "queued"):
            self._fail(2, f"a new Response has status {response.get('status')!r}")
        if response.get("output"):
            self._fail(3, "a new Response already has output")
        r = _Response(rid)
        self.responses[rid] = r
        self.current = r
        previous = response.get("previous_response_id")
        if successor_of is not None:
            # a steered Response's successor: created by the server, for no create frame
            if previous != successor_of:
                self._fail(7, f"the successor of {successor_of} chains from {previous!r}")
            self._commit_steers(successor_of)
            self._check_usage(r, response)
            self._state_changed()
            return
        if isinstance(previous, str):
            self._commit_steers(previous)  # the create that answered the calls they waited on
        if self._expected_creates:
            self._expected_creates -= 1
            asked = self._accepted_create
        else:
            frame = self._first(lambda f: f.kind == "response.create" and f.can_accept)
            if frame is None:
                self._fail(7, "a Response was created that no response.create asked for")
            frame.outcome = "accepted"
            asked = frame
        if asked is not None and isinstance(asked.event, ResponseCreate):
            r.waits = asked.event.waits_for_injects
        self._check_usage(r, response)
        self._state_changed()

    def _in_progress(self, obj: Mapping[str, Any]) -> None:
        r = self._own(obj)
        if r.phase == "streaming" and self._queued_steers(r.id):
            # prototype: a steer cut the segment (or came as it ended); the Response goes on
            if self.dialect != "prototype":
                self._fail(7, f"Response {r.id} resumed in place from a steer")
            if r.open_item is not None:
                self._fail(3, f"a steer cut the segment with item {r.open_item.id} still open")
            self._check_usage(r, self._response_object(obj))
            if r.usage[0] > r.segment_base[0]:  # cut before its prefill: no prompt to compare
                r.last_prompt = r.usage[0] - r.segment_base[0]
            r.segment_base = r.usage[:2]
            if r.pending:
                self._fail(4, f"a steer cut Response {r.id} while calls await output")
            self._commit_steers(r.id)
            r.segment_start = len(r.items)
            self._check_snapshot(r, obj, "in_progress")
            return
        if r.phase in ("suspended", "resuming"):
            self._resume(r)
            self._commit_steers(r.id)
        elif r.phase != "streaming":
            self._fail(2, f"response.in_progress while Response {r.id} is {r.phase}")
        elif r.items:  # not the announcement of a new Response: a silent suspension resumed
            if not (r.waits or r.injected):
                self._fail(2, f"response.in_progress inside a segment of Response {r.id}")
            segment = r.items[r.segment_start :]
            if not segment or segment[-1].type not in CALL_TYPES:
                self._fail(4, f"Response {r.id} resumed after a segment that called no tool")
            if r.pending:
                waiting = ", ".join(r.pending)
                self._fail(4, f"Response {r.id} resumed while calls still await output: {waiting}")
            self._close_segment(r, obj)
            r.segment_start = len(r.items)
            r.injected = False
        self._check_snapshot(r, obj, "in_progress")

    def _resume(self, r: _Response) -> None:
        if r.phase == "suspended":
            # the appends that answered the calls were sent while the outcome was in doubt
            for frame in self._unanswered():
                if not r.pending:
                    break
                if self._append_fits(frame):
                    self._accept(frame)
        if r.pending:
            waiting = ", ".join(r.pending)
            self._fail(4, f"Response {r.id} resumed while calls still await output: {waiting}")
        self._confirm(len(self.frames))
        r.phase = "streaming"
        r.injected = False
        r.segment_start = len(r.items)
        r.segment_base = r.usage[:2]
        self._state_changed()

    def _done(self, obj: Mapping[str, Any]) -> None:
        if self.dialect != "prototype":
            self._fail(4, "response.done belongs to the prototype dialect only")
        r = self._own(obj)
        if r.phase != "streaming":
            self._fail(4, f"response.done while Response {r.id} is {r.phase}")
        if r.told_ended is not None:
            self._fail(7, f"frame #{r.told_ended} was told Response {r.id} had ended; it suspended")
        self._close_segment(r, obj)
        segment = r.items[r.segment_start :]
        if not segment or segment[-1].type not in CALL_TYPES:
            self._fail(4, "response.done after a segment whose last item is not a tool call")
        if not r.pending:
            self._fail(4, "response.done with no call awaiting output")
        self._check_snapshot(r, obj, "in_progress")
        r.phase = "suspended"
        self._state_changed()

    def _terminal(self, obj: Mapping[str, Any]) -> None:
        r = self._own(obj)
        status = TERMINAL_EVENTS[obj["type"]]
        if r.terminal:
            self._fail(2, f"Response {r.id} already ended ({r.phase})")
        if status == "completed":
            if r.phase != "streaming":
                self._fail(4, f"response.completed while Response {r.id} is {r.phase}")
            self._close_segment(r, obj)
            if (self.dialect == "prototype" or r.waits) and r.pending:
                self._fail(4, f"Response {r.id} completed with calls awaiting output")
        elif r.open_item is not None:
            self._fail(3, f"Response {r.id} ended with item {r.open_item.id} still open")
        if status == "cancelled":
            if r.cancel_frame is not None:
                asked = self.frames[r.cancel_frame]
            else:
                found = self._first(lambda f: f.kind == "response.cancel" and f.can_accept)
                if found is None:
                    self._fail(7, "a Response was cancelled that no response.cancel asked for")
                asked = found
                asked.outcome = "accepted"
            self._confirm(asked.number + 1)
        response = self._response_object(obj)
        if status == "failed" and not _error_detail_ok(response.get("error")):
            self._fail(2, "response.failed without an error {type, code, message}")
        if status == "incomplete":
            details = response.get("incomplete_details")
            if not isinstance(details, Mapping) or not details.get("reason"):
                self._fail(2, "response.incomplete without incomplete_details.reason")
            if details.get("reason") == "steered":
                if not self._queued_steers(r.id) or self.dialect == "prototype":
                    self._fail(7, f"Response {r.id} ended steered, but no steer of it waits")
                self._successor_of = r.id
        late = status == "completed" and self._queued_steers(r.id) and not r.pending
        if late and self.dialect == "launched":
            self._successor_of = r.id  # accepted too late to cut: a successor all the same
        self._check_snapshot(r, obj, status)
        r.phase = status
        r.cancel_frame = None
        for frame in self.frames:
            if frame.unconfirmed_in == r.id:
                # predicted accepted, but the Response ended before any event confirmed it:
                # the server may have refused it as arriving too late
                frame.unconfirmed_in = None
                frame.outcome = None
                frame.can_accept = True
                frame.codes.add("no_open_response")
        self._state_changed()

    def _close_segment(self, r: _Response, obj: Mapping[str, Any]) -> None:
        if r.open_item is not None:
            self._fail(3, f"the segment ended with item {r.open_item.id} still open")
        response = self._response_object(obj)
        self._check_usage(r, response)
        prompt = r.usage[0] - r.segment_base[0]
        cached = r.usage[1] - r.segment_base[1]
        if response.get("usage") is None:
            return
        if cached > prompt:
            self._fail(6, f"this segment reports {cached} cached of {prompt} input tokens")
        if self.dialect == "prototype" and r.last_prompt is not None and prompt <= r.last_prompt:
            self._fail(
                6,
                f"a resumed segment read a prompt of {prompt} tokens, no more than the "
                f"previous segment's {r.last_prompt}: the conversation only grows",
            )
        r.last_prompt = prompt
        r.segment_base = r.usage[:2]

    def _queued(self, obj: Mapping[str, Any]) -> None:
        """A create waits its turn: the Response it will be, announced with its id."""
        response = self._response_object(obj)
        rid = response.get("id")
        known = {f.queued_as for f in self.frames}
        if not isinstance(rid, str) or rid in self.responses or rid in known:
            self._fail(2, f"response.queued for an id that is missing or not new: {rid!r}")
        if response.get("status") != "queued":
            self._fail(2, f"response.queued carries status {response.get('status')!r}")
        waiting = [f for f in self._unanswered() if f.kind == "response.create" and f.can_accept]
        current = self.current
        if waiting and (current is None or current.terminal):
            waiting = waiting[1:]  # the oldest is being served: it waits behind no one
        frame = next((f for f in waiting if f.queued_as is None), None)
        if frame is None:
            self._fail(7, "a Response was queued that no waiting response.create asked for")
        frame.queued_as = rid

    def _inject_created(self, obj: Mapping[str, Any]) -> None:
        frame = self._inject_frame(obj)
        r = self.responses.get(obj["response_id"])
        if r is None or r.terminal:
            self._fail(7, f"response.inject.created for a Response not active on this lane: {r}")
        assert isinstance(frame.event, ResponseInject)
        for item in frame.event.input:
            call_id = getattr(item, "call_id", None)
            if call_id not in r.pending:
                self._fail(
                    5, f"an inject committed an output for {call_id!r}, which no call awaits"
                )
            del r.pending[call_id]
            r.answered.add(call_id)
        frame.outcome = "accepted"
        self._confirm(frame.number)
        if r.phase == "streaming":
            r.injected = True
        if r.phase == "suspended" and not r.pending:
            r.phase = "resuming"
        self._state_changed()

    def _inject_failed(self, obj: Mapping[str, Any]) -> None:
        frame = self._inject_frame(obj)
        error = obj.get("error")
        code = error.get("code") if isinstance(error, Mapping) else None
        if code not in ("response_not_found", "response_already_completed"):
            self._fail(7, f"response.inject.failed with code {code!r}")
        r = self.responses.get(obj["response_id"])
        if code == "response_not_found" and r is not None:
            self._fail(7, f"Response {r.id} of this lane was said not to exist")
        if list(obj.get("input") or ()) != list(frame.raw.get("input", ())):
            self._fail(7, "response.inject.failed did not return the input as it was sent")
        frame.outcome = "refused"
        self._confirm(frame.number)

    # -- steering ------------------------------------------------------------------------------

    def _steer_frame(self, obj: Mapping[str, Any]) -> _Frame:
        steer = obj.get("steer")
        rid = steer.get("previous_response_id") if isinstance(steer, Mapping) else None
        frame = self._first(
            lambda f: isinstance(f.event, ResponseSteer) and f.event.previous_response_id == rid
        )
        if frame is None:
            self._fail(7, f"{obj.get('type')} for {rid!r} answers no response.steer")
        return frame

    def _steer_accepted(self, obj: Mapping[str, Any]) -> None:
        frame = self._steer_frame(obj)
        steer_id, rid = obj["steer"]["id"], obj["steer"]["previous_response_id"]
        r = self.responses.get(rid)
        waiting = r is not None and r.phase == "completed" and bool(r.pending)
        if r is None or (r.terminal and not waiting):
            self._fail(7, f"a steer was accepted for {rid!r}, not active on this lane")
        if steer_id in self.steers:
            self._fail(7, f"steer id {steer_id!r} was given twice")
        frame.outcome = "accepted"
        self.steers[steer_id] = _Steer(rid, frame.number)

    def _steer_pending(self, obj: Mapping[str, Any]) -> None:
        steer = self.steers.get(obj["steer"]["id"])
        if steer is None or steer.state != "queued" or steer.told_pending:
            self._fail(7, f"response.steer.pending for a steer not waiting: {obj['steer']['id']}")
        steer.told_pending = True
        r = self.responses[steer.response_id]
        if not r.pending or r.phase not in ("suspended", "completed"):
            self._fail(7, f"a steer is pending while Response {r.id} waits on no call")
        required = {stub.get("call_id") for stub in obj["required_input"]}
        if not required or not required <= set(r.pending):
            self._fail(7, f"required_input {sorted(map(str, required))} are not awaited calls")

    def _steer_failed(self, obj: Mapping[str, Any]) -> None:
        error, returned = obj["error"], obj["steer"]
        if error.get("code") not in STEER_CODES:
            self._fail(7, f"response.steer.failed with code {error.get('code')!r}")
        steer_id = returned.get("id")
        if steer_id is not None:  # accepted before: it comes back now, not committed
            steer = self.steers.get(steer_id)
            if steer is None or steer.state != "queued":
                self._fail(7, f"steer {steer_id!r} failed, but it was not waiting")
            steer.state = "failed"
            raw = self.frames[steer.frame].raw
        else:
            frame = self._steer_frame(obj)
            frame.outcome = "refused"
            raw = frame.raw
            rid = returned["previous_response_id"]
            if error["code"] == "response_not_found" and rid in self.responses:
                self._fail(7, f"Response {rid} of this lane was said not to exist")
        if returned.get("input") != raw.get("input"):
            self._fail(7, "response.steer.failed did not return the input as it was sent")

    def _queued_steers(self, response_id: str) -> list[_Steer]:
        return [
            s for s in self.steers.values() if s.response_id == response_id and s.state == "queued"
        ]

    def _commit_steers(self, response_id: str) -> None:
        for steer in self._queued_steers(response_id):
            steer.state = "committed"

    def _may_wait(self, steer: _Steer) -> bool:
        """A steer may still wait at the end: for the outputs its Response waits on."""
        r = self.responses.get(steer.response_id)
        return r is not None and bool(r.pending) and r.phase in ("suspended", "completed")

    def _inject_frame(self, obj: Mapping[str, Any]) -> _Frame:
        rid = obj.get("response_id")
        frame = self._first(
            lambda f: isinstance(f.event, ResponseInject) and f.event.response_id == rid
        )
        if frame is None:
            self._fail(7, f"{obj.get('type')} for {rid!r} answers no response.inject")
        return frame

    # -- events of an item -----------------------------------------------------------------------

    def _item_event(self, obj: Mapping[str, Any]) -> None:
        r = self._streaming()
        kind = obj["type"]
        index = obj.get("output_index")
        if kind == "response.output_item.added":
            self._item_added(r, obj, index)
            return
        if not isinstance(index, int) or not 0 <= index < len(r.items):
            self._fail(3, f"{kind} for output_index {index!r}, which was never added")
        item = r.items[index]
        if item.done:
            self._fail(3, f"{kind} after output_item.done of item {item.id}")
        if kind == "response.output_item.done":
            self._item_done(r, item, obj)
            return
        if obj.get("item_id") != item.id:
            self._fail(3, f"{kind} names item {obj.get('item_id')!r}, but {index} is {item.id}")
        if kind in ("response.content_part.added", "response.content_part.done"):
            self._content_part(item, obj)
        elif kind in ("response.output_text.delta", "response.output_text.done"):
            part = self._open_part(item, obj)
            if kind.endswith(".delta"):
                if part in item.texts_done:
                    self._fail(3, "an output_text.delta after its output_text.done")
                item.parts[part].append(_text(obj, "delta", self))
            else:
                if obj.get("text") != "".join(item.parts[part]):
                    self._fail(3, "output_text.done's text is not the concatenated deltas")
                item.texts_done.add(part)
        elif kind in (
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
        ):
            expected = "function_call" if "function_call" in kind else "custom_tool_call"
            if item.type != expected:
                self._fail(3, f"{kind} inside a {item.type} item")
            if item.arguments_done:
                self._fail(3, f"{kind} after the arguments were done")
            if kind.endswith(".delta"):
                item.arguments.append(_text(obj, "delta", self))
            else:
                field = "arguments" if expected == "function_call" else "input"
                if obj.get(field) != "".join(item.arguments):
                    self._fail(3, f"{kind}'s {field} is not the concatenated deltas")
                if expected == "function_call" and obj.get("name") != item.name:
                    self._fail(3, f"{kind} names {obj.get('name')!r}, the item {item.name!r}")
                item.arguments_done = True

    def _item_added(self, r: _Response, obj: Mapping[str, Any], index: Any) -> None:
        if r.open_item is not None:
            self._fail(3, f"an item was added while item {r.open_item.id} is still open")
        if index != len(r.items):
            self._fail(4, f"output_index {index!r} does not continue the output at {len(r.items)}")
        raw = obj.get("item")
        if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
            self._fail(3, "output_item.added without an item id")
        if any(item.id == raw["id"] for r2 in self.responses.values() for item in r2.items):
            self._fail(3, f"item id {raw['id']} was used before")
        item_type = str(raw.get("type"))
        call_id = raw.get("call_id")
        if item_type in CALL_TYPES:
            if not isinstance(call_id, str) or not call_id:
                self._fail(5, f"a {item_type} without a call_id")
            if any(i.call_id == call_id for r2 in self.responses.values() for i in r2.items):
                self._fail(5, f"call_id {call_id} was emitted before")
        name = raw.get("name")
        r.items.append(
            _Item(index, raw["id"], item_type, call_id, name if isinstance(name, str) else None)
        )

    def _content_part(self, item: _Item, obj: Mapping[str, Any]) -> None:
        if item.type != "message":
            self._fail(3, f"a content part inside a {item.type} item")
        part = obj.get("content_index")
        if obj["type"].endswith(".added"):
            if part != len(item.parts) or item.parts_open:
                self._fail(3, f"content_part.added at content_index {part!r} out of order")
            item.parts.append([])
            item.parts_open.add(part)
            return
        part = self._open_part(item, obj)
        text = "".join(item.parts[part])
        if part not in item.texts_done:
            self._fail(3, "content_part.done before its output_text.done")
        shown = obj.get("part")
        if not isinstance(shown, Mapping) or shown.get("text") != text:
            self._fail(3, "content_part.done's text is not the concatenated deltas")
        item.parts_open.discard(part)

    def _open_part(self, item: _Item, obj: Mapping[str, Any]) -> int:
        part = obj.get("content_index")
        if not isinstance(part, int) or part not in item.parts_open:
            self._fail(3, f"{obj['type']} outside an open content part ({part!r})")
        return part

    def _item_done(self, r: _Response, item: _Item, obj: Mapping[str, Any]) -> None:
        raw = obj.get("item")
        if not isinstance(raw, Mapping) or raw.get("id") != item.id:
            self._fail(3, f"output_item.done does not close item {item.id}")
        if raw.get("type") != item.type:
            self._fail(3, f"item {item.id} was added as {item.type}, done as {raw.get('type')}")
        if item.parts_open:
            self._fail(3, f"output_item.done while content part(s) {item.parts_open} are open")
        if item.type == "message":
            content = raw.get("content")
            texts = [p.get("text") for p in content if isinstance(p, Mapping)] if content else []
            if texts != ["".join(deltas) for deltas in item.parts]:
                self._fail(3, "the done message's text is not the concatenated deltas")
        elif item.type in CALL_TYPES:
            field = "arguments" if item.type == "function_call" else "input"
            if raw.get(field) != "".join(item.arguments):
                self._fail(3, f"the done call's {field} is not the concatenated deltas")
            if raw.get("call_id") != item.call_id or raw.get("name") != item.name:
                self._fail(5, f"item {item.id} changed its call_id or name between added and done")
            if raw.get("status") == "completed":
                assert item.call_id is not None
                r.pending[item.call_id] = item.index
        item.done = True

    # -- errors --------------------------------------------------------------------------------

    def _error(self, obj: Mapping[str, Any]) -> None:
        detail = obj.get("error")
        if not isinstance(detail, Mapping) or not _error_detail_ok(detail):
            self._fail(7, "an error event without error {type, code, message}")
        code = detail["code"]
        if code in self.unsolicited_errors:
            return
        frame = self._first(lambda f: code in f.codes)
        if frame is None:
            waiting = "; ".join(
                f"{f.describe()} may earn {sorted(f.codes) or 'no error'}"
                for f in self._unanswered()
            )
            self._fail(7, f"error {code!r} answers no frame ({waiting or 'none is unanswered'})")
        frame.outcome = "refused"
        self._confirm(frame.number)
        current = self.current
        if code == "no_open_response" and current is not None and not current.terminal:
            current.told_ended = frame.number  # then its terminal event must come next

    # -- the model's helpers -------------------------------------------------------------------

    def _view(self) -> _View:
        r = self.current
        if r is None or r.terminal:
            return _View("streaming" if self._expected_creates else "none")
        if r.cancel_frame is not None:
            phase = "ending"
        elif r.phase == "suspended":
            phase = "suspended"
        else:
            phase = "streaming"
        return _View(phase, frozenset(r.pending), frozenset(r.answered))

    def _possible(self, event: ClientEvent) -> tuple[bool, frozenset[str]]:
        """Every answer `event` could earn in some state of the connection."""
        mentioned = frozenset(
            item.call_id
            for item in (event.input if isinstance(event, ResponseAppend) else ())
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput)
        )
        views = [
            _View("none"),
            _View("streaming"),
            _View("ending"),
            _View("suspended", pending=mentioned),
            _View("suspended", pending=mentioned | {"call_elsewhere"}),
            _View("suspended", answered=mentioned),
            _View("suspended"),
        ]
        accept, codes = False, frozenset[str]()
        for view in views:
            may_accept, may_earn = self._answers(event, view)
            accept, codes = accept or may_accept, codes | may_earn
        return accept, codes

    def _answers(self, event: ClientEvent, view: _View) -> tuple[bool, frozenset[str]]:
        """Whether `event` may be accepted in `view`, and the error codes it may earn there."""
        if isinstance(event, ResponseSteer):
            return False, frozenset()  # answered by its own events (`sent`)
        if isinstance(event, ResponseInject):
            return True, INJECT_ERRORS  # its effect is its own event: inject.created or .failed
        if self.dialect == "prototype":
            code = self._judge(event, view)
            codes = {code} if code else set()
            if isinstance(event, ResponseAppend) and event.response_id is not None:
                if view.phase in ("none", "suspended"):
                    codes |= RESUME_ERRORS  # resumed from the store, or not
                if view.phase == "none":
                    codes.discard("no_open_response")  # it names one: the store is asked
            if view.phase == "streaming" and not isinstance(event, ResponseCreate):
                codes.add("no_open_response")  # it may have ended, its terminal event not out yet
            if code is None and _forces_a_call(event):
                codes.add("unsupported_tool_choice")
            if code is None and _carries_compaction(event):
                codes.add("invalid_field")
            return code is None, frozenset(codes)
        if isinstance(event, ResponseCreate):
            refusal = _refusal(event)
            if event.background or refusal:
                return False, frozenset({refusal or "invalid_field"})
            # served when its turn comes: its chain may be gone, the queue may be full
            codes = {"concurrent_request"}
            if _forces_a_call(event):
                codes.add("unsupported_tool_choice")
            if event.previous_response_id is not None:
                # the chain may be gone, another key's, or the store unable to answer
                codes |= {"previous_response_not_found", "store_unavailable"}
            if _carries_compaction(event):
                codes.add("invalid_field")
            return True, frozenset(codes)
        if isinstance(event, ResponseAppend):
            return False, frozenset({"unknown_event_type"})
        return view.phase != "none", frozenset({"no_open_response"})

    def _judge(self, event: ClientEvent, view: _View) -> str | None:
        """The prototype dialect: the one error code `event` earns in `view`, or None."""
        if isinstance(event, ResponseCreate):
            if view.phase != "none":
                return "concurrent_request"
            if event.previous_response_id is not None or is_warmup(event):
                return "invalid_field"
            if event.context_management:
                return "invalid_field"
            return "invalid_field" if event.background else _refusal(event)
        if view.phase in ("none", "ending"):
            return "no_open_response"
        if isinstance(event, ResponseCancel):
            return None
        if view.phase != "suspended":
            return "response_in_progress"
        assert isinstance(event, ResponseAppend)
        if not event.input:
            return "invalid_field"
        answering: set[str] = set()
        message = False
        for item in event.input:
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                if item.call_id in answering or item.call_id in view.answered:
                    return "duplicate_call_id"
                if item.call_id not in view.pending:
                    return "unknown_call_id"
                answering.add(item.call_id)
            elif isinstance(item, Message) and item.role != "assistant":
                message = True
            else:
                return "invalid_field"
        if message and view.pending - answering:
            return "missing_tool_output"
        return None

    def _append_fits(self, frame: _Frame) -> bool:
        """An append in doubt that the server, as it is now, would accept."""
        if not (isinstance(frame.event, ResponseAppend) and frame.can_accept):
            return False
        accept, codes = self._answers(frame.event, self._view())
        return accept and not codes - RESUME_ERRORS

    def _accept(self, frame: _Frame) -> None:
        """Apply an accepted frame's effect to the model."""
        frame.outcome = "accepted"
        event = frame.event
        r = self.current
        if isinstance(event, ResponseCreate):
            self._expected_creates += 1
            self._accepted_create = frame
        elif isinstance(event, ResponseCancel) and r is not None:
            r.cancel_frame = frame.number
            frame.unconfirmed_in = r.id
        elif isinstance(event, ResponseAppend) and r is not None:
            frame.unconfirmed_in = r.id
            for item in event.input:
                if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                    del r.pending[item.call_id]
                    r.answered.add(item.call_id)
            if not r.pending:
                r.phase = "resuming"
        self._state_changed()

    def _state_changed(self) -> None:
        """Widen every unanswered frame's legal answers by what the new state allows."""
        view = self._view()
        for frame in self._unanswered():
            if frame.wild or frame.event is None:
                continue
            accept, codes = self._answers(frame.event, view)
            frame.can_accept |= accept
            frame.codes |= codes

    def _confirm(self, before: int) -> None:
        """Frames are served in order: an answer to frame N settles every prediction before it."""
        for frame in self.frames[:before]:
            frame.unconfirmed_in = None

    def _unanswered(self) -> list[_Frame]:
        return [f for f in self.frames if f.outcome is None]

    def _first(self, wanted: Callable[[_Frame], bool]) -> _Frame | None:
        return next((f for f in self._unanswered() if wanted(f)), None)

    def _own(self, obj: Mapping[str, Any]) -> _Response:
        """The Response a response-level event is about: the connection's current one."""
        rid = self._response_object(obj).get("id")
        current = self.current
        if current is None or rid != current.id:
            known = rid in self.responses
            self._fail(2, f"{obj['type']} for {'an ended' if known else 'an unknown'} Response")
        return current

    def _streaming(self) -> _Response:
        r = self.current
        if r is None:
            self._fail(2, "an item event before any response.created")
        if r.terminal:
            self._fail(2, f"an item event after Response {r.id} ended ({r.phase})")
        if r.phase != "streaming":
            self._fail(4, f"an item event while Response {r.id} is {r.phase}")
        return r

    def _response_object(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        response = obj.get("response")
        if not isinstance(response, Mapping):
            self._fail(2, f"{obj.get('type')} without a response object")
        return response

    def _check_snapshot(self, r: _Response, obj: Mapping[str, Any], status: str) -> None:
        response = self._response_object(obj)
        if response.get("status") != status:
            self._fail(2, f"{obj['type']} carries status {response.get('status')!r}")
        output = response.get("output")
        ids = [i.get("id") for i in output if isinstance(i, Mapping)] if output else []
        if ids != [item.id for item in r.items]:
            self._fail(3, f"the Response's output {ids} is not the items streamed")
        self._check_usage(r, response)

    def _check_usage(self, r: _Response, response: Mapping[str, Any]) -> None:
        usage = response.get("usage")
        if usage is None:
            return
        try:
            input_tokens = usage["input_tokens"]
            cached = usage["input_tokens_details"]["cached_tokens"]
            output = usage["output_tokens"]
            total = usage["total_tokens"]
        except (KeyError, TypeError):
            self._fail(6, "usage lacks input, cached, output or total tokens")
        if total != input_tokens + output:
            self._fail(6, f"total_tokens {total} is not input {input_tokens} + output {output}")
        if cached > input_tokens:
            self._fail(6, f"cached_tokens {cached} exceed input_tokens {input_tokens}")
        now = (input_tokens, cached, output)
        if any(a < b for a, b in zip(now, r.usage, strict=True)):
            self._fail(6, f"usage went down from {r.usage} to {now} (input, cached, output)")
        r.usage = now
        if self.count_tokens is not None:
            streamed = sum(self._tokens(item) for item in r.items)
            if output != streamed:
                self._fail(6, f"output_tokens is {output}, but what streamed counts {streamed}")

    def _tokens(self, item: _Item) -> int:
        count = self.count_tokens
        assert count is not None
        if item.type == "message":
            return sum(count("".join(deltas)) for deltas in item.parts)
        if item.type in CALL_TYPES:
            return count(item.name or "") + count("".join(item.arguments))
        return 0

    def _fail(self, invariant: int, detail: str) -> NoReturn:
        event = self._event
        number = event.get("sequence_number") if isinstance(event, Mapping) else None
        self.violation = InvariantViolation(invariant, detail, sequence_number=number, event=event)
        raise self.violation


def _error_detail_ok(detail: Any) -> bool:
    return isinstance(detail, Mapping) and all(
        isinstance(detail.get(key), str) and detail.get(key) for key in ("type", "code", "message")
    )


def _text(obj: Mapping[str, Any], field: str, checker: StreamChecker) -> str:
    value = obj.get(field)
    if not isinstance(value, str):
        checker._fail(3, f"{obj['type']} without a string {field}")
    return value


_HANDLERS: Mapping[str, Callable[[StreamChecker, Mapping[str, Any]], None]] = {
    "response.created": StreamChecker._created,
    "response.in_progress": StreamChecker._in_progress,
    "response.done": StreamChecker._done,
    "response.queued": StreamChecker._queued,
    "response.inject.created": StreamChecker._inject_created,
    "response.inject.failed": StreamChecker._inject_failed,
    "response.steer.accepted": StreamChecker._steer_accepted,
    "response.steer.pending": StreamChecker._steer_pending,
    "response.steer.failed": StreamChecker._steer_failed,
    **dict.fromkeys(TERMINAL_EVENTS, StreamChecker._terminal),
    "error": StreamChecker._error,
}


def _forces_a_call(event: ClientEvent) -> bool:
    """A create whose tool_choice forces a call: a server whose model cannot force one (a local
    model without a fast tokenizer, which llguidance needs) refuses it with
    `unsupported_tool_choice`, another serves it."""
    return (
        isinstance(event, ResponseCreate)
        and _refusal(event) is None
        and (parse_tool_choice(event.tool_choice).mode == "required")
    )


def _carries_compaction(event: ClientEvent) -> bool:
    """A create with a compaction item: only the server that sealed it can tell whether it is
    genuine, and refuses it (`invalid_field`) if not."""
    return isinstance(event, ResponseCreate) and any(
        isinstance(item, UnknownItem) and item.type == "compaction" for item in input_items(event)
    )


def _refusal(create: ResponseCreate) -> str | None:
    """The code of the error a create earns beyond its decoding (`check_create`, as the server
    runs it), or None."""
    try:
        check_create(create)
    except ProtocolError as exc:
        return exc.detail.code
    return None
