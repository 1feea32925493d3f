"""Hooks for whoever measures the server (the benchmark, a tracer).

`Responses.observer` is None unless something measures; then each hook costs the server one
attribute check. The hooks say when a request has arrived, when the generator starts (what the
server does before inference is over), what the segment's prompt cost, and when each event left.
"""

from __future__ import annotations

from typing import Protocol

from proto_server.wire.events import ServerEvent


class ServerObserver(Protocol):
    def received(self) -> None:
        """A client frame, or an HTTP request's body, has fully arrived."""

    def decoded(self) -> None:
        """It is decoded and validated into an event."""

    def rendered(self) -> None:
        """The conversation holds the request's items, rendered (state rebuilt or extended)."""

    def generating(self) -> None:
        """The generator starts a segment: the server's work before inference is done."""

    def prefilled(self, *, rendered: int, prompt: int, cached: int) -> None:
        """The segment's prompt is in the model: `rendered` tokens were rendered for it since the
        last segment, `cached` of its `prompt` tokens were already warm."""

    def sent(self, event: ServerEvent, merged: int) -> None:
        """`event`, merged from `merged` pending events, was written to the client's socket."""
