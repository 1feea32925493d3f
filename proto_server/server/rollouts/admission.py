"""The trio side of admission by KV capacity (`core/scheduler.py` decides; this waits).

The sampling loop asks before each segment (`request`: synchronous, a dict lookup when the
rollout is admitted already or there is room), and only when told to wait does it `wait`:
cancellable (a cancel or a disconnect gives the place up), and bounded by
`--admission-timeout` (`AdmissionTimeout`, which ends the Response `incomplete`). No task of its
own: a waiter wakes when it is admitted (someone's release made room) or when the next
suspended place lapses, and demotes what lapsed itself; one waiter at a time is poked to look
at the clock again when that changes.

Several server processes sharing the engines (`--admission-shared`; `--workers N`) each run
`share` in the server's nursery: it publishes what this one holds and waits for to the store
they share and reads theirs, every `--admission-sync-interval` (sooner when a rollout starts to
wait here), and admits against this process's part of the room (core/shared_capacity.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable

import trio

from proto_server.core.admission_queue import Request, State
from proto_server.core.scheduler import Scheduler
from proto_server.core.shared_capacity import Load, capacity_for
from proto_server.engine.base import SharedGenerator, TokenGenerator
from proto_server.server.process import metrics
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.logs import log
from proto_server.server.store import LoadStore, StoreUnavailable

#: `incomplete_details.reason` of a Response that waited past `--admission-timeout`.
ADMISSION_TIMEOUT = "admission_timeout"
#: The scheduler's counts of places given up, by why: each one's counter and log line.
GIVEN_UP = {
    "demotions": (metrics.ADMISSION_DEMOTIONS, "admission.demoted"),  # lapsed, others waiting
    "reclaims": (metrics.ADMISSION_RECLAIMS, "admission.reclaimed"),  # for a fair share
    "overflows": (metrics.ADMISSION_OVERFLOWS, "admission.overflowed"),  # an outgrown room
}
#: A process sharing the engines that has not published its load for this many of its
#: intervals is taken for gone: the others share the room without it.
STALE_INTERVALS = 10


class AdmissionTimeout(Exception):
    """A rollout waited for room on the engine longer than `--admission-timeout`."""


class Admission:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        timeout_s: float,
        up_share: Callable[[], float] | None = None,
        recheck_s: float = 2.0,
    ) -> None:
        """`up_share`: the share of the engines' capacity that answers now (engine replicas);
        the capacity admitted against is that share of the scheduler's, looked at before each
        request and, by waiters, every `recheck_s` (how often the replicas are probed)."""
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self._full = scheduler.capacity
        self._up_share = up_share
        self._recheck_s = recheck_s
        self._waiters: dict[Hashable, trio.Event] = {}
        #: The scheduler's counts of places given up (`GIVEN_UP`), as last counted.
        self._counted = dict.fromkeys(GIVEN_UP, 0)
        #: Sharing the engines with other processes (`share` runs): the capacity is set there.
        self._shared = False
        self._share_now = trio.Event()
        self._loads_failing = False
        metrics.KV_CAPACITY.set(scheduler.capacity)
        log.info(
            "admission.on",
            extra={"capacity_tokens": scheduler.capacity, "ttl_s": scheduler.ttl_s,
                   "ttl_median": scheduler.ttl_median, "timeout_s": timeout_s},
        )  # fmt: skip
        metrics.ADMISSION_TTL.set(scheduler.ttl)

    def request(self, key: Hashable, owner: str, tokens: int) -> Request:
        """Whether `key`'s next segment may go now (else `wait`)."""
        scheduler = self.scheduler
        self._refresh_capacity()
        ttl = scheduler.ttl
        answer = scheduler.request(key, owner, tokens, trio.current_time())
        if scheduler.ttl != ttl:  # learned from this one's time away (--admission-ttl-median)
            metrics.ADMISSION_TTL.set(scheduler.ttl)
            if scheduler.waiting:
                self._poke()  # a waiter sleeping until a place lapses: it may lapse sooner
        if answer.resident and not answer.woken and not self._gave_back():
            metrics.KV_RESERVED.set(scheduler.reserved)
            return answer
        self._wake(answer.woken)
        if not answer.admitted:
            self._share_now.set()  # the other processes should know it waits, and give way
            log.info(
                "admission.waiting",
                extra={
                    "owner": owner,
                    "tokens": tokens,
                    "reserved": scheduler.reserved,
                    "waiting": scheduler.waiting,
                },
            )
        self._changed()
        return answer

    async def wait(self, key: Hashable) -> None:
        """Until `key` (told to wait by `request`) is admitted; raises `AdmissionTimeout`
        past `timeout_s`. However it ends without being admitted, its place is given up."""
        scheduler = self.scheduler
        entry = scheduler.entry(key)
        owner = entry.owner if entry is not None else None
        started = trio.current_time()
        deadline = started + self.timeout_s
        try:
            while scheduler.state(key) is State.WAITING:
                if trio.current_time() >= deadline:
                    raise AdmissionTimeout(
                        f"waited {self.timeout_s:g} s for room in the engine's KV cache "
                        "(--admission-timeout)"
                    )
                event = self._waiters[key] = trio.Event()
                wake = min(deadline, scheduler.next_expiry())
                if self._up_share is not None:
                    wake = min(wake, trio.current_time() + self._recheck_s)
                with trio.move_on_at(wake):
                    await event.wait()
                self._refresh_capacity()
                self._expire()
        finally:
            self._waiters.pop(key, None)
            if scheduler.state(key) is State.WAITING:  # cancelled, or gave up
                self.release(key)
            self._poke()  # its timer goes with it: another waiter takes it up
        metrics.ADMISSION_WAIT.observe(trio.current_time() - started)
        waited = round(trio.current_time() - started, 3)
        log.info("admission.admitted", extra={"owner": owner, "waited_s": waited})

    def suspended(self, key: Hashable) -> None:
        """`key`'s segment ended; its place is kept for the TTL, or given to another key's
        waiter if its key holds more than its fair share (the scheduler decides)."""
        scheduler = self.scheduler
        admitted = scheduler.suspend(key, trio.current_time())
        if admitted or self._gave_back():
            self._wake(admitted)
            self._changed()
        if scheduler.waiting:
            self._poke()  # a new expiry: a waiter that knew of none would sleep past it

    def release(self, key: Hashable) -> None:
        """`key` is gone: its place (or its turn in the queue) goes to the next."""
        scheduler = self.scheduler
        if scheduler.state(key) is None:
            return
        self._wake(scheduler.release(key))
        self._changed()

    async def share(
        self,
        loads: LoadStore,
        *,
        peer: str,
        interval_s: float,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Admit against this process's part of the engines' room, beside the other processes
        that publish their loads to `loads` as `peer`s: publish and read once before it is
        started, then every `interval_s`, or sooner (at most four times as often) when a
        rollout starts to wait here. Withdrawn when cancelled, so the others need not wait for
        it to go stale."""
        self._shared = True
        log.info("admission.shared", extra={"peer": peer, "interval_s": interval_s})
        stale_s = STALE_INTERVALS * interval_s
        try:
            # before the server listens: it admits nothing until it knows the others' loads
            await self._publish(loads, peer, stale_s=stale_s)
            task_status.started()
            while True:
                await trio.sleep(interval_s / 4)
                with trio.move_on_after(interval_s * 3 / 4):
                    await self._share_now.wait()
                self._share_now = trio.Event()
                await self._publish(loads, peer, stale_s=stale_s)
        finally:
            # the others forget it once it is stale, if the store does not answer now
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(interval_s),
                contextlib.suppress(StoreUnavailable),
            ):
                await loads.withdraw(peer)

    async def _publish(self, loads: LoadStore, peer: str, *, stale_s: float) -> None:
        scheduler = self.scheduler
        try:
            others = await loads.publish_load(peer, self._load(peer), stale_s=stale_s)
        except StoreUnavailable as exc:
            if not self._loads_failing:  # admits by what it last knew until the store answers
                log.warning("admission.loads_unknown", extra={"peer": peer, "why": str(exc)})
                self._loads_failing = True
            return
        if self._loads_failing:
            log.warning("admission.loads_known", extra={"peer": peer})
            self._loads_failing = False
        metrics.ADMISSION_PEERS.set(len(others) + 1)
        if any(load.waiting for load in others):  # lapsed places here go to their waiters
            self._wake(scheduler.expire(trio.current_time(), others_wait=True))
            self._changed()
        room = self._room()
        metrics.KV_CAPACITY.set(room)
        mine = self._load(peer)
        elsewhere = sum(load.reserved for load in others)
        self._set_capacity(capacity_for(room, mine, others), elsewhere=elsewhere)

    def _load(self, peer: str) -> Load:
        scheduler = self.scheduler
        return Load(scheduler.reserved, scheduler.waiting_tokens, scheduler.head_tokens, peer)

    def _room(self) -> int:
        """What every process admits against together: the capacity of the engine replicas
        that answer now."""
        if self._up_share is None:
            return self._full
        return max(1, round(self._full * self._up_share()))

    def _refresh_capacity(self) -> None:
        """Admit against the capacity of the engine replicas that answer now (shared with
        other processes: `share` does it, with their loads)."""
        if self._up_share is None or self._shared:
            return
        capacity = self._room()
        if capacity == self.scheduler.capacity:
            return
        log.info(
            "admission.capacity",
            extra={"capacity_tokens": capacity, "was": self.scheduler.capacity,
                   "full": self._full},
        )  # fmt: skip
        metrics.KV_CAPACITY.set(capacity)
        self._set_capacity(capacity)

    def _set_capacity(self, capacity: int, *, elsewhere: int = 0) -> None:
        scheduler = self.scheduler
        if capacity == scheduler.capacity and elsewhere == scheduler.elsewhere:
            return
        self._wake(scheduler.set_capacity(capacity, elsewhere=elsewhere))
        self._changed()

    def _expire(self) -> None:
        self._wake(self.scheduler.expire(trio.current_time()))
        self._changed()

    def _poke(self) -> None:
        """Wake one waiter to look at the clock again. Every waiter sleeps until the earliest
        expiry it saw; a new suspension's expiry is the latest of all, so only a waiter that
        saw none, or the going of the waiter that kept the clock, needs one to look again."""
        for event in self._waiters.values():
            event.set()
            return

    def _gave_back(self) -> bool:
        """Whether places were taken back (for a fair share, or as the admitted outgrew the
        room) since last counted."""
        scheduler = self.scheduler
        counted = self._counted
        return (
            scheduler.reclaims != counted["reclaims"] or scheduler.overflows != counted["overflows"]
        )

    def _wake(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            event = self._waiters.get(key)
            if event is not None:
                event.set()

    def _changed(self) -> None:
        """After an admission, a wait, a release or a demotion: the gauges, and the places
        given up (`GIVEN_UP`) counted and logged (they happen inside the scheduler's calls)."""
        scheduler = self.scheduler
        for name, (counter, line) in GIVEN_UP.items():
            given_up = getattr(scheduler, name) - self._counted[name]
            if given_up:
                self._counted[name] += given_up
                counter.inc(given_up)
                log.info(
                    line,
                    extra={"rollouts": given_up, "ttl_s": round(scheduler.ttl, 3),
                           "reserved": scheduler.reserved, "waiting": scheduler.waiting},
                )  # fmt: skip
        metrics.ADMISSION_TTL.set(scheduler.ttl)
        metrics.ADMITTED.set(scheduler.admitted)
        metrics.ADMISSION_WAITING.set(scheduler.waiting)
        metrics.KV_RESERVED.set(scheduler.reserved)


def admission_for(config: ServerConfig, generator: TokenGenerator) -> Admission | None:
    """Admission as `config` sets it (None: no `--kv-capacity-tokens`, off); over engine
    replicas, against the capacity of those that answer."""
    if not config.kv_capacity_tokens:
        return None
    scheduler = Scheduler(
        config.kv_budget_tokens,
        ttl_s=config.admission_ttl_s,
        ttl_median=config.admission_ttl_median or None,
        weights=dict(config.key_weights),
        bypass=config.admission_bypass,
        growth=config.admission_growth,
        overflow=config.admission_overflow,
    )
    shared = generator if isinstance(generator, SharedGenerator) else None
    return Admission(
        scheduler,
        timeout_s=config.admission_timeout_s,
        up_share=shared.up_share if shared is not None else None,
        recheck_s=shared.probe_interval_s if shared is not None else 0,
    )
