"""`StreamChecker`: one connection's events held to the protocol's promises as they arrive.

It composes the model of Responses (`responses.py`: what the events built) and the ledger of
frames (`ledger.py`: what the client sent, and what each frame may still earn). Each event is
dispatched by its type: an item's events to the model, the events that answer a frame in their
own right (`error`, `response.queued`, inject and steer answers) to the ledger, and the events
of a Response's life (created, in progress, done, its end) are handled here, where the two must
agree: a Response's life settles frames (a create, a cancel, appends in doubt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from proto_server.testing.checker.invariants import Broken, Dialect, InvariantViolation
from proto_server.testing.checker.ledger import Frame, Ledger
from proto_server.testing.checker.responses import (
    TERMINAL_EVENTS,
    Response,
    Responses,
    response_object,
)
from proto_server.wire.converter import as_json
from proto_server.wire.events import ClientEvent, ResponseCreate

if TYPE_CHECKING:
    from proto_server.testing.schema import Transport, WireSchema

#: The errors of a Response that ended as decided but could not be stored, so failed instead.
UNSTORED = ("store_unavailable", "response_resumed_elsewhere")


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
        self.model = Responses(dialect=dialect, count_tokens=count_tokens)
        self.ledger = Ledger(
            self.model,
            dialect=dialect,
            unsolicited_errors=frozenset(unsolicited_errors),
            background=transport == "sse",
        )
        self.next_sequence = 0
        self.violation: InvariantViolation | None = None
        self.finished = False
        self.stream_id: str | None = None  # the lane it checks (LaneChecker sets it)
        self._event: Any = None  # the event being read: what a violation names

    @property
    def responses(self) -> dict[str, Response]:
        """Every Response of the connection, by id."""
        return self.model.by_id

    @property
    def current(self) -> Response | None:
        """The Response the connection's events are about now (it may have ended)."""
        return self.model.current

    @property
    def frames(self) -> list[Frame]:
        """Every frame the client sent, with its outcome once known."""
        return self.ledger.frames

    def resuming(self, response: Mapping[str, Any]) -> None:
        """This connection resumes by id a Response another connection saw suspend:
        `response` is the Response object of the last `response.done` it received. The model
        starts from that suspension: its output (closed), its usage, and the calls of its last
        segment waiting; the connection's own events are numbered from 0."""
        self.model.adopt(response)

    def sent(self, frame: Mapping[str, Any] | ClientEvent | str | bytes) -> None:
        """A frame the client sent: a JSON object, a typed event, or the raw text or bytes."""
        self.ledger.sent(frame)

    def received(self, event: Mapping[str, Any] | str | bytes) -> None:
        """An event the server sent, as its frame text or decoded into a JSON object."""
        obj: Mapping[str, Any] = orjson.loads(event) if isinstance(event, str | bytes) else event
        self._event = obj
        try:
            if self.schema is not None:
                errors = self.schema.event_errors(obj, transport=self.transport)
                if errors:
                    raise Broken(8, "; ".join(errors[:3]))
            if obj.get("stream_id") != self.stream_id:
                lane = obj.get("stream_id")
                raise Broken(9, f"an event of lane {self.stream_id!r} says {lane!r}")
            number = obj.get("sequence_number")
            if number != self.next_sequence:
                raise Broken(1, f"expected sequence_number {self.next_sequence}, got {number!r}")
            self.next_sequence += 1
            kind = obj.get("type")
            if not isinstance(kind, str):
                raise Broken(2, f"an event of unknown type {kind!r}")
            if (life := _LIFE.get(kind)) is not None:
                life(self, obj)
            elif (answer := _ANSWERS.get(kind)) is not None:
                answer(self.ledger, obj)
            elif kind.startswith("response."):
                self.model.item_event(obj)  # or an event of a kind this checker does not know
            else:
                raise Broken(2, f"an event of unknown type {kind!r}")
        except Broken as broken:
            self._violated(broken)

    def received_typed(self, event: Any, sequence_number: int | None = None) -> None:
        """A typed server event (as the state machine returns it, before a writer numbers it)."""
        obj = as_json(event)
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
        try:
            current = self.model.current
            waiting = False  # a beta Response waits silently for its calls' outputs
            if current is not None and not current.terminal:
                waiting = current.waiting_on_injects
                if current.phase == "streaming" and not waiting:
                    raise Broken(2, f"Response {current.id} is still streaming")
                for frame in self.ledger.unanswered():
                    if self.ledger.append_fits(frame):
                        self.ledger.accept(frame)  # a partial answer: accepted without a word
                if current.phase == "resuming":
                    raise Broken(
                        4, f"every call of Response {current.id} was answered; it never resumed"
                    )
            self.ledger.finish(waiting=waiting)
        except Broken as broken:
            self._violated(broken)

    # -- the events of a Response's life ---------------------------------------------------------

    def _created(self, obj: Mapping[str, Any]) -> None:
        response = response_object(obj)
        rid = response.get("id")
        if not isinstance(rid, str) or rid in self.model.by_id:
            raise Broken(2, f"response.created for an id that is missing or not new: {rid!r}")
        ledger = self.ledger
        successor_of, ledger.successor_of = ledger.successor_of, None
        waiting = ledger.first(lambda f: f.kind == "response.create" and f.can_accept)
        if successor_of is None and waiting is not None and waiting.queued_as not in (None, rid):
            raise Broken(2, f"the create queued as {waiting.queued_as} was created as {rid}")
        r = self.model.begin(rid, response)
        previous = response.get("previous_response_id")
        if successor_of is not None:
            # a steered Response's successor: created by the server, for no create frame
            if previous != successor_of:
                raise Broken(7, f"the successor of {successor_of} chains from {previous!r}")
            ledger.commit_steers(successor_of)
        else:
            if isinstance(previous, str):
                ledger.commit_steers(previous)  # the create that answered the calls they awaited
            asked = ledger.created()
            if asked is not None and isinstance(asked.event, ResponseCreate):
                r.waits = asked.event.waits_for_injects
        self.model.check_usage(r, response)
        ledger.state_changed()

    def _in_progress(self, obj: Mapping[str, Any]) -> None:
        r = self.model.own(obj)
        if r.phase == "streaming" and self.ledger.queued_steers(r.id):
            # prototype: a steer cut the segment (or came as it ended); the Response goes on
            if self.dialect != "prototype":
                raise Broken(7, f"Response {r.id} resumed in place from a steer")
            self.model.cut_by_steer(r, obj)
            self.ledger.commit_steers(r.id)
        elif r.phase in ("suspended", "resuming"):
            self._resume(r)
            self.ledger.commit_steers(r.id)
        elif r.phase != "streaming":
            raise Broken(2, f"response.in_progress while Response {r.id} is {r.phase}")
        elif r.items:  # not the announcement of a new Response: a silent suspension resumed
            self.model.resume_silently(r, obj)
        self.model.check_snapshot(r, obj, "in_progress")

    def _resume(self, r: Response) -> None:
        if r.phase == "suspended":
            # the appends that answered the calls were sent while the outcome was in doubt
            for frame in self.ledger.unanswered():
                if not r.pending:
                    break
                if self.ledger.append_fits(frame):
                    self.ledger.accept(frame)
        self.model.resume(r)
        self.ledger.confirm(len(self.ledger.frames))
        self.ledger.state_changed()

    def _done(self, obj: Mapping[str, Any]) -> None:
        if self.dialect != "prototype":
            raise Broken(4, "response.done belongs to the prototype dialect only")
        self.model.suspend(self.model.own(obj), obj)
        self.ledger.state_changed()

    def _terminal(self, obj: Mapping[str, Any]) -> None:
        r = self.model.own(obj)
        status = TERMINAL_EVENTS[obj["type"]]
        self.model.check_end(r, obj, status)
        response = response_object(obj)  # its incomplete_details checked by check_end
        # a cancelled `store: true` Response that the store could not take fails instead
        unstored = status == "failed" and (response.get("error") or {}).get("code") in UNSTORED
        if status == "cancelled":
            self.ledger.cancelled(r.cancel_frame)
        elif unstored:
            self.ledger.unstored(r.cancel_frame)
        queued_steers = self.ledger.queued_steers(r.id)
        steered = status == "incomplete" and response["incomplete_details"]["reason"] == "steered"
        if steered:
            if not queued_steers or self.dialect == "prototype":
                raise Broken(7, f"Response {r.id} ended steered, but no steer of it waits")
            self.ledger.successor_of = r.id
        late = status == "completed" and queued_steers and not r.pending
        if late and self.dialect == "launched":
            self.ledger.successor_of = r.id  # accepted too late to cut: a successor all the same
        self.model.end(r, obj, status)
        self.ledger.ended(r.id)
        self.ledger.state_changed()

    def _violated(self, broken: Broken) -> NoReturn:
        """Report `broken` as broken by the event being read (None: by the end of the stream)."""
        event = self._event
        number = event.get("sequence_number") if isinstance(event, Mapping) else None
        self.violation = InvariantViolation(
            broken.invariant, broken.detail, sequence_number=number, event=event
        )
        raise self.violation.with_traceback(broken.__traceback__) from None


#: The events of a Response's life: model and ledger both.
_LIFE: Mapping[str, Callable[[StreamChecker, Mapping[str, Any]], None]] = {
    "response.created": StreamChecker._created,
    "response.in_progress": StreamChecker._in_progress,
    "response.done": StreamChecker._done,
    **dict.fromkeys(TERMINAL_EVENTS, StreamChecker._terminal),
}
#: The events that answer a frame in their own right: the ledger's to judge.
_ANSWERS: Mapping[str, Callable[[Ledger, Mapping[str, Any]], None]] = {
    "response.queued": Ledger.queued,
    "response.inject.created": Ledger.inject_created,
    "response.inject.failed": Ledger.inject_failed,
    "response.steer.accepted": Ledger.steer_accepted,
    "response.steer.pending": Ledger.steer_pending,
    "response.steer.failed": Ledger.steer_failed,
    "error": Ledger.error,
}
