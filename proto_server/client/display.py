"""How a rollout shows in a notebook: its segments, the pending calls, where the time went.

A segment's own table is segment.py's. Times are the client's (trio clock), in milliseconds
from the segment's send. GPU time is *modelled* (the simulated generator's timing model),
never measured, and labelled so.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING, Protocol

import attrs

from proto_server.client.segment import STYLE, Segment, calls_html, ms
from proto_server.client.state import RolloutState, RolloutTracker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_COLOURS = {
    "streaming": "#1f77b4",
    "suspended": "#ff7f0e",
    "completed": "#2ca02c",
    "failed": "#d62728",
    "incomplete": "#9467bd",
    "cancelled": "#7f7f7f",
}


def rollout_html(rollout: RolloutTracker) -> str:
    """The rollout's table: a row per segment, its usage, its pending calls or its error."""
    state = rollout.state
    badge = f"<span class='badge' style='background:{_COLOURS[state.value]}'>{state.value}</span>"
    usage = rollout.response.usage if rollout.response is not None else None
    ids = ", ".join(rollout.response_ids) or "none yet"
    rows = "".join(
        f"<tr><td>{s.index}</td><td>{s.request}</td><td>{escape(s.end or '…')}</td>"
        f"<td>{len(s.events)}</td><td>{s.sent_bytes}</td><td>{s.received_bytes}</td>"
        f"<td>{ms(s.time_to_first_event)}</td><td>{ms(s.time_to_end)}</td>"
        f"<td>{s.input_tokens}</td><td>{s.cached_tokens}</td><td>{s.output_tokens}</td></tr>"
        for s in rollout.segments
    )
    table = (
        "<table><tr><th>segment</th><th>request</th><th>ended by</th><th>events</th>"
        "<th>sent B</th><th>received B</th><th>first event</th><th>to the end</th>"
        f"<th>input tok</th><th>cached tok</th><th>output tok</th></tr>{rows}</table>"
    )
    error, pending = rollout.error, list(rollout.pending_calls.values())
    return (
        f"{STYLE}<div class='proto-rollout'><p>{rollout.dialect} rollout {badge} · "
        f"response {escape(ids)}"
        + (
            f" · usage: {usage.input_tokens} in ({usage.input_tokens_details.cached_tokens} "
            f"cached), {usage.output_tokens} out"
            if usage is not None
            else ""
        )
        + "</p>"
        + table
        + (calls_html(pending) if state is RolloutState.SUSPENDED else "")
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
