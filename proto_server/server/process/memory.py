"""Memory budgets: what the server keeps for clients is counted, and bounded.

Two levels: each connection has a budget for what the server keeps on its behalf (its rollouts,
warm or suspended, and the requests it queued), and the process has one for all of it together,
plus the transient cost of requests being decoded and rendered. Counts are estimates that err
on the high side (`Conversation.retained_bytes`; a frame in preparation is charged
`PREPARING_FACTOR` times its size, the peak measured while decoding and rendering one).

Holders that sit idle (a launched connection's cached rollout, a suspended Response) are
registered as evictable. When a charge would not fit, the idlest are let go first, each told
why; only when nothing idle is left is the new charge refused with a typed error. Nothing grows
without bound, and nothing is dropped silently.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.wire.errors import ProtocolError

#: Peak memory while one frame is decoded and rendered, per byte of the frame in memory:
#: `proto-server bench memory` measures a real server's peak RSS per input shape, 2-42x at 15 MB,
#: the most for deeply nested JSON (docs/limits.md); 48 covers that with a margin.
PREPARING_FACTOR = 48

MiB = 1024 * 1024

#: `incomplete_details.reason` / eviction reason when a budget made room.
MEMORY_LIMIT = "memory_limit"


class Evictable(Protocol):
    """An idle holder of memory that can let go of it when told, at once."""

    def evict(self, reason: str) -> None:
        """Release the memory (it need not be freed yet, but it must no longer be counted)."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB"


class MemoryBudget:
    """Bytes charged against `limit`; a child (a connection) charges its parent (the process)."""

    def __init__(
        self, limit: int, *, flag: str, name: str, parent: MemoryBudget | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"a memory budget must be positive, got {limit}")
        self.limit = limit
        self.flag = flag
        self.name = name
        self.parent = parent
        self.used = 0
        #: The most `used` ever was (benchmarks and tests compare it with the limit).
        self.peak = 0
        self.closed = False
        #: How many idle holders this budget let go of to make room.
        self.evicted = 0
        self._idle: collections.OrderedDict[Evictable, None] = collections.OrderedDict()

    def child(self, limit: int, *, flag: str, name: str) -> MemoryBudget:
        return MemoryBudget(limit, flag=flag, name=name, parent=self)

    # -- charges ------------------------------------------------------------------------------

    def close(self) -> None:
        """The connection is gone: whatever it still counted is no longer counted anywhere,
        and later charges to it are ignored."""
        for holder in list(self._idle):
            self.busy(holder)
        self.charge(-self.used)
        self.closed = True

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` more (negative: fewer) here and in every parent."""
        if self.closed:
            return
        budget = self
        while True:
            budget.used += nbytes
            budget.peak = max(budget.peak, budget.used)
            if budget.parent is None:
                break
            budget = budget.parent
        # the process's budget (the root) is on /metrics
        metrics.MEMORY_USED.set(budget.used)
        metrics.MEMORY_PEAK.set(budget.peak)

    def check(self, nbytes: int, what: str) -> None:
        """Make sure `nbytes` more fit here and in every parent, letting idle holders go to
        make room (the idlest first); else refuse `what` with the error of the budget that is
        full. Charges nothing."""
        budget: MemoryBudget | None = self
        while budget is not None:
            if not budget._make_room(nbytes):
                raise budget._refusal(nbytes, what)
            budget = budget.parent

    def admit(self, nbytes: int, what: str) -> None:
        """`check`, then charge `nbytes`."""
        self.check(nbytes, what)
        self.charge(nbytes)

    @contextmanager
    def reserve(self, nbytes: int, what: str) -> Iterator[None]:
        """`admit` for the time of a `with` block (a request being prepared)."""
        self.admit(nbytes, what)
        try:
            yield
        finally:
            self.charge(-nbytes)

    # -- idle holders ---------------------------------------------------------------------------

    def idle(self, holder: Evictable) -> None:
        """`holder` may be let go of when room is needed; the most recently idle go last."""
        if self.closed:
            return
        budget: MemoryBudget | None = self
        while budget is not None:
            budget._idle[holder] = None
            budget._idle.move_to_end(holder)
            budget = budget.parent

    def busy(self, holder: Evictable) -> None:
        """`holder` is in use again (or gone): never let it go now."""
        budget: MemoryBudget | None = self
        while budget is not None:
            budget._idle.pop(holder, None)
            budget = budget.parent

    def _make_room(self, nbytes: int) -> bool:
        while self.used + nbytes > self.limit and self._idle:
            holder = next(iter(self._idle))
            self.evicted += 1
            metrics.EVICTIONS.labels(MEMORY_LIMIT).inc()
            log.warning(
                "memory.evicted",
                extra={
                    "budget": self.name,
                    "flag": self.flag,
                    "used": self.used,
                    "limit": self.limit,
                    "needed": nbytes,
                },
            )
            self.busy(holder)  # from every budget, before it is told
            holder.evict(MEMORY_LIMIT)
        return self.used + nbytes <= self.limit

    def _refusal(self, nbytes: int, what: str) -> ProtocolError:
        message = (
            f"{what} would need about {_mib(nbytes)} more, and the {self.name} memory budget "
            f"({self.flag}, {_mib(self.limit)}) has {_mib(max(self.limit - self.used, 0))} "
            "left with nothing idle to let go."
        )
        if self.parent is None:
            return ProtocolError(
                "server_busy",
                f"{message} Retry later, or send less.",
                status=503,
                error_type="server_error",
            )
        return ProtocolError(
            "connection_memory_limit",
            f"{message} Send less (continue with previous_response_id and only new items), end "
            "what this connection holds, or open another connection.",
            status=400,
        )


def preparing_bytes(frame: str | bytes) -> int:
    """What preparing `frame` may take at its peak: `PREPARING_FACTOR` x its size in memory
    (a str counts its width, so one of 4-byte characters is not four times cheaper)."""
    size = len(frame)
    if isinstance(frame, str) and size:
        size = sys.getsizeof(frame) - sys.getsizeof("")
    return PREPARING_FACTOR * size
