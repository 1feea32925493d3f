"""The admission scheduler (core/scheduler.py), synchronously: its rules one by one, then its
invariants under hypothesis over arrivals, suspensions, resumptions, releases and TTL expiries."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from proto_server.core.scheduler import Scheduler, State

TTL = 10.0


def test_a_rollout_that_fits_is_admitted_and_one_that_does_not_waits() -> None:
    s = Scheduler(100, ttl_s=TTL)
    assert s.request("a", "k", 60, now=0).admitted
    assert not s.request("b", "k", 60, now=0).admitted
    assert (s.admitted, s.waiting, s.reserved) == (1, 1, 60)
    assert s.release("a") == ["b"]
    assert s.state("b") is State.STREAMING


def test_a_smaller_room_keeps_who_is_admitted_and_a_larger_one_admits_who_waits() -> None:
    """An engine replica went down (the room shrinks) and came back (it grows)."""
    s = Scheduler(100, ttl_s=TTL)
    assert s.request("a", "k", 40, now=0).admitted
    assert s.set_capacity(50) == []
    assert s.state("a") is State.STREAMING  # nothing admitted is taken back
    assert not s.request("b", "k", 40, now=1).admitted
    assert s.set_capacity(100) == ["b"]
    assert (s.admitted, s.waiting, s.reserved) == (2, 0, 80)
    with pytest.raises(ValueError):
        s.set_capacity(-1)
    assert s.set_capacity(0) == [] and not s.request("c", "k", 1, now=2).admitted  # no room


def test_an_admitted_rollout_resumes_at_once_even_grown_past_the_capacity() -> None:
    s = Scheduler(100, ttl_s=TTL)
    s.request("a", "k", 50, now=0)
    s.suspend("a", now=1)
    assert not s.request("b", "k", 60, now=2).admitted  # a keeps its place
    answer = s.request("a", "k", 120, now=3)
    assert answer.admitted and answer.resident
    assert s.reserved == 120


def test_with_growth_a_rollout_is_admitted_for_what_it_will_hold() -> None:
    """`--admission-growth 2`: 40 tokens are admitted for 80, reserved until they are more, so
    a second 40 waits for the room the first will grow into; released, all of it is free."""
    s = Scheduler(100, ttl_s=TTL, growth=2)
    assert s.request("a", "k", 40, now=0).admitted
    assert s.reserved == 80 and s.head_tokens == 0
    assert not s.request("b", "k", 40, now=0).admitted  # 80 + 80 > 100
    assert (s.head_tokens, s.waiting_tokens) == (80, 80)  # what b wants, for other processes
    s.suspend("a", now=1)
    assert s.request("a", "k", 70, now=2).resident and s.reserved == 80  # grew into its room
    s.suspend("a", now=3)
    assert s.request("a", "k", 90, now=4).resident and s.reserved == 90  # and past it
    assert s.release("a") == ["b"] and s.reserved == 80
    with pytest.raises(ValueError):
        Scheduler(100, ttl_s=TTL, growth=0.5)


def test_with_growth_what_is_reserved_is_exact_and_at_most_the_room() -> None:
    s = Scheduler(220, ttl_s=TTL, growth=1.1)
    assert s.request("a", "k", 100, now=0).admitted and s.reserved == 110  # not 111
    assert s.request("b", "k", 100, now=0).admitted and s.reserved == 220
    s = Scheduler(100, ttl_s=TTL, growth=2)
    assert s.request("a", "k", 60, now=0).admitted and s.reserved == 100  # the room, not 120
    assert not s.request("b", "k", 1, now=0).admitted
    assert not s.request("c", "k", 1, now=0).admitted
    assert s.waiting_tokens == 2 + 2  # each waiter's own reservation, added up


def test_without_growth_a_rollout_that_shrinks_holds_less() -> None:
    """Compaction shrinks a conversation: with growth 1 what is reserved follows it down."""
    s = Scheduler(100, ttl_s=TTL)
    s.request("a", "k", 80, now=0)
    s.suspend("a", now=1)
    s.request("a", "k", 30, now=2)
    assert s.reserved == 30 and s.request("b", "k", 70, now=2).admitted


def test_a_suspended_place_lapses_after_the_ttl_only_when_someone_waits() -> None:
    s = Scheduler(100, ttl_s=TTL)
    s.request("a", "k", 80, now=0)
    s.suspend("a", now=0)
    assert s.expire(now=100) == []  # nobody waits: a keeps its place
    assert s.state("a") is State.SUSPENDED
    answer = s.request("b", "k", 80, now=100)  # the lapsed place goes to b at once
    assert answer.admitted and not answer.resident
    assert s.state("a") is State.IDLE and s.demotions == 1
    assert not s.request("a", "k", 80, now=101).admitted  # back: it waits like a new one


def test_a_waiter_learns_when_the_next_place_lapses() -> None:
    s = Scheduler(100, ttl_s=TTL)
    s.request("a", "k", 80, now=0)
    s.suspend("a", now=3)
    s.request("b", "k", 80, now=4)
    assert s.next_expiry() == 3 + TTL
    assert s.expire(now=3 + TTL - 0.5) == []
    assert s.expire(now=3 + TTL) == ["b"]


def test_a_resumed_rollout_that_grew_can_make_another_keys_waiter_next() -> None:
    """Found by hypothesis: a's growth makes key a's share the larger, so key b's small
    waiter is next and fits; it was left waiting until something else changed."""
    s = Scheduler(100, ttl_s=TTL, bypass=0)
    s.request("a1", "a", 10, now=0)
    s.request("b1", "b", 20, now=0)
    s.request("a2", "a", 80, now=0)  # waits: 110 > 100
    s.request("b2", "b", 5, now=0)  # waits behind a2: a's share (10) is less than b's (20)
    s.suspend("a1", now=1)
    answer = s.request("a1", "a", 30, now=2)  # back, grown: a's share is now 30
    assert answer.admitted and answer.resident and answer.woken == ("b2",)
    assert s.state("a2") is State.WAITING


def test_a_rollout_larger_than_the_cache_is_served_alone() -> None:
    s = Scheduler(100, ttl_s=TTL)
    assert s.request("huge", "k", 500, now=0).admitted
    assert not s.request("small", "k", 1, now=0).admitted
    assert s.release("huge") == ["small"]


def test_with_no_bypass_the_queue_is_first_come_first_served_within_a_key_and_strict() -> None:
    s = Scheduler(100, ttl_s=TTL, bypass=0)
    s.request("a", "k", 100, now=0)
    s.request("big", "k", 90, now=1)
    s.request("small", "k", 5, now=2)  # fits beside nothing but would slip past big: it waits
    assert s.state("small") is State.WAITING
    assert s.release("a") == ["big", "small"]


def test_the_smallest_waiter_goes_first_and_the_oldest_is_passed_at_most_bypass_times() -> None:
    """Smallest first packs more rollouts at once; the bound keeps a large one from starving
    behind small ones that keep coming."""
    s = Scheduler(100, ttl_s=TTL, bypass=2)
    s.request("a", "k", 100, now=0)
    s.request("big", "k", 95, now=1)
    for i in range(4):
        s.request(("small", i), "k", 10, now=2 + i)
    assert s.next_in_line("k") == ("small", 0)
    assert s.release("a") == [("small", 0), ("small", 1)]  # big is passed twice; then it is
    assert s.next_in_line("k") == "big"  # next, and nobody passes it while it does not fit
    assert s.state(("small", 2)) is State.WAITING
    assert s.release(("small", 0)) == [] and s.release(("small", 1)) == ["big"]
    assert s.next_in_line("k") == ("small", 2)


def test_a_waiter_asking_again_with_other_tokens_keeps_its_arrival_and_takes_its_new_size() -> None:
    s = Scheduler(100, ttl_s=TTL, bypass=5)
    s.request("a", "k", 100, now=0)
    s.request("b", "k", 30, now=1)
    s.request("c", "k", 20, now=2)
    assert s.next_in_line("k") == "c"
    assert not s.request("c", "k", 40, now=3).admitted  # grew while it waited
    assert s.next_in_line("k") == "b"
    assert s.release("a") == ["b", "c"]


def test_a_waiter_asking_again_and_again_does_not_grow_the_queue_past_its_waiters() -> None:
    s = Scheduler(100, ttl_s=TTL, bypass=5)
    s.request("a", "k", 100, now=0)
    s.request("b", "k", 30, now=1)
    for tokens in range(1, 1_000):
        s.request("c", "k", tokens, now=2)
    queue = s._queues["k"]
    assert len(queue._sizes) <= 2 * len(queue) + 16
    assert s.next_in_line("k") == "b"  # c holds 999 now
    assert s.release("a") == ["b"]


def test_the_key_with_the_least_admitted_share_goes_first() -> None:
    s = Scheduler(100, ttl_s=TTL)
    for i in range(10):
        s.request(("a", i), "ka", 50, now=i)
    s.request("b", "kb", 50, now=20)  # arrives after all of a's
    assert s.release(("a", 0)) == ["b"]  # kb holds nothing, ka holds 50: kb first
    assert s.release(("a", 1)) == [("a", 2)]


def test_weights_give_a_key_a_larger_share() -> None:
    """Weight 3 against 1, both keys always waiting: the heavy key holds most of the cache."""
    s = Scheduler(40, ttl_s=TTL, weights={"heavy": 3.0})
    running = []
    for i in range(200):
        key = ("heavy" if i < 100 else "light", i)
        if s.request(key, key[0], 10, now=0).admitted:
            running.append(key)
    held = []
    for _ in range(40):  # the oldest running one ends; the queue fills its place
        running += s.release(running.pop(0))
        held.append(s.owned("heavy") / s.reserved)
    assert 0.65 <= sum(held) / len(held) <= 0.8  # with equal weights: 0.5
    assert min(held[5:]) >= 0.5 and s.owned("light") > 0


def test_a_released_waiter_leaves_the_queue() -> None:
    s = Scheduler(100, ttl_s=TTL)
    s.request("a", "k", 100, now=0)
    s.request("b", "k", 50, now=0)
    s.request("c", "k", 50, now=0)
    assert s.release("b") == []
    assert s.waiting == 1
    assert s.release("a") == ["c"]


def _away(s: Scheduler, times: list[float], now: float = 0.0) -> float:
    """Rollouts that suspend and come back after each of `times`; returns the clock after."""
    for i, away in enumerate(times):
        key = ("away", i)
        s.request(key, "k", 1, now=now)
        s.suspend(key, now=now)
        now += away
        s.request(key, "k", 1, now=now)  # back: its time away is counted
        s.release(key)
    return now


def test_with_ttl_median_a_place_is_kept_that_multiple_of_the_median_time_away() -> None:
    """Tools that take about a second: a place is kept K seconds, not the whole TTL; until
    16 rollouts came back, the TTL alone holds; the TTL stays the most."""
    s = Scheduler(100, ttl_s=TTL, ttl_median=3.0)
    now = _away(s, [1.0] * 15)
    assert s.ttl == TTL  # 15 seen: not enough to go by
    now = _away(s, [1.0, 0.5, 2.0, 1.0, 9.0], now)
    assert s.ttl == 3.0  # 3 x the median (1 s); the one long wait moves it not
    s.request("a", "k", 80, now=now)
    s.suspend("a", now=now)
    s.request("b", "k", 80, now=now + 1)
    assert s.next_expiry() == now + 3.0
    assert s.expire(now=now + 3.0) == ["b"]  # a's place lapsed after 3 s, not 10
    assert s.state("a") is State.IDLE and s.demotions == 1
    _away(s, [100.0] * 40, now + 4)
    assert s.ttl == TTL  # tools got slow: the TTL caps it


def test_without_ttl_median_the_time_away_changes_nothing() -> None:
    s = Scheduler(100, ttl_s=TTL)
    _away(s, [0.1] * 50)
    assert s.ttl == TTL


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Scheduler(0, ttl_s=TTL)
    with pytest.raises(ValueError):
        Scheduler(10, ttl_s=0)
    with pytest.raises(ValueError):
        Scheduler(10, ttl_s=TTL, ttl_median=0)
    with pytest.raises(ValueError):
        Scheduler(10, ttl_s=TTL, bypass=-1)


OWNERS = ("a", "b", "c")
CAPACITY = 100


class Admissions(RuleBasedStateMachine):
    """Any sequence of what the server tells the scheduler keeps its promises."""

    BYPASS = 0

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(CAPACITY, ttl_s=TTL, weights={"c": 2.0}, bypass=self.BYPASS)
        self.now = 0.0
        self.keys = itertools.count()
        self.owner: dict[int, str] = {}
        self.queued: dict[str, list[int]] = {o: [] for o in OWNERS}  # arrival order per owner
        self.tokens: dict[int, int] = {}
        #: Per owner, how many were admitted past its oldest waiter since it became the oldest.
        self.passed: collections.Counter[str] = collections.Counter()

    def _next(self, owner: str) -> int:
        """Who the queue discipline says goes next in `owner`'s queue."""
        queue = self.queued[owner]
        if self.passed[owner] >= self.BYPASS:
            return queue[0]
        return min(queue, key=lambda k: (self.tokens[k], queue.index(k)))

    def _leaves(self, key: int, *, admitted: bool) -> None:
        owner = self.owner[key]
        queue = self.queued[owner]
        if queue[0] == key:
            self.passed[owner] = 0
        elif admitted:
            self.passed[owner] += 1
            assert self.passed[owner] <= self.BYPASS  # the oldest is passed at most BYPASS times
        queue.remove(key)

    # -- what happens ----------------------------------------------------------------------

    def _ask(self, key: int, tokens: int) -> None:
        was = self.s.state(key)
        before = (self.s.admitted, self.s.reserved)
        self.tokens[key] = tokens
        answer = self.s.request(key, self.owner[key], tokens, self.now)
        if was in (State.STREAMING, State.SUSPENDED):
            assert answer.admitted and answer.resident  # an admitted rollout never waits
            self._admitted(list(answer.woken), before)  # its growth may change who is next
            return
        if was is not State.WAITING:
            self.queued[self.owner[key]].append(key)
        admitted = ([key] if answer.admitted else []) + list(answer.woken)
        self._admitted(admitted, before)

    def _admitted(self, keys: list[int], before: tuple[int, int]) -> None:
        for key in keys:
            assert key == self._next(self.owner[key])  # the queue's discipline within a key
            self._leaves(key, admitted=True)
            assert self.s.state(key) is State.STREAMING
        if keys:  # the server's own admissions never overcommit, but for one rollout alone
            assert self.s.reserved <= CAPACITY or self.s.admitted == 1, (before, keys)

    @rule(owner=st.sampled_from(OWNERS), tokens=st.integers(1, 150))
    def arrive(self, owner: str, tokens: int) -> None:
        key = next(self.keys)
        self.owner[key] = owner
        self._ask(key, tokens)

    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        streaming = self._in(State.STREAMING)
        if streaming:
            self.s.suspend(data.draw(st.sampled_from(streaming)), self.now)

    @rule(data=st.data(), grow=st.integers(0, 60))
    def resume(self, data: st.DataObject, grow: int) -> None:
        suspended = self._in(State.SUSPENDED)
        if suspended:
            key = data.draw(st.sampled_from(suspended))
            entry = self.s.entry(key)
            assert entry is not None
            self._ask(key, entry.tokens + grow)

    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        idle = self._in(State.IDLE)
        if idle:
            key = data.draw(st.sampled_from(idle))
            entry = self.s.entry(key)
            assert entry is not None
            self._ask(key, entry.tokens)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        keys = sorted(self.owner)
        if keys:
            key = data.draw(st.sampled_from(keys))
            if self.s.state(key) is State.WAITING:
                self._leaves(key, admitted=False)
            before = (self.s.admitted, self.s.reserved)
            del self.owner[key]
            self._admitted(self.s.release(key), before)

    @rule(dt=st.floats(0, 2 * TTL))
    def wait(self, dt: float) -> None:
        self.now += dt
        before = (self.s.admitted, self.s.reserved)
        self._admitted(self.s.expire(self.now), before)

    def _in(self, state: State) -> list[int]:
        return [k for k in sorted(self.owner) if self.s.state(k) is state]

    # -- what always holds ---------------------------------------------------------------------

    @invariant()
    def counts_agree(self) -> None:
        entries = [e for k in self.owner if (e := self.s.entry(k)) is not None]
        assert self.s.reserved == sum(e.held for e in entries if e.admitted)
        assert all(e.held >= e.tokens for e in entries)
        assert self.s.admitted == sum(e.admitted for e in entries)
        assert self.s.waiting == sum(e.state is State.WAITING for e in entries)

    @invariant()
    def no_room_is_left_idle(self) -> None:
        """Nobody waits while the next in line would fit: no rollout waits for nothing."""
        owner = self.s.next_owner()
        if owner is not None:
            head = self._next(owner)
            assert self.s.next_in_line(owner) == head
            entry = self.s.entry(head)
            assert entry is not None
            grown = math.ceil(round(entry.tokens * self.s.growth, 6))
            wanted = max(entry.tokens, min(grown, CAPACITY))
            assert self.s.reserved + wanted > CAPACITY and self.s.admitted > 0
            shares = [self.s.share(o) for o in OWNERS if self.queued[o]]
            assert self.s.share(owner) == min(shares)  # the least served key is next

    def teardown(self) -> None:
        """No rollout starves: once the admitted ones go, every waiting one is served."""
        for _ in range(len(self.owner) + 1):
            admitted = [k for k in sorted(self.owner) if (e := self.s.entry(k)) and e.admitted]
            if not admitted:
                break
            for key in admitted:
                del self.owner[key]
                self._admitted(self.s.release(key), (0, 0))
        assert self.s.waiting == 0


