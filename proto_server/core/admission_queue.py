"""What admission keeps of a rollout (`Entry`, in one `State` at a time) and the order of one
owner's waiting rollouts (`Queue`): the smallest first, the oldest once passed `bypass` times.
`Scheduler` (core/scheduler.py) decides which queue's head goes next."""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Hashable

import attrs


class State(enum.Enum):
    STREAMING = "streaming"  # admitted, a segment on the engine
    SUSPENDED = "suspended"  # admitted, waiting on its client (a tool); its place is kept
    WAITING = "waiting"  # asked to run, not admitted yet
    IDLE = "idle"  # known, not admitted, not asking (demoted, or never admitted)


@attrs.define
class Entry:
    key: Hashable
    owner: str
    tokens: int
    state: State
    #: When it suspended (SUSPENDED) or began to wait (WAITING).
    since: float
    #: Arrival order among waiting ones (FCFS within an owner, ties across owners).
    order: int = 0
    #: When its last segment ended (it has waited on its client since); None: it has not, or
    #: it has asked again since.
    away_since: float | None = None
    #: While admitted, the least it holds reserved: `growth` times its tokens when admitted
    #: (0 with `growth` 1: what it holds, as that changes).
    floor: int = 0

    @property
    def held(self) -> int:
        """The tokens reserved for it while admitted."""
        return max(self.tokens, self.floor)

    @property
    def admitted(self) -> bool:
        return self.state in (State.STREAMING, State.SUSPENDED)


@attrs.frozen
class Request:
    """The answer to `request`: admitted now (and whether it was resident, so it resumes
    ahead of new work: the engine's priority), or queued."""

    admitted: bool
    resident: bool
    #: Other rollouts admitted by this call (room freed by lapsed places): wake them.
    woken: tuple[Hashable, ...] = ()


#: The answers without a list of others woken, made once: `request` runs before every segment.
RESIDENT = Request(admitted=True, resident=True)
ADMITTED = Request(admitted=True, resident=False)
QUEUED = Request(admitted=False, resident=False)


class Queue:
    """One owner's waiting rollouts: the smallest first, the oldest once it has been passed
    `bypass` times (0: the oldest always). O(log n) a change: arrival order in a dict, sizes
    in a heap whose stale tuples (a waiter gone, or asked again with other tokens) are
    dropped when they come to its top."""

    def __init__(self, bypass: int, wanted: Callable[[int], int]) -> None:
        self.bypass = bypass
        self._fifo: dict[int, Entry] = {}  # by order: insertion-ordered, oldest first
        self._sizes: list[tuple[int, int, Entry]] = []
        #: How many others were admitted past the oldest since it became the oldest.
        self.passed = 0
        self._wanted = wanted
        #: What its waiters want reserved, each `wanted(its tokens)`: kept as they come and
        #: go, as the fair share reads it at every suspension while someone waits.
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, entry: Entry) -> None:
        self._fifo[entry.order] = entry
        self.tokens += self._wanted(entry.tokens)
        if self.bypass:
            heapq.heappush(self._sizes, (entry.tokens, entry.order, entry))

    def resized(self, entry: Entry, before: int) -> None:
        """A waiter asked again holding other tokens (`before`: what it held): its place in
        arrival order stays. The heap is rebuilt when stale tuples outnumber the waiters, so
        it stays O(waiters)."""
        self.tokens += self._wanted(entry.tokens) - self._wanted(before)
        if not self.bypass:
            return
        heapq.heappush(self._sizes, (entry.tokens, entry.order, entry))
        if len(self._sizes) > 2 * len(self._fifo) + 16:
            self._sizes = [(e.tokens, e.order, e) for e in self._fifo.values()]
            heapq.heapify(self._sizes)

    def oldest(self) -> Entry:
        return next(iter(self._fifo.values()))

    def head(self) -> Entry:
        """Who goes next: nobody behind it goes while it does not fit."""
        oldest = self.oldest()
        if self.passed >= self.bypass:
            return oldest
        sizes, fifo = self._sizes, self._fifo
        while True:
            tokens, order, entry = sizes[0]
            if fifo.get(order) is entry and entry.tokens == tokens:
                return entry
            heapq.heappop(sizes)

    def remove(self, entry: Entry, *, admitted: bool) -> None:
        """`entry` leaves: admitted (`head` returned it), or gone."""
        if self.oldest() is entry:
            self.passed = 0
        elif admitted:
            self.passed += 1
        del self._fifo[entry.order]
        self.tokens -= self._wanted(entry.tokens)
        if not self._fifo:
            self._sizes.clear()
