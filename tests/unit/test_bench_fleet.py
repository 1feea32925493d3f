"""`proto-server bench fleet`, reduced: the virtual-time simulation of the server's scheduler on
modelled replicas. Small seeded runs; nothing here reads a clock (the CPU time it reports is
never asserted)."""

from __future__ import annotations

from pathlib import Path

import attrs
import orjson
import pytest
from proto_server_bench.fleet import (
    CONTINUUM,
    PLOTS,
    POLICIES,
    THUNDERAGENT,
    FleetSettings,
    make_rollouts,
    unbounded_need,
)
from proto_server_bench.fleet_policies import BUFFER_PER_PROGRAM, ContinuumPins, ThunderAgent
from proto_server_bench.fleet_replica import EngineSequence, Replica
from proto_server_bench.fleet_simulate import PolicyRun, simulate

from proto_server.cli import main
from proto_server.core.ranges import InvalidSetting
from proto_server.engine.prefix_cache import PrefixCache

SMALL = FleetSettings(
    rollouts=24, replicas=2, turns=(4.0, 8.0), shared_tokens=256, context_tokens=(600.0, 1800.0),
    tool_tokens=(150.0, 600.0), output_tokens=(24.0, 64.0), cache_tokens=1 << 30,
)  # fmt: skip


def _run(settings: FleetSettings, policy: str) -> PolicyRun:
    return attrs.evolve(simulate(settings, make_rollouts(settings), policy), cpu_s=0.0)


def test_a_seed_gives_the_same_workload_and_the_same_run() -> None:
    tight = attrs.evolve(SMALL, cache_tokens=4096)
    assert make_rollouts(tight) == make_rollouts(tight)
    assert make_rollouts(tight) != make_rollouts(attrs.evolve(tight, seed=3))
    for policy in POLICIES:
        assert _run(tight, policy) == _run(tight, policy)


def test_with_an_unbounded_cache_the_policies_hit_alike_and_prefill_only_what_is_new() -> None:
    one = attrs.evolve(SMALL, replicas=1)
    runs = [_run(one, policy) for policy in POLICIES]
    need = unbounded_need(make_rollouts(one), one, 1)
    assert {r.prompt_tokens for r in runs} == {runs[0].prompt_tokens}
    assert {r.cached_tokens for r in runs} == {runs[0].cached_tokens}
    assert all(r.prefilled_tokens == need == r.unbounded_need_tokens for r in runs)
    assert all(r.evictions == 0 and r.preemptions == 0 for r in runs)
    # On several replicas, a rollout kept on its replica still prefills only what is new.
    for policy in ("affinity", CONTINUUM, THUNDERAGENT, "proto-server"):
        run = _run(SMALL, policy)
        assert run.prefilled_tokens == run.unbounded_need_tokens


def test_with_a_cache_too_small_plain_forwarding_prefills_more_than_the_servers_policy() -> None:
    tight = attrs.evolve(SMALL, cache_tokens=4096)
    working_set = sum(r.prompt(len(r.output_tokens), tight.shared_tokens)
                      for r in make_rollouts(tight))  # fmt: skip
    assert working_set > 3 * tight.cache_tokens * tight.replicas
    plain, proto = _run(tight, "plain"), _run(tight, "proto-server")
    assert plain.prefilled_tokens > proto.prefilled_tokens > proto.unbounded_need_tokens
    assert plain.evictions > proto.evictions
    assert proto.demotions >= 0 and len(proto.jct_s) == tight.rollouts


def test_admitted_for_their_growth_rollouts_evict_each_other_less() -> None:
    """--admission-growth: the server's reservation for growth, in the same simulation."""
    tight = attrs.evolve(SMALL, cache_tokens=4096)
    now, reserved = (
        _run(tight, "proto-server"),
        _run(attrs.evolve(tight, growth=2.0), "proto-server"),
    )
    assert reserved.evictions < now.evictions
    assert reserved.prefilled_tokens < now.prefilled_tokens
    assert len(reserved.jct_s) == tight.rollouts  # every rollout still ends
    with pytest.raises(InvalidSetting, match=r"growth must be between 1 and 100, got 0\.5"):
        attrs.evolve(tight, growth=0.5)