TestAdmissions = Admissions.TestCase
TestAdmissions.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class AdmissionsSmallestFirst(Admissions):
    """The same promises, and the bound on passing, when the smallest waiter goes first."""

    BYPASS = 2


TestAdmissionsSmallestFirst = AdmissionsSmallestFirst.TestCase
TestAdmissionsSmallestFirst.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


class AdmissionsWithALearnedTtl(Admissions):
    """The same promises when places are kept a multiple of the median time away."""

    BYPASS = 1

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(CAPACITY, ttl_s=TTL, ttl_median=2.0, weights={"c": 2.0}, bypass=1)

    @invariant()
    def the_place_kept_is_never_longer_than_the_ttl(self) -> None:
        assert 0 <= self.s.ttl <= TTL


TestAdmissionsWithALearnedTtl = AdmissionsWithALearnedTtl.TestCase
TestAdmissionsWithALearnedTtl.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None
)


class AdmissionsWithGrowth(Admissions):
    """The same promises when each rollout is admitted for 1.5 times what it holds."""

    BYPASS = 1

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(CAPACITY, ttl_s=TTL, weights={"c": 2.0}, bypass=1, growth=1.5)


TestAdmissionsWithGrowth = AdmissionsWithGrowth.TestCase
TestAdmissionsWithGrowth.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
