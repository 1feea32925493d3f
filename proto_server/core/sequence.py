"""Per-connection event numbering: starts at 0, rises by exactly one per event sent (a
reattached stream goes on from the numbers its Response's events first had)."""

from __future__ import annotations


class Sequencer:
    def __init__(self) -> None:
        self._next = 0

    def next(self) -> int:
        number = self._next
        self._next += 1
        return number

    def skip_to(self, number: int) -> None:
        """Go on from `number` (a replayed stream keeps the numbers it first had)."""
        self._next = max(self._next, number)

    @property
    def sent(self) -> int:
        return self._next
