"""`proto-server bench fleet`, reduced: the virtual-time simulation of the server's scheduler on
modelled replicas. Small seeded runs; nothing here reads a clock (the CPU time it reports is
never asserted)."""

from __future__ import annotations

from pathlib import Path

import attrs
import orjson
import pytest

from proto_server.bench.fleet import (
    PLOTS,
    POLICIES,
    EngineSequence,
    FleetSettings,
    PolicyRun,
    Replica,
    make_rollouts,
    simulate,
    unbounded_need,
)
from proto_server.cli import main

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
    for policy in ("affinity", "proto-server"):
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
    assert attrs.evolve(tight, growth=0.5).problems() == [
        "--admission-growth must be between 1 and 100, got 0.5"
    ]


def test_a_place_kept_a_short_multiple_of_the_time_away_demotes_more() -> None:
    """--ttl-median: the server's learned place, in the same simulation; the workload's waits
    are the same, so a place kept less than its fixed TTL lapses more often."""
    tight = attrs.evolve(SMALL, cache_tokens=4096, wait_s=(5.0, 20.0), ttl_s=30.0)
    fixed = _run(tight, "proto-server")
    learned = _run(attrs.evolve(tight, ttl_median=1.0), "proto-server")
    assert learned.demotions > fixed.demotions
    assert len(learned.jct_s) == tight.rollouts  # every rollout still ends
    assert attrs.evolve(tight, ttl_median=0.0).problems() == [
        "--ttl-median must be positive and finite, got 0.0"
    ]


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
    args = ["bench", "fleet", "--rollouts", "12", "--replicas", "2", "--fleet-turns", "3,6",
            "--context-tokens", "400", "--cache-tokens", "4096",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "MODELLED" in out and "plain forwarding / proto-server" in out
    assert all(policy in out for policy in POLICIES)
    assert "fleet: proto-server:" in err
    data = orjson.loads((tmp_path / "fleet.json").read_bytes())
    assert [p["policy"] for p in data["policies"]] == list(POLICIES)
    assert data["settings"]["rollouts"] == 12 and data["settings"]["context_tokens"] == [400, 1600]
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
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--cache-tokens", "20"], "--cache-tokens must hold at least 2 blocks"),
        (["--fleet-turns", "5,1"], "expected 0 < MEDIAN <= P99"),
        (["--kv-target-fill", "1.5"], "--kv-target-fill must be in (0, 1]"),
        (["--arrival-s", "-1"], "--arrival-s must be at least 0"),
        (["--bypass", "-1"], "--bypass must be at least 0"),
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
