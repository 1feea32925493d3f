"""A launched Response's steers that outlive it: held for the create that continues it with
its calls' outputs (`Awaiting`), and the successor a steered Response hands them to."""

from __future__ import annotations

import attrs

from proto_server.core.response import Steer, steering
from proto_server.server.process.memory import MemoryBudget
from proto_server.wire.events import (
    RequiredInput,
    ResponseCreate,
    ResponseSteerAccepted,
    ResponseSteerPending,
    ServerEvent,
)


class Awaiting:
    """A lane's last Response completed with calls awaiting output: steers for it wait here
    (`response.steer.pending`) for the create that continues it with the outputs.

    What they hold is charged to the connection's budget from the moment they wait here
    (`serve_steer` checked that each fits) until `release`: taken by that create, or failed."""

    def __init__(
        self,
        response_id: str,
        required: tuple[RequiredInput, ...],
        steers: list[Steer],
        limit: int,
        budget: MemoryBudget,
    ) -> None:
        self.response_id = response_id
        self.required = required
        self.steers = steers
        self._limit = limit
        self._budget = budget
        self._charged = sum(steer.nbytes for steer in steers)
        budget.charge(self._charged)

    def release(self) -> tuple[Steer, ...]:
        """The steers, no longer counted here (once: a second call finds none)."""
        steers, self.steers = tuple(self.steers), []
        self._budget.charge(-self._charged)
        self._charged = 0
        return steers

    def steer(self, steer: Steer) -> list[ServerEvent]:
        steering.refuse_if_full(
            self.response_id, len(self.steers), self._limit, then="continue it first"
        )
        self.steers.append(steer)
        self._budget.charge(steer.nbytes)
        self._charged += steer.nbytes
        ref = steer.ref
        return [
            ResponseSteerAccepted(steer=ref),
            ResponseSteerPending(required_input=self.required, steer=ref),
        ]


def successor(create: ResponseCreate, previous: str, steers: tuple[Steer, ...]) -> ResponseCreate:
    """The create a steered Response's successor answers: the same settings, chained to it,
    the steers' messages as its input (a warm-up's successor generates)."""
    return attrs.evolve(
        create,
        input=tuple(item for steer in steers for item in steer.items),
        previous_response_id=previous,
        generate=None,
        prompt_cache_options=None,
    )
