"""One Response's turn: how it began (`TurnStart`: where its state came from, how it is kept),
and what it cost the server, kept as it runs: the `TurnRecord` that `/metrics`, the bench and
the logs read (`response.ended`)."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs

from proto_server.core.request import ROLLOUT_ID
from proto_server.core.response import ResponseMachine

if TYPE_CHECKING:
    from proto_server.server.rollouts.resume import Durable


class TurnSource(enum.StrEnum):
    """Where a turn's state came from: what the model had warm, and what had to be prefilled
    again (`proto_server_turns_total`'s `source` label)."""

    #: Nothing warm: a new conversation, rendered and prefilled whole.
    FRESH = "fresh"
    #: The connection's warm rollout: only the new input is rendered.
    CACHE = "cache"
    #: A chain read back from the store (another connection's, or an evicted one).
    STORE = "store"
    #: The warm rollout's history, rendered again: the instructions, tools or effort changed.
    REBUILT = "rebuilt"
    #: A new lane that continues a Response of another lane: its conversation, copied.
    FORK = "fork"
    #: The history compacted before the turn (`context_management`).
    COMPACTED = "compacted"
    #: Its engine replica went down and another prefilled it again (`Rerouted`).
    FAILOVER = "failover"


@attrs.frozen(kw_only=True)
class TurnStart:
    """How one Response's turn began: where its state came from, and how it is kept."""

    source: TurnSource
    #: The conversation's rendered tokens before this turn's input (what it rendered is after).
    rendered_mark: int
    arrived_at: float | None = None
    persist: Callable[[ResponseMachine], Awaitable[None]] | None = None
    #: Where a `store: true` prototype Response keeps its suspensions (each is written before
    #: its `response.done`).
    durable: Durable | None = None
    #: Its machine was rebuilt from a stored suspension, so its Response was announced on
    #: another connection already (no `response.created`).
    resumed: bool = False
    #: Its create asked for a warm-up (`is_warmup`): it generates nothing.
    warmup: bool = False


@attrs.frozen(kw_only=True)
class TurnRecord:
    """What one Response cost the server: how much it rendered, and what the model re-read."""

    response_id: str
    source: TurnSource
    rendered_input_tokens: int
    prompt_tokens: int
    cached_tokens: int
    status: str
    #: From the request's arrival: to the generator's first start, and to the first event out.
    prepare_s: float | None = None
    first_event_s: float | None = None
    #: The generator's segments, summed.
    decode_s: float = 0.0
    #: The rollout id its client named (`metadata.rollout_id`), to find a rollout's turns.
    rollout_id: str | None = None


@attrs.define(kw_only=True)
class TurnAccount:
    """The running account of one Response, times from `arrived_at` (trio's clock)."""

    arrived_at: float
    source: TurnSource
    #: The conversation's rendered tokens when this Response last counted them: what was
    #: rendered past it (its input, appended outputs) is input this Response rendered.
    rendered_mark: int
    rendered_input: int = 0
    prepare_s: float | None = None
    first_event_s: float | None = None
    decode_s: float = 0.0

    def generating(self, now: float) -> None:
        if self.prepare_s is None:
            self.prepare_s = now - self.arrived_at

    def sending(self, now: float) -> None:
        if self.first_event_s is None:
            self.first_event_s = now - self.arrived_at

    def count_rendered(self, rendered_tokens: int) -> int:
        """Add the tokens rendered since the last count to this Response's; return them."""
        new = rendered_tokens - self.rendered_mark
        self.rendered_input += new
        self.rendered_mark = rendered_tokens
        return new

    def record(self, machine: ResponseMachine) -> TurnRecord:
        usage = machine.usage()
        return TurnRecord(
            response_id=machine.id,
            source=self.source,
            rendered_input_tokens=self.rendered_input,
            prompt_tokens=usage.input_tokens,
            cached_tokens=usage.input_tokens_details.cached_tokens,
            status=machine.status.value,
            prepare_s=self.prepare_s,
            first_event_s=self.first_event_s,
            decode_s=self.decode_s,
            rollout_id=machine.template.metadata.get(ROLLOUT_ID),
        )