def test_a_place_kept_a_short_multiple_of_the_time_away_demotes_more() -> None:
    """--ttl-median: the server's learned place, in the same simulation; the workload's waits
    are the same, so a place kept less than its fixed TTL lapses more often."""
    tight = attrs.evolve(SMALL, cache_tokens=4096, wait_s=(5.0, 20.0), ttl_s=30.0)
    fixed = _run(tight, "proto-server")
    learned = _run(attrs.evolve(tight, ttl_median=1.0), "proto-server")
    assert learned.demotions > fixed.demotions
    assert len(learned.jct_s) == tight.rollouts  # every rollout still ends
    with pytest.raises(InvalidSetting, match=r"ttl_median must be positive and finite, got 0\.0"):
        attrs.evolve(tight, ttl_median=0.0)


def test_a_replica_out_of_free_blocks_preempts_its_newest_sequence_and_runs_it_again() -> None:
    settings = FleetSettings(shared_tokens=0, cache_tokens=64, block_tokens=16, max_running=2)
    replica = Replica(settings)  # a cache of 4 blocks
    first, second = (
        EngineSequence(0, 0, prompt=16, output=40),
        EngineSequence(1, 0, prompt=16, output=40),
    )
    replica.waiting.extend([first, second])
    finished: list[EngineSequence] = []
    for _ in range(1000):
        finished += replica.finish()
        if not replica.has_work:
            break
        replica.step()
    assert replica.preemptions == 1  # both grow to 3 blocks; 4 fit: the newest gives way
    assert finished == [first, second]
    assert all(seq.generated == seq.output for seq in finished)
    assert replica.prompt_tokens > 16 + 16  # the preempted one was prefilled again, longer
    assert replica.cache.pinned_blocks == 0


def test_the_command_writes_its_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "fleet", "--rollouts", "12", "--replicas", "2", "--turns", "3,6",
            "--context-tokens", "400", "--cache-tokens", "4096",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "MODELLED" in out and "plain forwarding / proto-server" in out
    assert all(policy in out for policy in POLICIES)
    assert "thunderagent (modelled) / proto-server (above 1: proto-server better): JCT mean" in out
    assert "continuum (modelled) / proto-server" in out
    assert "Goal: JCT at least 1.3x better than the modelled ThunderAgent policy: " in out
    assert "thunderagent (modelled): " in out and "scheduler ticks" in out
    assert "fleet: proto-server:" in err
    data = orjson.loads((tmp_path / "fleet.json").read_bytes())
    assert [p["policy"] for p in data["policies"]] == list(POLICIES)
    assert data["settings"]["rollouts"] == 12 and data["settings"]["context_tokens"] == [400, 1600]
    assert set(data["thunderagent_over_proto_server"]) >= {"jct_mean_s", "jct_p99_s", "makespan_s"}
    for p in data["policies"]:
        assert p["time"] == "modelled (virtual time)"
        assert p["prefilled_tokens"] + p["cached_tokens"] == p["prompt_tokens"]
        assert 0 < p["jct_p50_s"] <= p["jct_p99_s"] <= p["makespan_s"]
        assert len(data["jct_s"][p["policy"]]) == 12
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas: must be at least 1"),
        (["--cache-tokens", "20"], "--cache-tokens must hold at least 2 blocks"),
        (["--turns", "5,1"], "--turns: must be MEDIAN,P99 with 0 < MEDIAN <= P99"),
        (["--kv-target-fill", "1.5"], "--kv-target-fill: must be in (0, 1]"),
        (["--arrival-s", "-1"], "--arrival-s: must be at least 0"),
        (["--bypass", "-1"], "--bypass: must be at least 0"),
        (["--thunderagent-interval", "0"], "must be positive"),
        (["--continuum-ttl", "-2"], "must be positive"),
    ],
)
def test_bench_fleet_refuses_bad_flags_with_what_to_change(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["bench", "fleet", *flags])
    except SystemExit as exit_:  # argparse refuses what it can parse itself
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err


# -- the modelled peers --------------------------------------------------------------------------


