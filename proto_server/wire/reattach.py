"""The client event that reattaches a Response whose connection dropped (the prototype
dialect's; docs/connection-drops.md), beside the events it continues (wire/events.py)."""

from __future__ import annotations

import attrs

from proto_server.wire.scalars import StreamId


@attrs.frozen(kw_only=True)
class ResponseReattach:
    """The prototype dialect's extension: attach a Response whose connection dropped
    mid-stream (kept for `--reattach-grace`) to this lane, replaying its events numbered
    above `starting_after` (-1: all it kept), then streaming the rest live."""

    type: str = "response.reattach"
    response_id: str
    starting_after: int = -1
    #: The lane to attach it to (None: the default lane); one that has carried no event yet.
    stream_id: StreamId | None = None
