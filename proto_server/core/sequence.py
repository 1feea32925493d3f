"""Per-connection event numbering: starts at 0, rises by exactly one per event sent."""

from __future__ import annotations


class Sequencer:
    def __init__(self) -> None:
        self._next = 0

    def next(self) -> int:
        number = self._next
        self._next += 1
        return number

    @property
    def sent(self) -> int:
        return self._next
