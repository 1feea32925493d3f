"""Merging deltas: when a client reads slower than the model writes, send fewer, larger deltas.

Frames, not bytes, are what a WebSocket or an SSE stream pays for, so when a connection's writer
falls behind, consecutive pending deltas of the same item become one delta with the same text
(DESIGN.md, "Backpressure"). A client that concatenates deltas, as every client must, sees the
same text (and the same logprobs, where it asked for them); it just gets it in fewer pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from proto_server.wire.events import FunctionCallArgumentsDelta, OutputTextDelta, ServerEvent

MERGEABLE = (OutputTextDelta, FunctionCallArgumentsDelta)


def continues(first: ServerEvent, second: ServerEvent) -> bool:
    """Whether delta `second` goes on with the text of delta `first` (the same item and part)."""
    match first, second:
        case OutputTextDelta(), OutputTextDelta():
            return (first.item_id, first.output_index, first.content_index) == (
                second.item_id,
                second.output_index,
                second.content_index,
            )
        case FunctionCallArgumentsDelta(), FunctionCallArgumentsDelta():
            return (first.item_id, first.output_index) == (second.item_id, second.output_index)
    return False


def merge_run(first: ServerEvent, rest: Sequence[ServerEvent]) -> ServerEvent:
    """One delta carrying `first`'s text then each of `rest`'s, all of which `continue` it:
    built once for the whole run (a merge per pair would copy the text again each time)."""
    if not rest:
        return first
    assert isinstance(first, MERGEABLE)
    texts = [first.delta]
    for event in rest:
        assert isinstance(event, MERGEABLE)
        texts.append(event.delta)
    if isinstance(first, OutputTextDelta):  # and each token's logprobs, in order, if asked
        logprobs = [
            entry for event in (first, *rest) if isinstance(event, OutputTextDelta)
            for entry in event.logprobs
        ]  # fmt: skip
        return attrs.evolve(first, delta="".join(texts), logprobs=tuple(logprobs))
    return attrs.evolve(first, delta="".join(texts))


def merge_deltas(first: ServerEvent, second: ServerEvent) -> ServerEvent | None:
    """One delta carrying `first`'s text then `second`'s, or None if they do not continue."""
    return merge_run(first, [second]) if continues(first, second) else None
