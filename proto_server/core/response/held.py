"""Outputs injected (the multi-agent beta's `response.inject`) while the segment that made
their calls still streams: held, in order, until it suspends, then they join the conversation
after the calls, never among them (`ResponseMachine.release_held`)."""

from __future__ import annotations

from collections.abc import Sequence

from proto_server.core.conversation import TOKEN_BYTES, RenderedItems
from proto_server.wire.items import CustomToolCallOutput, FunctionCallOutput, Item

#: One inject: its items, and them rendered if the dialect rendered them off the event loop.
Batch = tuple[tuple[Item, ...], RenderedItems | None]


class Held:
    def __init__(self) -> None:
        self._batches: list[Batch] = []
        #: The calls the held outputs answer: answered already, for a later append or inject.
        self.ids: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def hold(self, items: Sequence[Item], rendered: RenderedItems | None) -> None:
        self._batches.append((tuple(items), rendered))
        outputs = (FunctionCallOutput, CustomToolCallOutput)
        self.ids.update(item.call_id for item in items if isinstance(item, outputs))

    @property
    def nbytes(self) -> int:
        """What they take in memory once rendered: the memory budget counts them before they
        join the conversation."""
        return sum(
            rendered.nbytes + TOKEN_BYTES * len(rendered.tokens)
            for _, rendered in self._batches
            if rendered is not None
        )

    def release(self) -> list[Batch]:
        """Every batch, in order; none is held any more."""
        batches, self._batches = self._batches, []
        self.ids = set()
        return batches
