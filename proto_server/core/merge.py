"""Merging deltas: when a client reads slower than the model writes, send fewer, larger deltas.

Frames, not bytes, are what a WebSocket or an SSE stream pays for, so when a connection's writer
falls behind, consecutive pending deltas of the same item become one delta with the same text
(DESIGN.md, "Backpressure"). A client that concatenates deltas, as every client must, sees the
same text; it just gets it in fewer pieces.
"""

from __future__ import annotations

import attrs

from proto_server.wire.events import FunctionCallArgumentsDelta, OutputTextDelta, ServerEvent

MERGEABLE = (OutputTextDelta, FunctionCallArgumentsDelta)


def merge_deltas(first: ServerEvent, second: ServerEvent) -> ServerEvent | None:
    """One delta carrying `first`'s text then `second`'s, or None if they do not continue."""
    match first, second:
        case OutputTextDelta(), OutputTextDelta() if (
            (first.item_id, first.output_index, first.content_index)
            == (second.item_id, second.output_index, second.content_index)
            and not first.logprobs
            and not second.logprobs
        ):
            return attrs.evolve(first, delta=first.delta + second.delta)
        case FunctionCallArgumentsDelta(), FunctionCallArgumentsDelta() if (
            first.item_id,
            first.output_index,
        ) == (second.item_id, second.output_index):
            return attrs.evolve(first, delta=first.delta + second.delta)
    return None
