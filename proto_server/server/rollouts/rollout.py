"""A rollout's warm state: its conversation and its generator session (the model's KV cache).

A `Rollout` outlives any one Response when its owner lets it: the prototype dialect keeps it for
the one open Response, the launched dialect keeps the most recent one in its connection cache and
serves a chained `response.create` from it. Closing it releases the model state.

What it holds in memory is charged to its connection's budget (and so to the process's):
`account()` brings the charge up to date as the conversation grows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from proto_server.core.conversation import Conversation
from proto_server.engine.base import GeneratorSession
from proto_server.server.process.memory import MemoryBudget
from proto_server.server.store import ANONYMOUS
from proto_server.wire.tools import Tool


class Rollout:
    def __init__(
        self,
        conversation: Conversation,
        session: GeneratorSession,
        *,
        budget: MemoryBudget,
        on_close: Callable[[Rollout], None],
        owner: str = ANONYMOUS,
    ) -> None:
        self.conversation = conversation
        #: Whose it is (the tenant): admission shares the engine between owners.
        self.owner = owner
        #: Segments it has run: one before means the engine has seen its prefix.
        self.segments = 0
        self.session = session
        self.budget = budget
        self.closed = False
        self._on_close = on_close
        self._charged = 0
        self._released = False
        self.account()

    def serves(
        self, instructions: str | None, tools: Sequence[Tool], effort: str | None = None
    ) -> bool:
        """Whether a turn with this prefix (its instructions, tools and reasoning effort) can
        extend the warm state rather than rebuild it."""
        return self.conversation.opens_with(instructions, tools, effort)

    def account(self, pending: int = 0) -> None:
        """Charge the budget for what the conversation holds now, and `pending` bytes more
        (outputs injected while a segment streams, held until it ends)."""
        if self._released:
            return
        held = self.conversation.retained_bytes + pending
        self.budget.charge(held - self._charged)
        self._charged = held

    def release_budget(self) -> None:
        """Stop counting this rollout (it is being let go; `aclose` follows)."""
        self.budget.charge(-self._charged)
        self._charged = 0
        self._released = True

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.release_budget()
        with trio.CancelScope(shield=True):
            await self.session.aclose()
        self._on_close(self)
