"""What a Responses stream promises, and how a broken promise is reported.

The model of Responses and the ledger of frames raise `Broken` where they see a promise broken;
they do not know which event they were reading. The checker does: it turns `Broken` into the
public `InvariantViolation`, which names the event and its sequence number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson

Dialect = Literal["prototype", "launched"]

INVARIANTS: Mapping[int, str] = {
    1: "sequence_number starts at 0 and rises by exactly 1",
    2: "each Response begins with response.created; nothing of it follows its terminal event",
    3: "items open and close in order, deltas fall inside them, and done texts equal the deltas",
    4: "response.done follows tool calls; the Response waits for an accepted append to resume",
    5: "every answered call_id belonged to a call that was emitted and not yet answered",
    6: "usage adds up",
    7: "every client frame gets its effect or exactly one error; a refused frame changes nothing",
    8: "every event validates against the published schema (checked when a schema is given)",
    9: "each lane's events carry its stream_id, and a Response lives on one lane",
}


class InvariantViolation(AssertionError):
    """The stream broke a promise; `invariant` is its number in `INVARIANTS`."""

    def __init__(
        self, invariant: int, detail: str, *, sequence_number: int | None, event: Any
    ) -> None:
        where = "at the end of the stream" if event is None else f"at event #{sequence_number}"
        shown = "" if event is None else f": {_short(event)}"
        super().__init__(
            f"invariant {invariant} ({INVARIANTS[invariant]}): {detail}; {where}{shown}"
        )
        self.invariant = invariant
        self.detail = detail
        self.sequence_number = sequence_number
        self.event = event


class Broken(Exception):
    """A promise broken, seen inside the checker: the checker adds the event it was reading."""

    def __init__(self, invariant: int, detail: str) -> None:
        super().__init__(invariant, detail)
        self.invariant = invariant
        self.detail = detail


def _short(value: Any, limit: int = 300) -> str:
    text = orjson.dumps(value, default=repr).decode() if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"
