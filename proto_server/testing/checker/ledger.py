"""The checker's ledger: what the client sent, and what each frame may still be answered with.

Frames race the stream: an append sent while a segment streams may reach the server before or
after the segment suspends. So each frame keeps the set of answers that were legal in every
state the server went through between its sending and its answer (`View`), and an `error` is
matched to the oldest unanswered frame that may earn that code. A frame sent while the
connection is settled (nothing streaming, no earlier frame in doubt) has exactly one legal
answer, and is applied to the model of Responses at once (`accept`).

The ledger also holds the answers that are events of their own: `response.queued` for a create
that waits its turn, `response.inject.created` / `.failed`, and a steer's `accepted`,
`pending` and `failed` (with the accepted steers until they are committed or returned).

What a frame may earn in a state of the server (`View`, the codes, `judge`) is answers.py's;
the ledger keeps the `Frame` records that its answers (`error`, `created`, `inject_failed`,
`steer_failed`...) settle, so the codes a frame may earn and those its answers are matched by
are read from one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import orjson

from proto_server.testing.checker.answers import RESUME_ERRORS, STEER_CODES, View, answers, possible
from proto_server.testing.checker.invariants import Broken, Dialect
from proto_server.testing.checker.responses import Responses, error_detail_ok, response_object
from proto_server.wire.converter import as_json, decode_client_event
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseInject,
    ResponseSteer,
)
from proto_server.wire.items import CustomToolCallOutput, FunctionCallOutput


@attrs.define
class Frame:
    """One frame the client sent, and what it may earn until its answer comes."""

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
    silent: bool = False  # its effect may have been an end that said otherwise (unstored)
    refused_with: str | None = None  # the code of the error taken as its answer

    def describe(self) -> str:
        return f"frame #{self.number} ({self.kind})"


@attrs.define
class Steer:
    """An accepted steer: the Response it steers, its frame, and what became of it."""

    response_id: str
    frame: int
    state: str = "queued"  # queued | committed | failed
    told_pending: bool = False


class Ledger:
    """The frames of one connection (or lane) and their answers, judged against `model`: the
    ledger reads the model's current Response to know how the server must answer, and applies
    an accepted frame's effect to it."""

    def __init__(
        self,
        model: Responses,
        *,
        dialect: Dialect,
        unsolicited_errors: frozenset[str],
        background: bool = False,
    ) -> None:
        self.model = model
        self.dialect = dialect
        #: `background: true` is served (over HTTP), not refused (over a WebSocket).
        self.background = background
        self.unsolicited_errors = unsolicited_errors
        self.frames: list[Frame] = []
        self.steers: dict[str, Steer] = {}
        self.expected_creates = 0
        self.accepted_create: Frame | None = None  # the create predicted accepted, if any
        #: The Response whose successor the next response.created must be (launched).
        self.successor_of: str | None = None

    def sent(self, frame: Mapping[str, Any] | ClientEvent | str | bytes) -> None:
        """Record a frame the client sent, with the answers it may earn; one sent while the
        connection is settled, and that must be accepted, takes effect now."""
        record = Frame(len(self.frames), "undecodable", None)
        try:
            if isinstance(frame, bytes):
                raise ProtocolError("invalid_frame", "binary frame")
            if isinstance(frame, ResponseCreate | ResponseAppend | ResponseCancel | ResponseInject):
                frame = as_json(frame)
            text = frame if isinstance(frame, str) else orjson.dumps(frame).decode()
            record.event = decode_client_event(text)
            if self.background and isinstance(record.event, ResponseCreate):
                # served as any create: its stream is the same, only its creator may leave it
                record.event = attrs.evolve(record.event, background=None)
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
            record.can_accept, codes = possible(record.event, self.dialect)
            record.codes = set(codes)
            return
        view = self.view()
        accept, codes = answers(record.event, view, self.dialect)
        record.can_accept = accept
        record.codes = set(codes)
        if accept and not codes and view.phase in ("none", "suspended"):
            self.accept(record)

    # -- frames and their answers ----------------------------------------------------------------

    def unanswered(self) -> list[Frame]:
        return [f for f in self.frames if f.outcome is None]

    def first(self, wanted: Callable[[Frame], bool]) -> Frame | None:
        """The oldest unanswered frame that is `wanted`: frames are answered in order."""
        return next((f for f in self.unanswered() if wanted(f)), None)

    def accept(self, frame: Frame) -> None:
        """Apply an accepted frame's effect to the model."""
        frame.outcome = "accepted"
        event = frame.event
        r = self.model.current
        if isinstance(event, ResponseCreate):
            self.expected_creates += 1
            self.accepted_create = frame
        elif isinstance(event, ResponseCancel) and r is not None:
            r.cancel_frame = frame.number
            frame.unconfirmed_in = r.id
        elif isinstance(event, ResponseAppend) and r is not None:
            frame.unconfirmed_in = r.id
            for item in event.input:
                if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                    r.answer(item.call_id)
            if not r.pending:
                r.phase = "resuming"
        self.state_changed()

    def append_fits(self, frame: Frame) -> bool:
        """An append in doubt that the server, as it is now, would accept."""
        if not (isinstance(frame.event, ResponseAppend) and frame.can_accept):
            return False
        accept, codes = answers(frame.event, self.view(), self.dialect)
        return accept and not codes - RESUME_ERRORS

    def confirm(self, before: int) -> None:
        """Frames are served in order: an answer to frame N settles every prediction before it."""
        for frame in self.frames[:before]:
            frame.unconfirmed_in = None

    def state_changed(self) -> None:
        """Widen every unanswered frame's legal answers by what the new state allows."""
        view = self.view()
        for frame in self.unanswered():
            if frame.wild or frame.event is None:
                continue
            accept, codes = answers(frame.event, view, self.dialect)
            frame.can_accept |= accept
            frame.codes |= codes

    def view(self) -> View:
        """The server's state as a frame sent now would find it."""
        r = self.model.current
        if r is None or r.terminal:
            return View("streaming" if self.expected_creates else "none")
        if r.cancel_frame is not None:
            phase = "ending"
        elif r.phase == "suspended":
            phase = "suspended"
        else:
            phase = "streaming"
        return View(phase, frozenset(r.pending), frozenset(r.answered))

    # -- what a Response's events say of the frames ----------------------------------------------

    def created(self) -> Frame | None:
        """A Response was created for a create: the one predicted accepted (None where the
        prediction was not a frame's own), or else the oldest that may be."""
        if self.expected_creates:
            self.expected_creates -= 1
            return self.accepted_create
        frame = self.first(lambda f: f.kind == "response.create" and f.can_accept)
        if frame is None:
            raise Broken(7, "a Response was created that no response.create asked for")
        frame.outcome = "accepted"
        return frame

    def cancelled(self, cancel_frame: int | None) -> None:
        """A Response was cancelled: by the cancel accepted before, or the oldest that may be."""
        if cancel_frame is not None:
            asked = self.frames[cancel_frame]
        else:
            found = self.first(self._may_cancel) or self._cancel_taken_as_refused()
            if found is None:
                raise Broken(7, "a Response was cancelled that no response.cancel asked for")
            asked = found
            asked.outcome = "accepted"
        self.confirm(asked.number + 1)

    def _cancel_taken_as_refused(self) -> Frame | None:
        """A cancel whose acceptance says nothing until the Response ends: an error that a
        later frame earned (an append refused `no_open_response` while the cancel ends the
        Response) was matched to it, the oldest that might have earned that code. The cancel
        took effect after all, and that later frame was the one refused."""
        for frame in self.frames:
            code = frame.refused_with
            if frame.kind != "response.cancel" or frame.outcome != "refused" or code is None:
                continue
            later = next((f for f in self.unanswered() if f.number > frame.number
                          and code in f.codes), None)  # fmt: skip
            if later is not None and frame.can_accept:
                later.outcome, later.refused_with = "refused", code
                frame.refused_with = None
                return frame
        return None

    def unstored(self, cancel_frame: int | None) -> None:
        """A Response failed because the store could not take its end: a cancel accepted
        before took effect; one still unanswered may have (or may yet be refused)."""
        if cancel_frame is not None:
            self.cancelled(cancel_frame)
            return
        found = self.first(self._may_cancel)
        if found is not None:
            found.silent = True

    @staticmethod
    def _may_cancel(frame: Frame) -> bool:
        return frame.kind == "response.cancel" and frame.can_accept and not frame.silent

    def ended(self, response_id: str) -> None:
        """Frames predicted accepted by a Response that ended before any event confirmed them:
        the server may have refused them as arriving too late."""
        for frame in self.frames:
            if frame.unconfirmed_in == response_id:
                frame.unconfirmed_in = None
                frame.outcome = None
                frame.can_accept = True
                frame.codes.add("no_open_response")

    # -- answers that are events of their own ----------------------------------------------------

    def error(self, obj: Mapping[str, Any]) -> None:
        """An `error`: unsolicited, or the refusal of the oldest frame that may earn its code."""
        detail = obj.get("error")
        if not isinstance(detail, Mapping) or not error_detail_ok(detail):
            raise Broken(7, "an error event without error {type, code, message}")
        code = detail["code"]
        if code in self.unsolicited_errors:
            return
        # a frame whose effect may have been silent is the last to be taken as refused
        frame = self.first(lambda f: code in f.codes and not f.silent)
        frame = frame or self.first(lambda f: code in f.codes)
        if frame is None:
            waiting = "; ".join(
                f"{f.describe()} may earn {sorted(f.codes) or 'no error'}"
                for f in self.unanswered()
            )
            raise Broken(7, f"error {code!r} answers no frame ({waiting or 'none is unanswered'})")
        frame.outcome = "refused"
        frame.refused_with = code
        self.confirm(frame.number)
        current = self.model.current
        if code == "no_open_response" and current is not None and not current.terminal:
            current.told_ended = frame.number  # then its terminal event must come next

    def queued(self, obj: Mapping[str, Any]) -> None:
        """A create waits its turn: the Response it will be, announced with its id."""
        response = response_object(obj)
        rid = response.get("id")
        known = {f.queued_as for f in self.frames}
        if not isinstance(rid, str) or rid in self.model.by_id or rid in known:
            raise Broken(2, f"response.queued for an id that is missing or not new: {rid!r}")
        if response.get("status") != "queued":
            raise Broken(2, f"response.queued carries status {response.get('status')!r}")
        waiting = [f for f in self.unanswered() if f.kind == "response.create" and f.can_accept]
        current = self.model.current
        if waiting and (current is None or current.terminal):
            waiting = waiting[1:]  # the oldest is being served: it waits behind no one
        frame = next((f for f in waiting if f.queued_as is None), None)
        if frame is None:
            raise Broken(7, "a Response was queued that no waiting response.create asked for")
        frame.queued_as = rid

    def inject_created(self, obj: Mapping[str, Any]) -> None:
        """An inject was committed: its outputs answer calls its Response waits on."""
        frame = self._inject_frame(obj)
        r = self.model.by_id.get(obj["response_id"])
        if r is None or r.terminal:
            raise Broken(7, f"response.inject.created for a Response not active on this lane: {r}")
        assert isinstance(frame.event, ResponseInject)
        for item in frame.event.input:
            call_id = getattr(item, "call_id", None)
            if call_id not in r.pending:
                raise Broken(
                    5, f"an inject committed an output for {call_id!r}, which no call awaits"
                )
            r.answer(call_id)
        frame.outcome = "accepted"
        self.confirm(frame.number)
        if r.phase == "streaming":
            r.injected = True
        if r.phase == "suspended" and not r.pending:
            r.phase = "resuming"
        self.state_changed()

    def inject_failed(self, obj: Mapping[str, Any]) -> None:
        """An inject was refused: its input comes back as sent."""
        frame = self._inject_frame(obj)
        error = obj.get("error")
        code = error.get("code") if isinstance(error, Mapping) else None
        if code not in ("response_not_found", "response_already_completed"):
            raise Broken(7, f"response.inject.failed with code {code!r}")
        r = self.model.by_id.get(obj["response_id"])
        if code == "response_not_found" and r is not None:
            raise Broken(7, f"Response {r.id} of this lane was said not to exist")
        if list(obj.get("input") or ()) != list(frame.raw.get("input", ())):
            raise Broken(7, "response.inject.failed did not return the input as it was sent")
        frame.outcome = "refused"
        self.confirm(frame.number)

    def steer_accepted(self, obj: Mapping[str, Any]) -> None:
        """A steer was accepted for a Response that is active, or completed awaiting output."""
        frame = self._steer_frame(obj)
        steer_id, rid = obj["steer"]["id"], obj["steer"]["previous_response_id"]
        r = self.model.by_id.get(rid)
        waiting = r is not None and r.phase == "completed" and bool(r.pending)
        if r is None or (r.terminal and not waiting):
            raise Broken(7, f"a steer was accepted for {rid!r}, not active on this lane")
        if steer_id in self.steers:
            raise Broken(7, f"steer id {steer_id!r} was given twice")
        frame.outcome = "accepted"
        self.steers[steer_id] = Steer(rid, frame.number)

    def steer_pending(self, obj: Mapping[str, Any]) -> None:
        """An accepted steer waits for the outputs its Response waits on, and names them."""
        steer = self.steers.get(obj["steer"]["id"])
        if steer is None or steer.state != "queued" or steer.told_pending:
            raise Broken(7, f"response.steer.pending for a steer not waiting: {obj['steer']['id']}")
        steer.told_pending = True
        r = self.model.by_id[steer.response_id]
        if not r.pending or r.phase not in ("suspended", "completed"):
            raise Broken(7, f"a steer is pending while Response {r.id} waits on no call")
        required = {stub.get("call_id") for stub in obj["required_input"]}
        if not required or not required <= set(r.pending):
            raise Broken(7, f"required_input {sorted(map(str, required))} are not awaited calls")

    def steer_failed(self, obj: Mapping[str, Any]) -> None:
        """A steer comes back, its input as sent: refused now, or accepted and not committed."""
        error, returned = obj["error"], obj["steer"]
        if error.get("code") not in STEER_CODES:
            raise Broken(7, f"response.steer.failed with code {error.get('code')!r}")
        steer_id = returned.get("id")
        if steer_id is not None:  # accepted before: it comes back now, not committed
            steer = self.steers.get(steer_id)
            if steer is None or steer.state != "queued":
                raise Broken(7, f"steer {steer_id!r} failed, but it was not waiting")
            steer.state = "failed"
            raw = self.frames[steer.frame].raw
        else:
            frame = self._steer_frame(obj)
            frame.outcome = "refused"
            raw = frame.raw
            rid = returned["previous_response_id"]
            if error["code"] == "response_not_found" and rid in self.model.by_id:
                raise Broken(7, f"Response {rid} of this lane was said not to exist")
        if returned.get("input") != raw.get("input"):
            raise Broken(7, "response.steer.failed did not return the input as it was sent")

    def queued_steers(self, response_id: str) -> list[Steer]:
        """The accepted steers of a Response, neither committed nor returned yet."""
        return [
            s for s in self.steers.values() if s.response_id == response_id and s.state == "queued"
        ]

    def commit_steers(self, response_id: str) -> None:
        for steer in self.queued_steers(response_id):
            steer.state = "committed"

    def _steer_frame(self, obj: Mapping[str, Any]) -> Frame:
        steer = obj.get("steer")
        rid = steer.get("previous_response_id") if isinstance(steer, Mapping) else None
        frame = self.first(
            lambda f: isinstance(f.event, ResponseSteer) and f.event.previous_response_id == rid
        )
        if frame is None:
            raise Broken(7, f"{obj.get('type')} for {rid!r} answers no response.steer")
        return frame

    def _inject_frame(self, obj: Mapping[str, Any]) -> Frame:
        rid = obj.get("response_id")
        frame = self.first(
            lambda f: isinstance(f.event, ResponseInject) and f.event.response_id == rid
        )
        if frame is None:
            raise Broken(7, f"{obj.get('type')} for {rid!r} answers no response.inject")
        return frame

    # -- the end ---------------------------------------------------------------------------------

    def finish(self, *, waiting: bool) -> None:
        """The client is done: every accepted frame had its effect, and every other frame its
        error. `waiting`: the current Response waits silently on its calls, and a create may
        wait behind it."""
        if self.expected_creates:
            raise Broken(7, f"{self.expected_creates} accepted response.create got no Response")
        for steer_id, steer in self.steers.items():
            if steer.state == "queued" and not self._may_wait(steer):
                raise Broken(7, f"steer {steer_id} was accepted but neither applied nor returned")
        if self.successor_of is not None:
            raise Broken(7, f"Response {self.successor_of} was steered but no successor came")
        current = self.model.current
        if current is not None and current.cancel_frame is not None:
            raise Broken(7, f"response.cancel was accepted but Response {current.id} never ended")
        for frame in self.unanswered():
            if frame.kind == "response.append" and frame.can_accept:
                continue  # accepted before the Response ended: its effect was silent
            if frame.silent:
                continue  # its Response ended, failing only because it could not be stored
            if waiting and frame.kind == "response.create" and frame.can_accept:
                continue  # it waits behind the waiting Response, as long as that waits
            wanted = " or ".join(sorted(frame.codes)) or "an error"
            raise Broken(7, f"{frame.describe()} got neither its effect nor an error ({wanted})")

    def _may_wait(self, steer: Steer) -> bool:
        """A steer may still wait at the end: for the outputs its Response waits on."""
        r = self.model.by_id.get(steer.response_id)
        return r is not None and bool(r.pending) and r.phase in ("suspended", "completed")
