"""How a rollout shows in a notebook: event tables, the pending calls, where the time went.

Times are the client's (trio clock), in milliseconds from the segment's send. GPU time is
*modelled* (the simulated generator's timing model), never measured, and labelled so.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING, Protocol

import attrs

from proto_server.client.state import Received, RolloutState, Segment
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

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from proto_server.client.rollout import Rollout

#: Rows shown of a long segment: its head and its tail, the middle summarised.
HEAD_ROWS = 24
TAIL_ROWS = 8
TEXT_CHARS = 80

_STYLE = (
    "<style>.proto-rollout td,.proto-rollout th{text-align:left;padding:1px 8px;"
    "font-family:monospace;font-size:12px}.proto-rollout .badge{padding:1px 6px;"
    "border-radius:4px;color:white}</style>"
)
_COLOURS = {
    "streaming": "#1f77b4",
    "suspended": "#ff7f0e",
    "completed": "#2ca02c",
    "failed": "#d62728",
    "incomplete": "#9467bd",
    "cancelled": "#7f7f7f",
}


def _ms(seconds: float | None) -> str:
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
            f"<tr><td>{seq}</td><td>{_ms(row.at - since)}</td>"
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
        f"sent {segment.sent_bytes} B · first event {_ms(segment.time_to_first_event)} · "
        f"to the end {_ms(segment.time_to_end)} · {segment.output_tokens} tokens out"
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
        f"{_STYLE}<div class='proto-rollout'><p>{_segment_summary(segment)}</p>"
        f"{events_html(segment.events, since=segment.sent_at)}"
        f"{calls_html(calls, 'Calls the model made') if suspended else ''}</div>"
    )


def rollout_html(rollout: Rollout) -> str:
    state = rollout.state
    badge = f"<span class='badge' style='background:{_COLOURS[state.value]}'>{state.value}</span>"
    usage = rollout.response.usage if rollout.response is not None else None
    ids = ", ".join(rollout.tracker.response_ids) or "none yet"
    rows = "".join(
        f"<tr><td>{s.index}</td><td>{s.request}</td><td>{escape(s.end or '…')}</td>"
        f"<td>{len(s.events)}</td><td>{s.sent_bytes}</td><td>{s.received_bytes}</td>"
        f"<td>{_ms(s.time_to_first_event)}</td><td>{_ms(s.time_to_end)}</td>"
        f"<td>{s.input_tokens}</td><td>{s.cached_tokens}</td><td>{s.output_tokens}</td></tr>"
        for s in rollout.segments
    )
    table = (
        "<table><tr><th>segment</th><th>request</th><th>ended by</th><th>events</th>"
        "<th>sent B</th><th>received B</th><th>first event</th><th>to the end</th>"
        f"<th>input tok</th><th>cached tok</th><th>output tok</th></tr>{rows}</table>"
    )
    error = rollout.tracker.error
    return (
        f"{_STYLE}<div class='proto-rollout'><p>{rollout.dialect} rollout {badge} · "
        f"response {escape(ids)}"
        + (
            f" · usage: {usage.input_tokens} in ({usage.input_tokens_details.cached_tokens} "
            f"cached), {usage.output_tokens} out"
            if usage is not None
            else ""
        )
        + "</p>"
        + table
        + (calls_html(rollout.pending_calls) if state is RolloutState.SUSPENDED else "")
        + (
            f"<p><b>error</b> {escape(error.code)}: {escape(error.message)}</p>"
            if error is not None
            else ""
        )
        + "</div>"
    )


class ModelledTime(Protocol):
    """What a chart needs of a timing model: the GPU time it charges a segment (the simulated
    generator's `TimingModel` is one)."""

    def segment_seconds(self, *, uncached_tokens: int, output_tokens: int) -> float: ...


@attrs.frozen
class SegmentTime:
    """Where one segment's time went, in seconds."""

    client: float  # before the send: the client running tools (measured)
    gpu: float | None  # the simulated GPU (modelled; None without the timing model)
    server: float  # the rest of the segment: server and wire (measured minus modelled)


def time_split(segments: Sequence[Segment], timing: ModelledTime | None) -> list[SegmentTime]:
    split = []
    for segment in segments:
        total = segment.time_to_end or 0.0
        gpu = None
        if timing is not None:
            gpu = timing.segment_seconds(
                uncached_tokens=segment.reprocessed_tokens, output_tokens=segment.output_tokens
            )
        server = max(total - (gpu or 0.0), 0.0)
        split.append(SegmentTime(client=segment.client_time or 0.0, gpu=gpu, server=server))
    return split


@attrs.frozen
class Chart:
    """A matplotlib figure that shows itself in a notebook, with or without pyplot."""

    figure: Figure

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


def timing_chart(
    segments: Sequence[Segment], timing: ModelledTime | None = None, *, title: str = ""
) -> Chart:
    """A horizontal bar per segment: client time, modelled GPU time, server and wire time."""
    from matplotlib.figure import Figure

    split = time_split(segments, timing)
    figure = Figure(figsize=(8, 1.2 + 0.4 * max(len(split), 1)), layout="constrained")
    axes = figure.add_subplot()
    labels = [f"segment {segment.index}" for segment in segments]
    left = [0.0] * len(split)
    bars = [("client (measured)", [t.client for t in split], "#7f7f7f")]
    if timing is not None:
        bars.append(("GPU (modelled)", [t.gpu or 0.0 for t in split], "#ff7f0e"))
        server = [t.server for t in split]
        bars.append(("server + wire (measured minus modelled GPU)", server, "#1f77b4"))
    else:
        bars.append(("server + wire + GPU (measured)", [t.server for t in split], "#1f77b4"))
    for label, seconds, colour in bars:
        widths = [s * 1000 for s in seconds]
        axes.barh(labels, widths, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds")
    axes.set_title(title or "Where each segment's time went")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=3, fontsize="small")
    return Chart(figure)
