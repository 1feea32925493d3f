"""`bench agents`' traffic shapes: each plan is the seed's alone, and over a large draw each
published shape has the medians and percentiles it states, scaled as it says. No engine, no
server, no clock."""

from __future__ import annotations

import itertools
import random
import statistics

import attrs
import pytest
from proto_server_bench.agents import AgentsSettings, make_agents, percentile
from proto_server_bench.shapes import (
    AGENTPERF,
    CODEX_GAP_MEDIAN_S,
    CODEX_GAP_P99_S,
    CODING_FOLLOWUPS,
    FOLLOWUPS_WITHIN_1S,
    PUBLISHED,
    SHAPE_NAMES,
    SWE_BENCH_PRO,
    TIME_SCALE,
    TOKENS_SCALE,
    TURNS_SCALE,
    AtOnce,
    ClosedLoop,
    LogNormal,
    Poisson,
    RolloutPlan,
    Shape,
    Writer,
    draw,
    lognormal,
)

#: Rollouts in a large draw: with ~7 tools each, over 10,000 tool times and outputs.
LARGE = 1500


def _waits(plans: tuple[RolloutPlan, ...]) -> list[float]:
    return [wait for plan in plans for wait in plan.waits_s]


def _sizes(plans: tuple[RolloutPlan, ...]) -> list[int]:
    return [size for plan in plans for size in plan.tool_tokens]


@pytest.mark.parametrize("shape", list(PUBLISHED.values()), ids=list(PUBLISHED))
def test_a_plan_is_the_seeds_alone(shape: Shape) -> None:
    assert draw(shape, 7) == draw(shape, 7)
    assert draw(shape, 7) != draw(shape, 8)
    for plan in draw(shape, 7):
        assert len(plan.tool_tokens) == len(plan.waits_s) == plan.turns - 1
        assert all(size >= 1 for size in plan.tool_tokens) and all(w > 0 for w in plan.waits_s)


def test_the_larger_shapes_have_at_least_24_rollouts() -> None:
    assert SHAPE_NAMES == ("burst", "poisson", "swe-bench-pro", "coding-followups", "agentperf")
    for shape in PUBLISHED.values():
        assert shape.rollouts >= 24 and len(draw(shape, 2)) == shape.rollouts


class Consuming:
    """A `Writer` that takes from the stream as writing texts does."""

    def context(self, rng: random.Random, index: int) -> None:
        rng.getrandbits(64 + index)

    def output(self, rng: random.Random, tokens: int) -> None:
        for _ in range(tokens // 10):
            rng.random()


@pytest.mark.parametrize("writer", [None, Consuming()], ids=["plan alone", "written"])
def test_swe_bench_pro_keeps_the_codex_gaps_shape_scaled_in_time(writer: Writer | None) -> None:
    """Alone or written between its draws, the plan has the stated median and p99."""
    waits = _waits(draw(SWE_BENCH_PRO, 3, LARGE, writer))
    assert len(waits) >= 10_000
    median, p99 = CODEX_GAP_MEDIAN_S / TIME_SCALE, CODEX_GAP_P99_S / TIME_SCALE
    assert median == pytest.approx(1.0) and p99 == pytest.approx(15.65, abs=0.01)
    assert percentile(waits, 0.5) == pytest.approx(median, rel=0.1)
    assert percentile(waits, 0.99) == pytest.approx(p99, rel=0.2)


def test_the_coding_shapes_scale_the_codex_turns_and_tokens() -> None:
    for shape in PUBLISHED.values():
        plans = draw(shape, 4, LARGE)
        turns = [plan.turns for plan in plans]
        assert statistics.median(turns) == round(33 / TURNS_SCALE)
        assert min(turns) >= shape.min_turns and max(turns) <= shape.max_turns
        sizes = _sizes(plans)
        assert percentile(sizes, 0.5) == pytest.approx(2242 / TOKENS_SCALE, rel=0.1)
        assert percentile(sizes, 0.99) == pytest.approx(3 * 2242 / TOKENS_SCALE, rel=0.2)


def test_coding_followups_come_within_a_second_as_often_as_published() -> None:
    waits = _waits(draw(CODING_FOLLOWUPS, 5, LARGE))
    within = sum(wait <= 1.0 for wait in waits) / len(waits)
    assert within == pytest.approx(FOLLOWUPS_WITHIN_1S, abs=0.015)
    # the Codex gaps' spread: P99 over median as theirs
    ratio = percentile(waits, 0.99) / percentile(waits, 0.5)
    assert ratio == pytest.approx(CODEX_GAP_P99_S / CODEX_GAP_MEDIAN_S, rel=0.25)


def test_agentperf_tools_take_a_second_at_the_median() -> None:
    assert percentile(_waits(draw(AGENTPERF, 6, LARGE)), 0.5) == pytest.approx(1.0, rel=0.1)


def test_poisson_arrivals_are_ordered_within_the_horizon_at_the_rate() -> None:
    plans = draw(CODING_FOLLOWUPS, 9, LARGE)
    assert isinstance(CODING_FOLLOWUPS.arrivals, Poisson)
    rate = CODING_FOLLOWUPS.arrivals.rate_per_s
    starts = [plan.at_s for plan in plans]
    assert starts == sorted(starts)
    assert starts[0] >= 0 and starts[-1] <= LARGE / rate
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.1)
    # a Poisson process: the gaps are exponential, their median ln 2 of their mean
    assert statistics.median(gaps) == pytest.approx(0.693 / rate, rel=0.15)
    assert [plan.agent for plan in plans] == list(range(LARGE))  # each rollout on its own


