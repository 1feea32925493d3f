"""Routing rollouts over engine replicas (core/routing.py): affinity, balance, failover."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proto_server.core import routing
from proto_server.core.routing import NoReplicaUp, Placement, Router


def test_a_rollout_stays_on_the_replica_that_holds_its_prefix() -> None:
    router = Router(2)
    first = router.place("a", 100)
    router.place("b", 10)
    router.place("c", 10)  # replica 1 holds less than a's 100: c goes there too
    assert router.place("a", 5_000) == first  # grown past everyone: still home
    assert router.replica_of("c") == router.replica_of("b") != first.replica


def test_new_rollouts_go_where_the_load_is_lowest() -> None:
    router = Router(3)
    spread = [router.place(key, 100).replica for key in "abc"]
    assert sorted(spread) == [0, 1, 2]
    router.release("b")
    assert router.place("d", 100).replica == spread[1]  # the freed one


def test_a_new_session_of_a_named_rollout_goes_where_the_last_one_went() -> None:
    router = Router(2)
    first = router.place("turn 1", 1_000, affinity="rollout-7")
    router.release("turn 1")  # the connection closed between turns
    router.place("other", 10)  # now replica 1 - first holds the least...
    assert router.place("turn 2", 1_100, affinity="rollout-7") == first  # ...but 7 goes home
    assert router.place("turn 3", 10, affinity="rollout-8").replica != first.replica


def test_a_named_rollout_whose_replica_went_down_goes_where_the_load_is_lowest() -> None:
    router = Router(2)
    first = router.place("turn 1", 1_000, affinity="r")
    router.release("turn 1")
    router.down(first.replica)
    assert router.place("turn 2", 1_000, affinity="r") == Placement(1 - first.replica)
    router.up(first.replica)
    assert router.place("turn 3", 1_000, affinity="r") == Placement(1 - first.replica)


def test_the_rollout_ids_remembered_are_bounded_the_oldest_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routing, "AFFINITIES", 2)
    router = Router(2)
    homes = {name: router.place(name, 100, affinity=name).replica for name in "abc"}
    for name in "abc":
        router.release(name)
    router.place("load", 1_000)  # replica 0 now holds the most
    assert router.place("a again", 1, affinity="a").replica == 1  # forgotten: least loaded
    assert router.place("c again", 1, affinity="c").replica == homes["c"]


def test_load_is_a_share_of_capacity_when_capacities_are_known() -> None:
    router = Router(2, capacities=[1_000, 4_000])
    assert router.place("a", 500).replica == 0
    assert router.place("b", 500).replica == 1  # 0.5 of replica 0 against 0 of replica 1
    assert router.place("c", 500).replica == 1  # 0.5 against 0.125


def test_a_rollout_on_a_replica_that_went_down_moves_and_says_from_where() -> None:
    router = Router(2)
    home = router.place("a", 100).replica
    router.down(home)
    moved = router.place("a", 120)
    assert moved == Placement(1 - home, moved_from=home)
    assert router.place("a", 130) == Placement(1 - home)  # moved once, at home now
    assert router.tokens[home] == 0 and router.tokens[1 - home] == 130
    assert router.moves == 1


def test_a_replica_that_comes_back_is_given_new_work() -> None:
    router = Router(2)
    router.down(0)
    assert [router.place(k, 100).replica for k in "ab"] == [1, 1]
    router.up(0)
    assert router.place("c", 100).replica == 0
    assert router.place("a", 100).replica == 1  # affinity holds: it is warm where it is


def test_a_rollout_whose_replica_went_down_and_came_back_is_told_its_prefix_is_lost() -> None:
    router = Router(2)
    home = router.place("a", 100).replica
    router.down(home)
    router.up(home)  # restarted before the rollout asked again: its cache is empty
    assert router.place("a", 100).moved_from == home
    router.down(1 - home)
    router.down(1 - home)  # said twice (two probes): one loss, not two
    router.up(1 - home)
    assert router.place("b", 10).moved_from is None


def test_with_every_replica_down_nothing_is_placed() -> None:
    router = Router(1)
    router.place("a", 1)
    router.down(0)
    with pytest.raises(NoReplicaUp):
        router.place("a", 1)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        Router(0)
    with pytest.raises(ValueError, match="capacities"):
        Router(2, capacities=[10])
    with pytest.raises(ValueError, match="capacities"):
        Router(2, capacities=[10, 0])


operations = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 7), st.integers(0, 10_000)),
        st.tuples(st.just("release"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("down"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("up"), st.integers(0, 2), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations)
# a rollout whose replica went down and came back is placed without its stale tokens counted
@example([("place", 1, 0), ("place", 0, 1), ("down", 1, 0), ("place", 1, 1), ("place", 2, 1),
          ("up", 1, 0), ("place", 0, 0)])  # fmt: skip
def test_the_accounts_hold_and_nothing_goes_to_a_replica_that_is_down(
    ops: list[tuple[str, int, int]],
) -> None:
    router = Router(3)
    held: dict[int, tuple[int, int]] = {}  # key -> (replica, tokens): the model
    lost: set[int] = set()  # keys whose replica went down since they were placed
    for op, arg, tokens in ops:
        if op == "place":
            if not any(router.is_up(r) for r in range(3)):
                with pytest.raises(NoReplicaUp):
                    router.place(arg, tokens)
                continue
            before = held.get(arg)
            placement = router.place(arg, tokens)
            assert router.is_up(placement.replica)
            if before is not None and router.is_up(before[0]) and arg not in lost:
                assert placement == Placement(before[0])  # affinity
            else:
                assert placement.moved_from == (before[0] if before else None)
                loads = [router.tokens[r] - (tokens if r == placement.replica else 0)
                         for r in range(3)]  # fmt: skip
                assert all(
                    loads[placement.replica] <= loads[r] for r in range(3) if router.is_up(r)
                )  # it went where the least was
            held[arg] = (placement.replica, tokens)
            lost.discard(arg)
        elif op == "release":
            router.release(arg)
            held.pop(arg, None)
            lost.discard(arg)
        elif op == "down":
            router.down(arg)
            lost |= {key for key, (replica, _) in held.items() if replica == arg}
        else:
            router.up(arg)
        for r in range(3):
            assert router.tokens[r] == sum(t for (rr, t) in held.values() if rr == r)
            assert router.rollouts[r] == sum(1 for (rr, _) in held.values() if rr == r)
