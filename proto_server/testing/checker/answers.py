"""What a client frame may earn: the codes of each kind of answer, the state of the server a
frame met (`View`), and the one code the prototype dialect gives a frame in a state (`judge`).
The ledger (ledger.py) keeps each frame's possible answers with these."""

from __future__ import annotations

import attrs

from proto_server.core.request import check_create, input_items, is_warmup
from proto_server.core.tool_choice import parse_tool_choice
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ClientEvent, ResponseAppend, ResponseCancel, ResponseCreate
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