def test_a_closed_loop_runs_each_agents_rollouts_one_after_another() -> None:
    assert AGENTPERF.arrivals == ClosedLoop(8)
    plans = draw(AGENTPERF, 2)
    assert [plan.agent for plan in plans] == [i % 8 for i in range(24)]
    assert {plan.at_s for plan in plans} == {0.0}
    assert SWE_BENCH_PRO.arrivals == AtOnce()
    assert {(plan.agent, plan.at_s) for plan in draw(SWE_BENCH_PRO, 2)} == {
        (i, 0.0) for i in range(24)
    }


def test_burst_and_poisson_take_the_flags() -> None:
    burst = AgentsSettings(rollouts=5, turns=3, seed=4).traffic
    assert (burst.name, burst.arrivals, burst.context_tokens) == ("burst", AtOnce(), 450)
    plans = draw(burst, 4, 5)
    assert [plan.turns for plan in plans] == [3] * 5 and {p.at_s for p in plans} == {0.0}
    poisson = AgentsSettings(shape="poisson", arrival_rate=2.0).traffic
    assert poisson.arrivals == Poisson(2.0)
    starts = [plan.at_s for plan in draw(poisson, 4, 6)]
    assert starts == sorted(starts) and 0 < starts[-1] <= 6 / 2.0
    assert AgentsSettings().rollout_count == 6
    assert AgentsSettings(shape="agentperf").rollout_count == 24
    assert AgentsSettings(shape="agentperf", rollouts=32).rollout_count == 32


def test_a_published_shape_refuses_the_flags_it_draws_itself() -> None:
    assert AgentsSettings(shape="swe-bench-pro").problems() == []
    problems = AgentsSettings(shape="swe-bench-pro", turns=9, wait_s=(2.0, 3.0)).problems()
    assert problems == [
        "--turns: --shape swe-bench-pro draws its own (burst and poisson take it)",
        "--wait-s: --shape swe-bench-pro draws its own (burst and poisson take it)",
    ]
    assert AgentsSettings(arrival_rate=3.0).problems() == [
        "--arrival-rate: only --shape poisson takes it"
    ]


def test_the_rollouts_follow_their_shape_and_burst_is_the_workload_it_was() -> None:
    def count(text: str) -> int:
        return len(text.split())

    settings = AgentsSettings(shape="agentperf", seed=3)
    agents = make_agents(settings, count, "n")
    assert agents == make_agents(settings, count, "n")
    assert [(a.agent, a.at_s) for a in agents] == [(i % 8, 0.0) for i in range(24)]
    turns = [a.turns for a in agents]
    assert len(set(turns)) > 1 and all(2 <= t <= AGENTPERF.max_turns for t in turns)
    for agent in agents:
        assert len(agent.waits_s) == agent.turns - 1
        assert count(agent.context) >= AGENTPERF.context_tokens
    # the texts are written between the draws, as before there were shapes: seed 2's burst
    # (the default, and the figures docs/benchmarks.md shows) draws the waits it always drew
    burst = make_agents(AgentsSettings(), count, "n")
    assert [round(w, 4) for w in burst[0].waits_s] == [10.8881, 0.1566, 0.9806]
    assert [round(w, 4) for w in burst[5].waits_s] == [1.3568, 0.3997, 2.288]


def test_a_log_normal_is_given_by_its_median_and_p99() -> None:
    with pytest.raises(ValueError, match="median <= p99"):
        LogNormal(2.0, 1.0)
    with pytest.raises(ValueError, match="max_turns 3 < min_turns 4"):
        attrs.evolve(SWE_BENCH_PRO, min_turns=4, max_turns=3)
    assert LogNormal(3.0, 3.0).draw(random.Random(0)) == 3.0  # no spread: the median
    assert lognormal(random.Random(1), 1.0, 15.0) == LogNormal(1.0, 15.0).draw(random.Random(1))
