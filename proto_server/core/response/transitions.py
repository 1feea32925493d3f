"""Every status change of a Response, in one table (as h11 keeps its own): (status, event) to
the next status. The machine changes its status only through `move`; a pair the table lacks
is a move no Response makes, and `move` raises `IllegalTransition` without changing anything.

What a *client* may not do (cancel twice, append while streaming) the machine refuses first,
with the client's error (`ProtocolError`, `SteerRefused`), before it asks the table."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from proto_server.core.response.status import Status


class IllegalTransition(Exception):
    """The generator drove the machine somewhere it cannot go: a server bug, never the client's."""


class Event(enum.Enum):
    """What happens to a Response; each is named for the machine's method that makes it happen."""

    SUSPEND = "suspend"
    RESUME = "resume"
    COMPLETE = "complete"
    REQUEST_CANCEL = "request_cancel"
    REQUEST_EXPIRE = "request_expire"
    REQUEST_FAIL = "request_fail"
    FAIL = "fail"
    MAKE_INCOMPLETE = "make_incomplete"
    CANCEL = "cancel"
    FAIL_UNSTORED = "fail_unstored"


#: Who makes each event happen (`ResponseMachine`'s methods): the docs' table says it.
FIRED_BY: Mapping[Event, str] = {
    Event.SUSPEND: "`end_segment` on calls awaiting output (not `Mode.SUCCESSOR`)",
    Event.RESUME: "`append` / `inject` / `release_held` answering the last call",
    Event.COMPLETE: "`end_segment` with no call awaiting output, or `Mode.SUCCESSOR`",
    Event.REQUEST_CANCEL: "`request_cancel`: the client cancelled; said at a safe point",
    Event.REQUEST_EXPIRE: "`request_expire`: the server ends it `incomplete`",
    Event.REQUEST_FAIL: "`request_fail`: the generator failed",
    Event.FAIL: "`fail`, or `end` of a decided failure",
    Event.MAKE_INCOMPLETE: "`make_incomplete` (a limit, a successor steer), or `end` (expired)",
    Event.CANCEL: "`cancel` (the client's, at once), or `end` of a decided cancel",
    Event.FAIL_UNSTORED: "`fail_unstored`: the store could not take the end not yet said",
}

_S, _E = Status, Event

TABLE: Mapping[tuple[Status, Event], Status] = {
    (_S.IN_PROGRESS, _E.SUSPEND): _S.SUSPENDED,
    (_S.IN_PROGRESS, _E.COMPLETE): _S.COMPLETED,
    (_S.IN_PROGRESS, _E.REQUEST_CANCEL): _S.ENDING,
    (_S.IN_PROGRESS, _E.REQUEST_EXPIRE): _S.ENDING,
    (_S.IN_PROGRESS, _E.REQUEST_FAIL): _S.ENDING,
    (_S.IN_PROGRESS, _E.FAIL): _S.FAILED,
    (_S.IN_PROGRESS, _E.MAKE_INCOMPLETE): _S.INCOMPLETE,
    (_S.IN_PROGRESS, _E.CANCEL): _S.CANCELLED,
    (_S.SUSPENDED, _E.RESUME): _S.IN_PROGRESS,
    (_S.SUSPENDED, _E.REQUEST_CANCEL): _S.ENDING,
    (_S.SUSPENDED, _E.REQUEST_EXPIRE): _S.ENDING,
    (_S.SUSPENDED, _E.REQUEST_FAIL): _S.ENDING,
    (_S.SUSPENDED, _E.FAIL): _S.FAILED,
    (_S.SUSPENDED, _E.MAKE_INCOMPLETE): _S.INCOMPLETE,
    (_S.SUSPENDED, _E.CANCEL): _S.CANCELLED,
    # ending: decided, its terminal not said yet; only the ends it can say
    (_S.ENDING, _E.FAIL): _S.FAILED,
    (_S.ENDING, _E.MAKE_INCOMPLETE): _S.INCOMPLETE,
    (_S.ENDING, _E.CANCEL): _S.CANCELLED,
    # an ended `store: true` Response the store could not take fails instead, before any
    # client hears its end (a failed one keeps its own error)
    (_S.COMPLETED, _E.FAIL_UNSTORED): _S.FAILED,
    (_S.INCOMPLETE, _E.FAIL_UNSTORED): _S.FAILED,
    (_S.CANCELLED, _E.FAIL_UNSTORED): _S.FAILED,
}


def move(state: Status, event: Event) -> Status:
    """The status `event` takes a Response in `state` to; `IllegalTransition` if none."""
    try:
        return TABLE[state, event]
    except KeyError:
        raise IllegalTransition(f"{state.value} -> {event.value}: not a move") from None


def allowed(state: Status, event: Event) -> bool:
    return (state, event) in TABLE


#: Where each status may go as the Response lives: the table's moves less `fail_unstored`,
#: which rewrites an end that was not yet said rather than going on from it.
TRANSITIONS: Mapping[Status, frozenset[Status]] = {
    state: frozenset(
        to for (at, event), to in TABLE.items() if at is state and event is not Event.FAIL_UNSTORED
    )
    for state in Status
}


def table_markdown() -> str:
    """The table as docs/architecture.md shows it: an event per row, a status per column, the
    next status in each cell (`·`: not a move)."""
    head = ["event", "fired by", *(state.value for state in Status)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for event in Event:
        cells = [
            f"`{TABLE[state, event].value}`" if (state, event) in TABLE else "·" for state in Status
        ]
        lines.append("| " + " | ".join([f"`{event.value}`", FIRED_BY[event], *cells]) + " |")
    return "\n".join(lines) + "\n"