def test_modelled_thunderagent_pauses_only_at_tool_boundaries_and_only_over_capacity() -> None:
    tight = attrs.evolve(SMALL, cache_tokens=8192)
    run = _run(tight, THUNDERAGENT)
    c = run.counters
    assert c["pauses"] > 0 and c["resumes"] > 0 and c["queued_new"] > 0
    assert c["pauses_at_tool_boundary"] == c["pauses"] == c["pauses_over_capacity"]
    assert c["ticks"] >= run.makespan_s // tight.thunder_interval_s
    assert len(run.jct_s) == tight.rollouts and min(run.jct_s) > 0  # every rollout ends
    # Without pressure it never pauses nor queues: it forwards like affinity.
    assert _run(SMALL, THUNDERAGENT).counters["pauses"] == 0
    assert _run(SMALL, THUNDERAGENT).counters["queued_new"] == 0


def _ask(ta: ThunderAgent, rollout: int, tokens: int) -> int | None:
    return ta.request(rollout, tokens, 0.0)


def test_modelled_thunderagent_pauses_the_smallest_on_its_tool_not_the_running() -> None:
    ta = ThunderAgent(1, 1000)
    assert _ask(ta, 0, 300) == 0 and _ask(ta, 1, 200) == 0 and _ask(ta, 2, 100) == 0
    assert _ask(ta, 3, 50) is None  # no room beside 600 tokens and 3 x 100: queued
    for rollout, tokens in ((0, 320), (1, 220), (2, 110)):
        ta.finished(rollout, tokens, 1.0)
    assert ta.tick(5.0) == [] and not ta.pauses  # within capacity: nothing moves
    assert _ask(ta, 0, 400) == 0  # it grew: 730 tokens and 3 x 100, over 1000
    assert ta.remaining(0) == -30
    assert ta.tick(10.0) == []  # no room to resume into; then it pauses
    # The smallest on its tool, not the running one; one is enough to be within capacity.
    assert [(p.rollout, p.at_tool_boundary, p.over_capacity) for p in ta.pauses] == [
        (2, True, True)
    ]
    assert ta.remaining(0) == 1000 - 620 - 2 * BUFFER_PER_PROGRAM
    assert _ask(ta, 2, 150) is None  # its tool answered: it waits for a resume
    ta.finished(0, 420, 11.0)
    ta.release(0)
    # Room for both: a request waiting is taken before a new program, though larger.
    assert ta.tick(15.0) == [(2, 0), (3, 0)]  # placed largest first
    assert ta.taken == [[150, 50]] and ta.resumes == 2 and not ta.pool


def test_modelled_thunderagent_resumes_smallest_first_and_packs_largest_first() -> None:
    ta = ThunderAgent(2, 1000)
    assert _ask(ta, 0, 800) == 0 and _ask(ta, 1, 700) == 1
    for rollout, tokens in ((2, 300), (3, 100), (4, 200), (5, 400)):
        assert _ask(ta, rollout, tokens) is None  # queued behind the first that did not fit
    ta.release(0)  # backend 0 has 1000 free, backend 1 200: 1200 in all
    # Taken smallest first while they fit the 1200 (the 400 does not), then placed largest
    # first on the backend with the most room.
    assert ta.tick(5.0) == [(2, 0), (4, 0), (3, 0)]
    assert ta.taken == [[100, 200, 300]] and ta.resumes == 3
    assert list(ta.pool) == [5]


def test_modelled_thunderagent_with_its_bug_mended_resumes_a_paused_request() -> None:
    """`_greedy_resume` at its latest commit fails every tick; the model resumes as intended, a
    program with a request waiting before a new one."""
    ta = ThunderAgent(1, 1000)
    assert _ask(ta, 0, 400) == 0 and _ask(ta, 1, 300) == 0
    ta.finished(0, 450, 1.0)
    ta.finished(1, 350, 1.0)
    assert _ask(ta, 1, 400) == 0  # over: 450 + 400 + 200
    ta.tick(5.0)
    assert [p.rollout for p in ta.pauses] == [0]
    assert _ask(ta, 0, 500) is None  # its tool answered while paused
    assert _ask(ta, 2, 50) is None  # a new one queues behind it
    ta.finished(1, 420, 6.0)
    ta.release(1)
    assert ta.tick(10.0) == [(0, 0), (2, 0)]  # largest first onto the one backend


