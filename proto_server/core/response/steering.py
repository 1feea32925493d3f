"""Steering (`response.steer`): a steer is accepted and queued, and at the next safe point
(between tokens, with no tool call of the segment awaiting output) it is applied: a
`successor` Response ends `incomplete` (`steered`) and its steers go to the successor the
dialect starts; an `in_place` one (the prototype dialect) closes what streamed, takes the
steer's messages, and streams on as the same Response. A Response that stops for tool outputs
keeps its steers (`response.steer.pending`) until they arrive; one that ends otherwise fails
them, input back. Here: the steers and their queue; `ResponseMachine` decides when."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from proto_server.core.response.mode import Mode
from proto_server.core.response.status import Status
from proto_server.wire.errors import SteerRefused
from proto_server.wire.events import (
    FailedSteer,
    RequiredInput,
    ResponseSteerFailed,
    ResponseSteerPending,
    ServerEvent,
    SteerError,
    SteerRef,
)
from proto_server.wire.items import Item

#: `incomplete_details.reason` of a Response that a steer ended (its successor goes on).
STEERED = "steered"
#: How a Response takes a steer: it ends and a successor Response continues (the launched
#: dialect), it streams on as itself (the prototype dialect), or it takes none (the
#: multi-agent beta, as OpenAI: steering is for single-agent Responses).
Steering = Literal["successor", "in_place", "unsupported"]

#: How a Response of each mode is steered unless told: by a successor where calls end it, in
#: place where it suspends and says so, not at all in the multi-agent beta.
STEERING: Mapping[Mode, Steering] = {
    Mode.SUCCESSOR: "successor", Mode.SUSPEND: "in_place", Mode.WAIT: "unsupported"
}  # fmt: skip


@attrs.frozen(kw_only=True)
class Steer:
    """An accepted `response.steer`: its id, its input as items, and as the client sent it
    (what a `response.steer.failed` returns)."""

    id: str
    previous_response_id: str
    items: tuple[Item, ...]
    raw_input: Any
    #: What it holds in memory (`decoded_bytes`): charged to the budgets while it waits.
    nbytes: int = 0

    @property
    def ref(self) -> SteerRef:
        return SteerRef(id=self.id, previous_response_id=self.previous_response_id)

    def failed(self, code: str, message: str) -> ResponseSteerFailed:
        return steer_failed(
            code, message, self.raw_input, self.previous_response_id, steer_id=self.id
        )


def steer_failed(
    code: str, message: str, raw_input: Any, response_id: str, *, steer_id: str | None = None
) -> ResponseSteerFailed:
    steer = FailedSteer(input=raw_input, previous_response_id=response_id, id=steer_id)
    return ResponseSteerFailed(error=SteerError(code=code, message=message), steer=steer)


def refuse_if_full(response_id: str, waiting: int, limit: int, *, then: str) -> None:
    """`too_many_pending_steers` once `waiting` steers fill `--max-pending-steers`; `then`
    tells the client what lets one more in."""
    if waiting >= limit:
        raise SteerRefused(
            "too_many_pending_steers",
            f"Response {response_id} already has {waiting} steers waiting "
            f"(--max-pending-steers); {then}.",
        )


def refuse(response_id: str, steering: Steering, status: Status) -> None:
    """The `SteerRefused` of a Response that takes no steer now, whatever its queue holds."""
    if steering == "unsupported":
        raise SteerRefused(
            "steering_not_supported",
            f"Response {response_id} cannot be steered: multi-agent and compacted Responses "
            "take no steering input.",
        )
    if status.terminal:
        raise SteerRefused(
            "response_already_completed",
            f"Response {response_id} already ended ({status.value}); nothing was queued.",
        )
    if status is Status.ENDING:
        raise SteerRefused(
            "response_not_active",
            f"Response {response_id} is ending; it takes no more steering input.",
        )


class Queue:
    """A Response's accepted steers not yet applied, in order, and those told they are pending."""

    def __init__(self, response_id: str, limit: int) -> None:
        self.response_id = response_id
        self.limit = limit
        self.steers: list[Steer] = []
        self._told: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.steers)

    @property
    def nbytes(self) -> int:
        return sum(steer.nbytes for steer in self.steers)

    def add(self, steer: Steer) -> None:
        refuse_if_full(
            self.response_id, len(self.steers), self.limit, then="wait for one to be applied"
        )
        self.steers.append(steer)

    def take(self) -> list[Steer]:
        """Every steer, in order; the queue is empty after."""
        steers, self.steers = self.steers, []
        return steers

    def tell_pending(self, required: Sequence[RequiredInput]) -> list[ServerEvent]:
        """`response.steer.pending`, once per steer, while the Response waits on `required`."""
        untold = [steer for steer in self.steers if steer.id not in self._told]
        self._told.update(steer.id for steer in untold)
        return [ResponseSteerPending(required_input=tuple(required), steer=s.ref) for s in untold]

    def fail(self, code: str, reason: str) -> list[ServerEvent]:
        """The Response ended (`reason`) without its steers: each comes back, none is lost."""
        message = f"Response {self.response_id} ended before the steer was applied ({reason})."
        return [steer.failed(code, message) for steer in self.take()]
