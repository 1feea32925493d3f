"""Admission by KV capacity: which rollout's next segment may go to the engine now.

The engine's KV cache is plain LRU: when more rollouts are active than it holds, the one that
has waited longest on its tool is evicted first, and it is usually the next to come back. This
server knows what the engine can only guess (when each rollout suspends on a tool and resumes,
how many tokens it holds), so it admits whole rollouts, first come first served, as long as the
admitted ones' tokens fit the cache (Continuum's idea, arXiv 2511.02230):

- an admitted rollout (its KV presumed resident) resumes at once when its tool output comes;
- a new one is admitted only if its tokens fit beside the admitted ones', else it waits;
- a suspended admitted rollout keeps its place for `ttl_s`, then is demoted (its tokens no
  longer reserved), so a rollout whose client went away does not block the others; with
  `ttl_median` K, the place is kept K times the median time rollouts were away lately (their
  tools' times, as this server saw them), if that is shorter: past it, a rollout is unlikely
  to be back soon;
- a rollout grows while admitted (each turn appends a call, its output, the next answer): with
  `growth` G above 1, it is admitted for G times what it holds, and keeps that much reserved
  until it holds more, so the admitted ones' growth does not evict each other;
- a rollout larger than what fits is still served when nothing else is admitted (no deadlock);
- the waiting queue is served by weighted fair share between owners (API keys): the owner with
  the fewest admitted tokens per unit of weight goes first (on a tie, the one served longest
  ago); within one, the waiter holding the fewest tokens first (more fit at once, and the
  mean wait is shorter), but the one that has waited longest is passed by at most `bypass`
  others, then goes next (no waiter starves); `bypass` 0: first come first served;
- an owner is entitled to its fair share (`fair_level`: the capacity shared max-min fair by
  weight between the owners that hold or wait): while the owner next in line holds less and
  its waiter does not fit, owners holding more give suspended places back, as lapses, until it
  fits, and it goes next (`_reclaim`): else an owner whose tools always come back within the
  TTL would keep its places for ever.

Sans-IO: no clock (every call that needs the time is given `now`), no awaits; the trio side
(`server/rollouts/admission.py`) wakes the rollouts each call returns as admitted. Each
owner's waiters are ordered by a `Queue` (core/admission_queue.py); this decides which
queue's head fits.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Hashable, Mapping

from proto_server.core.admission_queue import (
    ADMITTED,
    QUEUED,
    RESIDENT,
    Entry,
    Queue,
    Request,
    State,
)
from proto_server.core.shared_capacity import water_level

#: How many of the latest times away `ttl_median` takes the median of, and how many it needs.
AWAY_SAMPLES = 256
AWAY_SAMPLES_MIN = 16


class Scheduler:
    """Rollouts by key (any hashable: the server uses the `Rollout` itself)."""

    def __init__(
        self,
        capacity_tokens: int,
        *,
        ttl_s: float,
        ttl_median: float | None = None,
        weights: Mapping[str, float] | None = None,
        bypass: int = 0,
        growth: float = 1.0,
        overflow: bool = False,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be at least 1, got {capacity_tokens}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.capacity = capacity_tokens
        #: The room it was built with (the whole budget; `set_capacity` changes `capacity`
        #: to a part of it): no growth reservation exceeds it.
        self.whole = capacity_tokens
        if ttl_median is not None and not ttl_median > 0:
            raise ValueError(f"ttl_median must be positive, got {ttl_median}")
        if bypass < 0:
            raise ValueError(f"bypass must be at least 0, got {bypass}")
        if not growth >= 1:
            raise ValueError(f"growth must be at least 1, got {growth}")
        self.growth = growth
        self.overflow = overflow
        self.ttl_s = ttl_s
        self.ttl_median = ttl_median
        self.bypass = bypass
        #: The latest `AWAY_SAMPLES` times a rollout was away (its segment's end to its next
        #: request), and the place kept now (`ttl`).
        self._away: collections.deque[float] = collections.deque(maxlen=AWAY_SAMPLES)
        self.ttl = ttl_s
        self._weights = dict(weights or {})
        self._entries: dict[Hashable, Entry] = {}
        #: Per owner, its waiting rollouts.
        self._queues: dict[str, Queue] = {}
        #: Admitted tokens: in all, and per owner.
        self.reserved = 0
        self._owned: collections.Counter[str] = collections.Counter()
        self.admitted = 0
        self.waiting = 0
        #: Suspended rollouts whose place lapsed, since the start.
        self.demotions = 0
        #: Suspended rollouts whose place was taken back for another owner's fair share.
        self.reclaims = 0
        #: Suspended rollouts whose place was given up because the admitted ones had outgrown
        #: the room (`overflow`).
        self.overflows = 0
        #: Tokens other processes sharing the engines hold, as last read (shared admission):
        #: a rollout larger than the room runs alone only if they hold nothing either.
        self.elsewhere = 0
        self._order = 0
        #: Per owner, when it last had a rollout admitted (by count): between owners of equal
        #: share the one served longest ago goes first (round robin when few rollouts fit).
        self._served: dict[str, int] = {}
        #: The owner places were taken back for (`_reclaim`), until its next rollout is in:
        #: it stays next, so the room they leave goes to it, not to the owners who gave it
        #: (whose share may have dropped below its own) nor back to them.
        self._claim: str | None = None
        self._admissions = 0

    # -- what the server tells it ---------------------------------------------------------------

    def request(self, key: Hashable, owner: str, tokens: int, now: float) -> Request:
        """`key` wants its next segment on the engine, holding `tokens`. An admitted one goes
        at once whatever its size now (its KV is resident); another is admitted if it fits
        and no one waits ahead of it, else it waits (a later answer's `woken` names it)."""
        entry = self._entries.get(key)
        if entry is not None and entry.away_since is not None:
            self._came_back(now - entry.away_since)
            entry.away_since = None
        if entry is not None and entry.admitted:
            entry.state = State.STREAMING
            if tokens == entry.tokens:
                return RESIDENT
            self._resize(entry, tokens)
            if self.overflow and self.reserved > self.capacity:
                self._give_back()
            if not self.waiting:
                return RESIDENT
            # its owner's share changed, so another owner may be next, and its waiter may fit
            return Request(admitted=True, resident=True, woken=tuple(self._pump()))
        if entry is None:
            entry = Entry(key, owner, tokens, State.IDLE, now)
            self._entries[key] = entry
        elif entry.state is State.WAITING:
            if tokens != entry.tokens:  # its place in the queue is kept
                before, entry.tokens = entry.tokens, tokens
                self._queues[entry.owner].resized(entry, before)
            return QUEUED
        entry.tokens = tokens
        if not self.waiting and self._fits(tokens):  # no pressure: no scan, no queue
            self._admit(entry)
            return ADMITTED
        self._enqueue(entry, now)
        woken = self.expire(now) or self._pump()
        return Request(
            admitted=key in woken, resident=False, woken=tuple(k for k in woken if k != key)
        )

    def suspend(self, key: Hashable, now: float) -> list[Hashable]:
        """`key`'s segment ended: it waits on its client, keeping its place for `ttl_s`, unless
        its key holds more than its fair share while another key's waiter wants the room
        (`_reclaim`); returns who is admitted in the room it leaves."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not State.STREAMING:
            return []
        entry.state = State.SUSPENDED
        entry.since = entry.away_since = now
        if self.overflow and self.reserved > self.capacity and self._give_back():
            return self._pump()
        if not self.waiting or not self.share(entry.owner) > min(map(self.share, self._queues)):
            return []  # no waiter's owner holds less: its place is taken for none (`_reclaim`)
        return self._pump()

    def release(self, key: Hashable) -> list[Hashable]:
        """`key` is gone (closed, cancelled, gave up waiting); returns who is admitted now."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return []
        if entry.admitted:
            self._unreserve(entry)
        elif entry.state is State.WAITING:
            self._dequeue(entry, admitted=False)
        return self._pump()

    def set_capacity(self, capacity_tokens: int, *, elsewhere: int = 0) -> list[Hashable]:
        """The engine's room changed (a replica went down or came back; with other processes
        sharing the engines, this one's part changed, and `elsewhere` is what they hold): what
        is admitted keeps its place; more room admits who waits (returned: wake them), less
        admits nobody until enough is released."""
        if capacity_tokens < 0:  # 0: no room for this process now (others hold it all)
            raise ValueError(f"capacity_tokens must be at least 0, got {capacity_tokens}")
        grew = capacity_tokens > self.capacity or elsewhere < self.elsewhere
        self.capacity = capacity_tokens
        self.elsewhere = elsewhere
        return self._pump() if grew else []

    def expire(self, now: float, *, others_wait: bool = False) -> list[Hashable]:
        """Demote every suspended rollout whose place lapsed by `now`; returns who is admitted
        in the room they leave. `others_wait`: rollouts of other processes sharing the engines
        wait (core/shared_capacity.py), so the room is wanted even if nobody waits here."""
        if not self.waiting and not others_wait:
            return []  # a lapsed place only matters to someone waiting: demoted when one does
        lapsed = [
            e for e in self._entries.values()
            if e.state is State.SUSPENDED and e.since + self.ttl <= now
        ]  # fmt: skip
        for entry in lapsed:
            self._demote(entry)
            self.demotions += 1
        return self._pump() if lapsed else []

    # -- what it tells the server ---------------------------------------------------------------

    def next_expiry(self) -> float:
        """When the next suspended place lapses (inf: none), for a waiter to wake up then."""
        if not self.waiting:
            return math.inf
        return min(
            (e.since + self.ttl for e in self._entries.values() if e.state is State.SUSPENDED),
            default=math.inf,
        )

    def state(self, key: Hashable) -> State | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def entry(self, key: Hashable) -> Entry | None:
        return self._entries.get(key)

    @property
    def head_tokens(self) -> int:
        """The tokens the waiting rollout admitted next wants reserved (0: nobody waits);
        nobody behind it goes until they fit."""
        owner = self.next_owner()
        return 0 if owner is None else self._wanted(self._queues[owner].head().tokens)

    @property
    def waiting_tokens(self) -> int:
        """The tokens the waiting rollouts want reserved."""
        return sum(queue.tokens for queue in self._queues.values())

    def owned(self, owner: str) -> int:
        """The tokens reserved for `owner`'s admitted rollouts (with `growth`, their room to grow
        too: a key's share is what it keeps from others)."""
        return self._owned[owner]

    def share(self, owner: str) -> float:
        """`owner`'s admitted tokens per unit of its weight: the lowest is served first."""
        return self._owned[owner] / self.weight(owner)

    def weight(self, owner: str) -> float:
        """`owner`'s weight in the fair share (`--key-weight`; 1 unless given)."""
        return self._weights.get(owner, 1.0)

    def fair_level(self) -> float:
        """The fair share, in tokens per unit of weight: the capacity shared max-min fair
        between the owners that hold or wait, by what each holds plus what its waiters want
        (weighted water-filling: an owner wanting less than its part leaves the rest to the
        others). An owner whose `share` is above it holds more than its fair share, below it
        less; inf: what all want fits."""
        owners = self._owned.keys() | self._queues.keys()
        demands = [self._owned[o] + (q.tokens if (q := self._queues.get(o)) else 0) for o in owners]
        weights = [self.weight(o) for o in owners]
        return water_level(self.capacity, demands, weights)

    # -- inside --------------------------------------------------------------------------------

    def _came_back(self, away_s: float) -> None:
        """A rollout asked again `away_s` after its segment ended: with `ttl_median`, the
        place kept is that multiple of the latest times' median (once `AWAY_SAMPLES_MIN` are
        known), at most `ttl_s`."""
        if self.ttl_median is None:
            return
        self._away.append(away_s)
        if len(self._away) >= AWAY_SAMPLES_MIN:
            self.ttl = min(self.ttl_s, self.ttl_median * statistics.median(self._away))

    def _wanted(self, tokens: int) -> int:
        """What a rollout holding `tokens` is admitted for: `growth` times them (rounded
        first, so that 100 x 1.1 is 110, not 111), but no more than the whole room if they fit
        it (else a rollout that fits would only ever run alone)."""
        if self.growth == 1:
            return tokens
        return max(tokens, min(math.ceil(round(tokens * self.growth, 6)), self.whole))

    def _fits(self, tokens: int) -> bool:
        """Room for a rollout holding `tokens`; or nothing admitted here or elsewhere (a
        rollout larger than the cache is still served, alone)."""
        return self.reserved + self._wanted(tokens) <= self.capacity or (
            self.admitted == 0 and not self.elsewhere
        )

    def _admit(self, entry: Entry) -> None:
        entry.state = State.STREAMING
        self._served[entry.owner] = self._admissions
        self._admissions += 1
        entry.floor = 0 if self.growth == 1 else self._wanted(entry.tokens)
        self.reserved += entry.held
        self._owned[entry.owner] += entry.held
        self.admitted += 1

    def _give_back(self) -> bool:
        """The admitted rollouts outgrew the room: suspended ones (at a tool boundary) give
        their places up, the smallest first (the least to prefill again), until the rest fit;
        one that asks again waits like a new one. Without it, the engine's LRU would evict
        among the admitted ones, each prefilling what another evicted. Returns whether any
        place was given up."""
        victims = sorted(
            (e for e in self._entries.values() if e.state is State.SUSPENDED),
            key=lambda e: (e.held, e.since),
        )
        before = self.overflows
        for victim in victims:
            if self.reserved <= self.capacity:
                break
            self._demote(victim)
            self.overflows += 1
        return self.overflows != before

    def _demote(self, entry: Entry) -> None:
        """A suspended place goes: the rollout asks again, and waits if there is no room."""
        self._unreserve(entry)
        entry.state = State.IDLE

    def _unreserve(self, entry: Entry) -> None:
        self.reserved -= entry.held
        self._owned[entry.owner] -= entry.held
        if not self._owned[entry.owner]:
            del self._owned[entry.owner]
        self.admitted -= 1

    def _resize(self, entry: Entry, tokens: int) -> None:
        """An admitted rollout grew (its appended outputs, its last segment's tokens): past
        what was reserved for it, it holds more."""
        before = entry.held
        entry.tokens = tokens
        self.reserved += entry.held - before
        self._owned[entry.owner] += entry.held - before

    def _enqueue(self, entry: Entry, now: float) -> None:
        entry.state = State.WAITING
        entry.since = now
        entry.order = self._order
        self._order += 1
        queue = self._queues.get(entry.owner)
        if queue is None:
            queue = self._queues[entry.owner] = Queue(self.bypass, self._wanted)
        queue.add(entry)
        self.waiting += 1

    def _dequeue(self, entry: Entry, *, admitted: bool) -> None:
        queue = self._queues[entry.owner]
        queue.remove(entry, admitted=admitted)
        if not queue:
            del self._queues[entry.owner]
            if entry.owner == self._claim:
                self._claim = None
        self.waiting -= 1

    def _pump(self) -> list[Hashable]:
        """Admit waiting rollouts while the next one fits: the owner with the lowest share
        first (on a tie, the one served longest ago), its next in line (`Queue.head`). Strict:
        when that one does not fit, nobody behind it goes (so a large rollout that has been
        passed `bypass` times is not starved by small ones that keep slipping past it), but
        the places its owner's fair share entitles it to are taken back (`_reclaim`)."""
        admitted: list[Hashable] = []
        while (owner := self.next_owner()) is not None:
            head = self._queues[owner].head()
            if not self._fits(head.tokens):
                if self._reclaim(owner, head):
                    continue  # a place less (it may fit now), or its claim dropped
                break
            if owner == self._claim:
                self._claim = None
            self._dequeue(head, admitted=True)
            self._admit(head)
            admitted.append(head.key)
        return admitted

    def _reclaim(self, owner: str, head: Entry) -> bool:
        """`owner`'s next waiter `head` does not fit: if `owner` holds less than its fair share
        (`fair_level`), demote one suspended place of an owner holding more, as a lapse
        would; returns whether it did. Without this, an owner whose tools always come back
        within the TTL would keep its places for ever, however many it holds.

        Taken from the owners above their fair share while they are above it (an owner within
        its share keeps its places), if what they hold past it makes room for `head` once
        their streaming rollouts have suspended too: a place is never taken in vain. If it
        does not (`head` is larger than its owner's share: a cache that holds one or two
        rollouts), and `owner` holds nothing, from every owner that holds anything: the
        owners take turns, a segment each. The owner holding the most per unit of weight
        gives first, its longest-suspended place first (the engine's LRU evicts that one
        first); a streaming rollout gives its place when its segment ends (`suspend`)."""
        mine = self.share(owner)
        level = self.fair_level()
        if not mine < level:  # its share or more: it waits for the room to free itself
            if owner == self._claim:  # no longer owed: the queue's own order again
                self._claim = None
                return True
            return False
        wanted = self._wanted(head.tokens)
        gain = sum(
            held - self.weight(o) * level for o, held in self._owned.items()
            if self.share(o) > level
        )  # fmt: skip
        if self.capacity - self.reserved + gain >= wanted:
            above = level
        elif mine == 0 and (wanted <= self.capacity or not self.elsewhere):
            above = 0.0  # all that is admitted can go: then it fits, alone if it must
        else:
            return False  # its owner's own places first: it waits for them, or for room
        victims = [
            e for e in self._entries.values()
            if e.state is State.SUSPENDED and self.share(e.owner) > above
        ]  # fmt: skip
        if not victims:
            return False  # streaming: each gives its place up when its segment ends
        victim = max(victims, key=lambda e: (self.share(e.owner), -e.since))
        self._demote(victim)
        self.reclaims += 1
        self._claim = owner
        return True

    @property
    def claimant(self) -> str | None:
        """The owner places were taken back for whose rollout is not in yet: it goes next."""
        return self._claim

    def next_in_line(self, owner: str) -> Hashable | None:
        """The key of `owner`'s waiter that goes next (None: it has none)."""
        queue = self._queues.get(owner)
        return None if queue is None else queue.head().key

    def next_owner(self) -> str | None:
        """The owner whose oldest waiting rollout goes next (None: nobody waits): the one
        places were taken back for until its rollout is in, else the lowest share."""
        if not self._queues:
            return None
        if self._claim in self._queues:
            return self._claim
        served = self._served
        return min(self._queues, key=lambda o: (self.share(o), served.get(o, -1)))