def _replica_with_pins(ttl: float) -> tuple[Replica, ContinuumPins]:
    settings = FleetSettings(shared_tokens=0, cache_tokens=1024, block_tokens=16)
    pins = ContinuumPins(default_ttl_s=ttl, reload_s_per_token=1e-4)
    return Replica(settings, pins), pins


def _run_until_done(replica: Replica, now: float) -> tuple[float, list[EngineSequence]]:
    done: list[EngineSequence] = []
    while replica.has_work:
        now += replica.step(now)
        done += replica.finish(now)
    return now, done


def test_modelled_continuum_pins_a_tool_turn_for_its_ttl_and_not_past_it() -> None:
    replica, pins = _replica_with_pins(2.0)
    replica.submit(EngineSequence(0, 0, prompt=160, output=16), 0.0)
    end, _ = _run_until_done(replica, 0.0)
    held = replica.cache.pinned_blocks
    assert held == 11  # 176 tokens: its 11 blocks stay pinned while its tool runs
    # Another rollout runs within the TTL: the pin holds.
    replica.submit(EngineSequence(1, 0, prompt=32, output=4, last=True), end + 0.5)
    now, _ = _run_until_done(replica, end + 0.5)
    assert now < end + 2.0 and replica.cache.pinned_blocks == held
    # The first step past the TTL lets it go (its tool has not answered).
    replica.submit(EngineSequence(1, 1, prompt=48, output=4, last=True), end + 2.0)
    replica.step(end + 2.0)
    assert [(p.rollout, p.why, p.at, p.ttl_s) for p in pins.log] == [(0, "expired", end, 2.0)]
    assert pins.log[0].released_at >= pins.log[0].at + pins.log[0].ttl_s
    assert replica.cache.pinned_blocks < held


def test_modelled_continuum_hands_the_pin_to_the_next_turn() -> None:
    replica, pins = _replica_with_pins(2.0)
    replica.submit(EngineSequence(0, 0, prompt=160, output=16), 0.0)
    end, _ = _run_until_done(replica, 0.0)
    cached = replica.cached_tokens
    replica.submit(EngineSequence(0, 1, prompt=200, output=8, last=True), end + 1.0)
    _run_until_done(replica, end + 1.0)
    assert replica.cached_tokens - cached == 176  # its 11 blocks, from the pin
    assert [(p.why, p.released_at) for p in pins.log] == [("returned", end + 1.0)]
    assert replica.cache.pinned_blocks == 0  # a last turn is not pinned


def test_modelled_continuum_serves_rollouts_first_come_first_served() -> None:
    replica, _ = _replica_with_pins(2.0)
    for rollout in (0, 1, 2):
        replica.submit(EngineSequence(rollout, 0, prompt=16, output=1), float(rollout))
    replica.waiting.popleft()  # as if rollout 0 ran; its next turn comes after the others'
    replica.submit(EngineSequence(0, 1, prompt=32, output=1), 5.0)
    assert [(s.rollout, s.turn) for s in replica.waiting] == [(0, 1), (1, 0), (2, 0)]


def _tool_times(pins: ContinuumPins, rollouts: range, seconds: float) -> None:
    cache = PrefixCache(block_tokens=16, capacity_tokens=1024)
    for rollout in rollouts:
        pins.arrived(rollout, 0.0)
        pins.finished(rollout, [], 16, 0.0, cache)
        pins.arrived(rollout, seconds)


def test_modelled_continuum_ttl_is_its_papers_rule_after_a_cold_start() -> None:
    pins = ContinuumPins(default_ttl_s=2.0, reload_s_per_token=0.01)
    assert pins.ttl(10) == 2.0  # nothing seen yet: the default
    _tool_times(pins, range(101), 1.0)
    assert pins.ttl(1000) == 1.0  # 101 seen: past the cold start; worth pinning 1 s for 10 s
    assert pins.ttl(10) == 0.0  # reload 0.1 s: not worth pinning at all
    _tool_times(pins, range(200, 300), 30.0)
    assert pins.ttl(1000) == 1.0  # 10 s of reload is not worth 30 s of pinning
    assert pins.ttl(10_000) == 30.0  # 100 s is: P(<= 30 s) = 1
