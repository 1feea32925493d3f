"""The process-wide register of suspended rollouts, and the cap on how many there may be.

A suspended rollout holds memory (its conversation, the model's warm state) until its client
appends. Two bounds keep that finite: each suspension has an idle timeout (the sampling loop's
own), and at most `limit` may be suspended at once. Past the cap the one idle longest is ended
with `response.incomplete` (reason `suspended_rollout_limit`), and a warning says which: nothing
is evicted silently.
"""

from __future__ import annotations

import collections
from typing import Protocol

import trio

from proto_server.server.process import metrics
from proto_server.server.process.logs import log

EVICTED = "suspended_rollout_limit"


class Suspended(Protocol):
    """A suspended Response that can be told to end."""

    @property
    def response_id(self) -> str: ...

    def expire(self, reason: str) -> None: ...


class Suspensions:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the cap on suspended rollouts must be at least 1, got {limit}")
        self.limit = limit
        self.evicted = 0
        self._idle_since: collections.OrderedDict[Suspended, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._idle_since)

    def add(self, rollout: Suspended) -> None:
        """`rollout` just suspended; if that makes one too many, end the one idle longest."""
        if rollout not in self._idle_since:
            metrics.SUSPENDED.inc()
        self._idle_since[rollout] = trio.current_time()
        while len(self._idle_since) > self.limit:
            oldest, since = self._idle_since.popitem(last=False)
            metrics.SUSPENDED.dec()
            metrics.EVICTIONS.labels(EVICTED).inc()
            self.evicted += 1
            log.warning(
                "rollout.evicted",
                extra={
                    "response": oldest.response_id,
                    "reason": EVICTED,
                    "idle_s": round(trio.current_time() - since, 3),
                    "limit": self.limit,
                },
            )
            oldest.expire(EVICTED)

    def touch(self, rollout: Suspended) -> None:
        """The client answered some of its calls: it is no longer the idlest."""
        if rollout in self._idle_since:
            self._idle_since.move_to_end(rollout)
            self._idle_since[rollout] = trio.current_time()

    def discard(self, rollout: Suspended) -> None:
        if self._idle_since.pop(rollout, None) is not None:
            metrics.SUSPENDED.dec()


class IdleWait:
    """One suspended Response's wait: woken by whatever decides what comes next (the append
    or inject that answers its last call, a cancel, an expiry), or given up when its client
    stays idle for `timeout_s`. While it waits it is in the `register`, so the cap can end it."""

    def __init__(
        self, owner: Suspended, timeout_s: float, register: Suspensions | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self._owner = owner
        self._register = register
        self._woken = trio.Event()
        self._idle: trio.CancelScope | None = None

    def wake(self) -> None:
        self._woken.set()

    def touch(self) -> None:
        """A partial answer: the client is alive, so the idle clock starts again."""
        if self._idle is not None:
            self._idle.deadline = trio.current_time() + self.timeout_s
            if self._register is not None:
                self._register.touch(self._owner)

    async def wait(self) -> bool:
        """Wait to be woken from now on (an earlier wake was for an earlier wait); False if
        the client stayed idle too long."""
        self._woken = trio.Event()
        if self._register is not None:
            self._register.add(self._owner)
        try:
            with trio.move_on_after(self.timeout_s) as self._idle:
                await self._woken.wait()
        finally:
            self._idle = None
            if self._register is not None:
                self._register.discard(self._owner)
        return self._woken.is_set()
