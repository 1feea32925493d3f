"""The load test in its reduced form (the full one: `python -m proto_server.testing.load`)."""

from __future__ import annotations

from proto_server.testing.load import main, run_load


async def test_a_hundred_suspended_rollouts_beside_ten_streams() -> None:
    result = await run_load(connections=100, streams=10, rollouts=3, timeout_s=120)
    assert result.violations == ()
    assert result.streams_checked == 100 + 10 + 1  # the suspended, the streams, the warm-up
    assert result.exit_code == 0  # SIGTERM drained it
    # 21 events at least per rollout (more where the writer kept up: it merges deltas that
    # pile up), and the checker saw each stream's text add up
    assert result.stream_events >= 10 * 3 * 21
    per_rollout = result.bytes_per_suspended_rollout
    if per_rollout is not None:  # where /proc shows the server's memory
        assert 0 < per_rollout < 512 * 1024
    table = result.table()
    assert "| memory per suspended rollout" in table and "events/s" in table


def test_the_command_line_prints_the_table(capsys: object) -> None:
    assert main(["--connections", "3", "--streams", "2", "--rollouts", "1"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "| connections, each holding a suspended rollout | 3 |" in out
    assert "| streams checked / invariant violations        | 6 / 0 |" in out
