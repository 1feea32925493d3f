"""What a client frame may earn: the codes of each kind of answer, the state of the server a
frame met (`View`), the one code the prototype dialect gives a frame in a state (`judge`), and
whether a frame may be accepted and which codes it may earn in a state (`answers`) or in any
(`possible`). The ledger (ledger.py) keeps each frame's possible answers with these."""

from __future__ import annotations

import attrs

from proto_server.core.request import check_create, input_items, is_warmup
from proto_server.core.tool_choice import parse_tool_choice
from proto_server.testing.checker.invariants import Dialect
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

#: The `error` codes an append that names its Response (`response_id`) may earn as well: the
#: store decides whether a Response suspended on another connection can be resumed here, and
#: its history, rebuilt, and the append must fit this connection's and the process's memory.
RESUME_ERRORS = frozenset(
    {"response_not_found", "response_already_completed", "response_already_resumed",
     "store_unavailable", "connection_memory_limit", "server_busy"}
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
        # this server's own: a steer that does not fit a memory budget gets its code
        "connection_memory_limit",
        "server_busy",
    }
)


@attrs.frozen
class View:
    """What the server's state looked like to a frame: enough to know how it must answer."""

    phase: str  # none | streaming | suspended | ending
    pending: frozenset[str] = frozenset()
    answered: frozenset[str] = frozenset()


def judge(event: ClientEvent, view: View) -> str | None:
    """The prototype dialect: the one error code `event` earns in `view`, or None."""
    if isinstance(event, ResponseCreate):
        if view.phase != "none":
            return "concurrent_request"
        if event.previous_response_id is not None or is_warmup(event):
            return "invalid_field"
        if event.context_management:
            return "invalid_field"
        # `background` is refused on a WebSocket (as OpenAI's is), served over HTTP (the
        # ledger of an SSE stream drops it)
        return "invalid_field" if event.background else refusal(event)
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


def forces_a_call(event: ClientEvent) -> bool:
    """A create whose tool_choice forces a call: a server whose model cannot force one (a local
    model without a fast tokenizer, which llguidance needs) refuses it with
    `unsupported_tool_choice`, another serves it."""
    return (
        isinstance(event, ResponseCreate)
        and refusal(event) is None
        and (parse_tool_choice(event.tool_choice).mode == "required")
    )


def carries_compaction(event: ClientEvent) -> bool:
    """A create with a compaction item: only the server that sealed it can tell whether it is
    genuine, and refuses it (`invalid_field`) if not."""
    return isinstance(event, ResponseCreate) and any(
        isinstance(item, UnknownItem) and item.type == "compaction" for item in input_items(event)
    )


def refusal(create: ResponseCreate) -> str | None:
    """The code of the error a create earns beyond its decoding (`check_create`, as the server
    runs it), or None."""
    try:
        check_create(create)
    except ProtocolError as exc:
        return exc.detail.code
    return None


def possible(event: ClientEvent, dialect: Dialect) -> tuple[bool, frozenset[str]]:
    """Every answer `event` could earn in some state of the connection: for a frame sent
    while an earlier frame's effect is unknown."""
    mentioned = frozenset(
        item.call_id
        for item in (event.input if isinstance(event, ResponseAppend) else ())
        if isinstance(item, FunctionCallOutput | CustomToolCallOutput)
    )
    views = [
        View("none"),
        View("streaming"),
        View("ending"),
        View("suspended", pending=mentioned),
        View("suspended", pending=mentioned | {"call_elsewhere"}),
        View("suspended", answered=mentioned),
        View("suspended"),
    ]
    accept, codes = False, frozenset[str]()
    for view in views:
        may_accept, may_earn = answers(event, view, dialect)
        accept, codes = accept or may_accept, codes | may_earn
    return accept, codes


def answers(event: ClientEvent, view: View, dialect: Dialect) -> tuple[bool, frozenset[str]]:
    """Whether `event` may be accepted in `view`, and the error codes it may earn there."""
    if isinstance(event, ResponseSteer):
        return False, frozenset()  # answered by its own events (the ledger's `sent`)
    if isinstance(event, ResponseInject):
        return True, INJECT_ERRORS  # its effect is its own event: inject.created or .failed
    if dialect == "prototype":
        code = judge(event, view)
        codes = {code} if code else set()
        if isinstance(event, ResponseAppend) and event.response_id is not None:
            if view.phase in ("none", "suspended"):
                codes |= RESUME_ERRORS  # resumed from the store, or not
            if view.phase == "none":
                codes.discard("no_open_response")  # it names one: the store is asked
        if view.phase == "streaming" and not isinstance(event, ResponseCreate):
            codes.add("no_open_response")  # it may have ended, its terminal event not out yet
        if code is None and forces_a_call(event):
            codes.add("unsupported_tool_choice")
        if code is None and carries_compaction(event):
            codes.add("invalid_field")
        return code is None, frozenset(codes)
    if isinstance(event, ResponseCreate):
        refused = refusal(event)
        if event.background or refused:
            return False, frozenset({refused or "invalid_field"})
        # served when its turn comes: its chain may be gone, the queue may be full
        codes = {"concurrent_request"}
        if forces_a_call(event):
            codes.add("unsupported_tool_choice")
        if event.previous_response_id is not None:
            # the chain may be gone, another key's, or the store unable to answer
            codes |= {"previous_response_not_found", "store_unavailable"}
        if carries_compaction(event):
            codes.add("invalid_field")
        return True, frozenset(codes)
    if isinstance(event, ResponseAppend):
        return False, frozenset({"unknown_event_type"})
    return view.phase != "none", frozenset({"no_open_response"})
