"""Several processes admitting against the same engines (core/shared_capacity.py): each gets
what it holds and its part of the room nobody holds; the parts, computed from the same loads,
never add up past the capacity; the room goes max-min fair by what each waits for."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from proto_server.core.admission_queue import State
from proto_server.core.scheduler import Scheduler
from proto_server.core.shared_capacity import (
    Load,
    capacity_for,
    part_of_room,
    water_fill,
    water_level,
)


def test_when_nobody_waits_the_room_is_shared_in_equal_parts() -> None:
    # 1,000 tokens, 400 held: each of three processes may admit 200 more at once
    assert capacity_for(1000, Load(400, 0), [Load(0, 0), Load(0, 0)]) == 600
    assert capacity_for(1000, Load(0, 0), [Load(400, 0), Load(0, 0)]) == 200


def test_the_room_goes_to_the_heads_smallest_first_then_to_what_each_still_waits_for() -> None:
    """600 free: b's head (100) and c's (300) fit, a's (500) does not after them; the 200
    left go max-min fair by what a (900) and c (700 more) still wait for: 100 each."""
    a, b, c = Load(400, 900, 500, "a"), Load(0, 100, 100, "b"), Load(0, 1000, 300, "c")
    assert capacity_for(1000, a, [b, c]) == 400 + 100
    assert capacity_for(1000, b, [a, c]) == 100
    assert capacity_for(1000, c, [a, b]) == 300 + 100
    # a process that waits for nothing gets none of it while others wait
    assert capacity_for(1000, Load(0, 0), [a]) == 0


def test_two_heads_that_do_not_fit_together_are_not_both_given_a_useless_half() -> None:
    """Halves (500 each) would let neither in; the smaller head goes whole, the other waits."""
    big, small = Load(0, 900, 900, "a"), Load(0, 600, 600, "b")
    assert capacity_for(1000, small, [big]) == 600
    assert capacity_for(1000, big, [small]) == 400


def test_equal_heads_go_by_the_processes_names_in_every_process() -> None:
    one, two = Load(0, 600, 600, "a"), Load(0, 600, 600, "b")
    assert (capacity_for(1000, one, [two]), capacity_for(1000, two, [one])) == (600, 400)


def test_when_the_room_is_gone_what_one_frees_is_not_room_for_more() -> None:
    """Two rollouts grew past the capacity together: the first process may hold what the
    other leaves, 400, not the 700 it holds (its rollouts keep their places regardless)."""
    assert capacity_for(1000, Load(700, 50), [Load(600, 0)]) == 400
    assert capacity_for(1000, Load(0, 50), [Load(1_200, 0)]) == 0


def test_a_process_admits_by_its_part_and_no_further_until_the_next_look() -> None:
    """The scheduler of one process, given its part: a second rollout waits for the room."""
    s = Scheduler(capacity_for(1000, Load(0, 0), [Load(0, 0)]), ttl_s=10)  # 500
    assert s.request("a", "k", 400, now=0).admitted
    assert not s.request("b", "k", 400, now=0).admitted
    assert s.waiting_tokens == 400
    # the other process holds 200 and waits for nothing: all the room left is this one's
    assert s.set_capacity(capacity_for(1000, Load(s.reserved, 400), [Load(200, 0)])) == ["b"]


def test_a_lapsed_place_is_given_up_when_another_process_waits() -> None:
    s = Scheduler(1000, ttl_s=10)
    s.request("a", "k", 400, now=0)
    s.suspend("a", now=0)
    assert s.expire(now=20) == [] and s.reserved == 400  # nobody waits anywhere: kept
    s.expire(now=20, others_wait=True)
    assert s.reserved == 0 and s.demotions == 1


@st.composite
def loads(draw: st.DrawFn, count: int) -> list[Load]:
    """Processes' loads, as their schedulers publish them: a head only where some wait, and
    never more than they wait for; each process its own name."""
    found = []
    for index in range(count):
        waiting = draw(st.integers(0, 5_000))
        head = draw(st.integers(1, waiting)) if waiting else 0
        found.append(Load(draw(st.integers(0, 5_000)), waiting, head, f"p{index}"))
    return found


@given(st.integers(1, 10_000), st.integers(1, 8).flatmap(loads))
def test_parts_computed_from_the_same_loads_never_overcommit(
    capacity: int, processes: list[Load]
) -> None:
    parts = [
        part_of_room(capacity, load, processes[:i] + processes[i + 1 :])
        for i, load in enumerate(processes)
    ]
    assert all(part >= 0 for part in parts)
    assert sum(parts) <= max(0, capacity - sum(load.reserved for load in processes))
    if not any(load.waiting for load in processes):  # equal parts
        assert max(parts) - min(parts) == 0


@given(st.integers(0, 10_000), st.lists(st.integers(0, 3_000), max_size=8))
def test_water_filling_is_max_min_fair(room: int, demands: list[int]) -> None:
    parts = water_fill(room, demands)
    assert sum(parts) <= room
    assert all(0 <= p <= d for p, d in zip(parts, demands, strict=True))
    short = [p for p, d in zip(parts, demands, strict=True) if p < d]
    if short:  # whoever got less than it wants got at least as much as anyone else, give or
        # take the integer division's crumbs, and the room is used but for those crumbs
        assert min(short) >= max(parts) - 1
        assert room - sum(parts) < len(demands)


@given(
    st.integers(0, 10_000),
    st.lists(st.tuples(st.integers(0, 3_000), st.sampled_from([0.5, 1.0, 2.0, 3.0])), max_size=8),
)
def test_the_water_level_is_where_the_weighted_parts_use_the_room_up(
    room: int, wanted: list[tuple[int, float]]
) -> None:
    """The level admission's fair share between keys goes by: each demand gets the least of
    it and its weight times the level, and those add up to the room; with equal weights it is
    the level `water_fill`'s parts come to, but for the integer division's crumbs (one notion
    of fair, for keys and for processes)."""
    demands, weights = [d for d, _ in wanted], [w for _, w in wanted]
    level = water_level(room, demands, weights)
    if sum(demands) <= room:
        assert level == math.inf
        return
    used = sum(min(d, w * level) for d, w in wanted)
    assert math.isclose(used, room, rel_tol=1e-9, abs_tol=1e-6)
    if set(weights) == {1.0}:
        parts = water_fill(room, demands)
        short = [p for p, d in zip(parts, demands, strict=True) if p < d]
        assert short and all(abs(p - level) < 1 for p in short)


def test_a_rollout_larger_than_the_room_runs_alone_only_when_no_process_holds_anything() -> None:
    s = Scheduler(500, ttl_s=10)
    assert s.set_capacity(500, elsewhere=300) == []
    assert not s.request("big", "k", 2_000, now=0).admitted  # another process holds some
    assert s.set_capacity(500, elsewhere=0) == ["big"]  # it let go: the big one runs alone


class ProcessesSharingOneCache(RuleBasedStateMachine):
    """Three processes' schedulers, each taking its part (`capacity_for`) from the loads as
    they are after every change: rollouts arrive anywhere (a waiter is admitted when its
    process's part grows), suspend, resume as they were, are released. However they
    interleave, what the processes admit together never passes the capacity, but for one
    rollout larger than it running alone."""

    CAPACITY = 1_000

    def __init__(self) -> None:
        super().__init__()
        self.processes = [Scheduler(self.CAPACITY, ttl_s=10) for _ in range(3)]
        self.rollouts = 0
        self.look()  # as the server does before it listens

    def look(self) -> None:
        """Each process looks in turn, again while a look admitted someone (the ones that
        looked before would not know: that is the interval's staleness, not checked here)."""
        admitted = True
        while admitted:
            admitted = False
            for index, scheduler in enumerate(self.processes):
                seen = [
                    Load(s.reserved, s.waiting_tokens, s.head_tokens, f"p{i}")
                    for i, s in enumerate(self.processes)
                ]
                others = seen[:index] + seen[index + 1 :]
                admitted |= bool(
                    scheduler.set_capacity(
                        capacity_for(self.CAPACITY, seen[index], others),
                        elsewhere=sum(load.reserved for load in others),
                    )
                )

    @rule(process=st.integers(0, 2), tokens=st.integers(1, 1_200))
    def arrive(self, process: int, tokens: int) -> None:
        self.rollouts += 1
        self.processes[process].request(self.rollouts, "k", tokens, now=0)
        self.look()

    @rule(process=st.integers(0, 2), data=st.data())
    def suspend_and_resume(self, process: int, data: st.DataObject) -> None:
        scheduler = self.processes[process]
        admitted = [k for k in scheduler._entries if scheduler.state(k) is State.STREAMING]
        if admitted:
            key = data.draw(st.sampled_from(admitted))
            scheduler.suspend(key, now=0)
            entry = scheduler.entry(key)
            assert entry is not None
            assert scheduler.request(key, "k", entry.tokens, now=1).resident
            self.look()

    @rule(process=st.integers(0, 2), data=st.data())
    def release(self, process: int, data: st.DataObject) -> None:
        scheduler = self.processes[process]
        if scheduler._entries:
            scheduler.release(data.draw(st.sampled_from(list(scheduler._entries))))
            self.look()

    @invariant()
    def never_past_the_capacity_together(self) -> None:
        reserved = sum(s.reserved for s in self.processes)
        admitted = sum(s.admitted for s in self.processes)
        assert reserved <= self.CAPACITY or admitted == 1, (reserved, admitted)


ProcessesSharingOneCache.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
test_processes_sharing_one_cache = ProcessesSharingOneCache.TestCase
