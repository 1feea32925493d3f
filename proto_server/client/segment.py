"""One segment as the client saw it: what it sent, what came back, and its table in a notebook.

A *segment* is everything the server streams in answer to one client send (a create, or the
append that resumes the rollout) up to the next suspension or the end (state.py keeps them).
A segment shows itself in a notebook (`_repr_html_`): its table is here, with it, so that the
record needs nothing of display.py, which draws whole rollouts from these records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import attrs

from proto_server.wire.events import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ServerEvent,
)
from proto_server.wire.items import CustomToolCall, FunctionCall, Item, Message, ToolCall


@attrs.frozen
class Sent:
    """One client event (WebSocket) or request body (HTTP) as sent: when, and how many bytes."""

    body: Mapping[str, Any]
    at: float
    size: int


@attrs.frozen
class Received:
    """One server event as the client saw it: when (trio clock, seconds) and how many bytes."""

    sequence_number: int | None  # None for an HTTP error body, which has none
    event: ServerEvent
    at: float
    size: int


@attrs.define
class Segment:
    """One client send and what came back, with the client-side timings."""

    index: int
    request: str  # "start" (the create) or "resume" (what answered the calls)
    sent_at: float
    sent_bytes: int
    #: When the previous segment ended (None for the first): the gap is the client's own time.
    previous_end: float | None = None
    events: list[Received] = attrs.field(factory=list)
    ended_at: float | None = None
    response_id: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def end(self) -> str | None:
        """The type of the event that ended the segment, once it has ended."""
        return self.events[-1].event.type if self.ended_at is not None else None

    @property
    def time_to_first_event(self) -> float | None:
        return self.events[0].at - self.sent_at if self.events else None

    @property
    def time_to_end(self) -> float | None:
        """Send to suspension (or to the end of the rollout)."""
        return None if self.ended_at is None else self.ended_at - self.sent_at

    @property
    def client_time(self) -> float | None:
        """What the client spent between the previous suspension and this send (running tools)."""
        return None if self.previous_end is None else self.sent_at - self.previous_end

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the time from the first event to the end, as the client saw it."""
        if self.ended_at is None or not self.events:
            return None
        seconds = self.ended_at - self.events[0].at
        return self.output_tokens / seconds if seconds > 0 else None

    @property
    def received_bytes(self) -> int:
        return sum(received.size for received in self.events)

    @property
    def reprocessed_tokens(self) -> int:
        """Prompt tokens the model had to process again: input not served from a warm cache."""
        return self.input_tokens - self.cached_tokens

    def _repr_html_(self) -> str:
        return segment_html(self)


#: Rows shown of a long segment: its head and its tail, the middle summarised.
HEAD_ROWS = 24
TAIL_ROWS = 8
TEXT_CHARS = 80

STYLE = (
    "<style>.proto-rollout td,.proto-rollout th{text-align:left;padding:1px 8px;"
    "font-family:monospace;font-size:12px}.proto-rollout .badge{padding:1px 6px;"
    "border-radius:4px;color:white}</style>"
)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _short(text: str) -> str:
    text = text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"
    return escape(repr(text)[1:-1])


def _item_label(item: Item) -> str:
    match item:
        case FunctionCall(name=name, call_id=call_id) | CustomToolCall(name=name, call_id=call_id):
            return f"{item.type} {name} {call_id}"
        case Message(role=role, id=item_id):
            return f"message {role} {item_id or ''}"
    return item.type


def _describe(event: ServerEvent) -> tuple[str, str]:
    """(item, text) columns of one event."""
    match event:
        case (
            OutputItemAdded(output_index=index, item=item)
            | OutputItemDone(output_index=index, item=item)
        ):
            text = item.arguments if isinstance(item, FunctionCall) else ""
            return f"#{index} {_item_label(item)}", text
        case (
            OutputTextDelta(output_index=index, delta=text)
            | ReasoningTextDelta(output_index=index, delta=text)
            | FunctionCallArgumentsDelta(output_index=index, delta=text)
        ):
            return f"#{index}", text
        case (
            OutputTextDone(output_index=index, text=text)
            | ReasoningTextDone(output_index=index, text=text)
        ):
            return f"#{index}", text
        case FunctionCallArgumentsDone(output_index=index, name=name, arguments=text):
            return f"#{index} {name}", text
        case ContentPartAdded(output_index=index) | ContentPartDone(output_index=index):
            return f"#{index}", ""
        case ErrorEvent(error=error):
            return error.code, error.message
    response = getattr(event, "response", None)
    if response is not None:
        return response.id, f"status {response.status}"
    return "", ""


def events_html(received: Sequence[Received], *, since: float) -> str:
    """A table of events: sequence number, time since `since`, type, item, text, bytes."""
    rows = list(received)
    hidden = 0
    if len(rows) > HEAD_ROWS + TAIL_ROWS:
        hidden = len(rows) - HEAD_ROWS - TAIL_ROWS
        rows = rows[:HEAD_ROWS] + rows[-TAIL_ROWS:]
    body = []
    for position, row in enumerate(rows):
        if hidden and position == HEAD_ROWS:
            body.append(f"<tr><td colspan=6>… {hidden} more events …</td></tr>")
        item, text = _describe(row.event)
        seq = "" if row.sequence_number is None else str(row.sequence_number)
        body.append(
            f"<tr><td>{seq}</td><td>{ms(row.at - since)}</td>"
            f"<td>{escape(row.event.type.removeprefix('response.'))}</td>"
            f"<td>{escape(item)}</td><td>{_short(text)}</td><td>{row.size}</td></tr>"
        )
    head = "<tr><th>seq</th><th>t</th><th>type</th><th>item</th><th>text</th><th>bytes</th></tr>"
    return f"<table>{head}{''.join(body)}</table>"


def calls_html(calls: Sequence[ToolCall], title: str = "Pending calls") -> str:
    """The calls awaiting output: what the client must run and append."""
    if not calls:
        return ""
    rows = "".join(
        f"<tr><td>{escape(call.call_id)}</td><td>{escape(call.name)}</td>"
        f"<td>{escape(call.arguments if isinstance(call, FunctionCall) else call.input)}</td></tr>"
        for call in calls
    )
    return (
        f"<p><b>{escape(title)}</b></p><table><tr><th>call_id</th><th>name</th>"
        f"<th>arguments</th></tr>{rows}</table>"
    )


def _segment_summary(segment: Segment) -> str:
    rate = segment.tokens_per_s
    return (
        f"segment {segment.index} ({segment.request}) · ended by "
        f"<code>{escape(segment.end or 'nothing yet')}</code> · {len(segment.events)} events · "
        f"sent {segment.sent_bytes} B · first event {ms(segment.time_to_first_event)} · "
        f"to the end {ms(segment.time_to_end)} · {segment.output_tokens} tokens out"
        + (f" ({rate:,.0f}/s seen)" if rate is not None else "")
    )


def segment_html(segment: Segment) -> str:
    calls = [
        received.event.item
        for received in segment.events
        if isinstance(received.event, OutputItemDone)
        and isinstance(received.event.item, FunctionCall | CustomToolCall)
    ]
    suspended = segment.end in ("response.done", "response.completed") and calls
    return (
        f"{STYLE}<div class='proto-rollout'><p>{_segment_summary(segment)}</p>"
        f"{events_html(segment.events, since=segment.sent_at)}"
        f"{calls_html(calls, 'Calls the model made') if suspended else ''}</div>"
    )
