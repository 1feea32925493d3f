"""`proto-server bench probes`, its parts: how a case is given up on, and how the goals read
the rows. Virtual time only; the real run is in tests/server/test_bench.py."""

from __future__ import annotations

import os
from typing import Any

import trio
import trio.testing
from proto_server_bench.memory import MiB
from proto_server_bench.probes import ProbeSettings, _bounded, goals, render


async def _never() -> str:
    await trio.sleep_forever()
    return "never"


async def test_a_case_with_no_answer_is_given_up_on_at_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert await _bounded(_never, os.getpid(), 1 << 60, timeout_s=60) == ("", "timeout")


async def test_a_case_is_stopped_once_the_server_holds_too_much(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """This process stands for the server: anything resident is more than 0 bytes."""
    assert await _bounded(_never, os.getpid(), 0, timeout_s=60) == ("", "memory")


async def test_a_lost_connection_is_an_answer(autojump_clock: trio.testing.MockClock) -> None:
    async def lost() -> str:
        raise ConnectionResetError("reset by peer")

    answer, stopped = await _bounded(lost, os.getpid(), 1 << 60, timeout_s=60)
    assert (answer, stopped) == ("ConnectionResetError: reset by peer", None)


def _row(shape: str, answer: str, **figures: Any) -> dict[str, Any]:
    row = {"shape": shape, "transport": "http", "frame": 5000, "answer": answer, "refused": False,
           "stopped": None, "answer_s": 0.05, "worst_wait_ms": 5.0, "worst_gap_ms": 15.0,
           "peak": 10 * MiB, "max_memory": 2048 * MiB}  # fmt: skip
    return row | figures


def test_goals_hold_when_every_case_is_quick_and_within_its_memory() -> None:
    rows = [
        _row("control", "response.completed"),
        _row("references x100", "HTTP 400 connection_memory_limit", refused=True),
        _row("warm references x100", "response.completed", worst_wait_ms=40.0),
    ]
    assert [holds for holds, _ in goals(rows)] == [True, True, True]


def test_goals_fail_with_the_figure_that_breaks_them() -> None:
    rows = [
        _row("control", "response.completed", worst_wait_ms=12.0),
        _row(
            "references x100",
            "response.failed connection_memory_limit",
            refused=True,
            answer_s=12.5,
            worst_wait_ms=14_700.0,
        ),
        _row(
            "min length",
            "",
            stopped="timeout",
            answer_s=60.0,
            worst_wait_ms=60_000.0,
            peak=900 * MiB,
        ),
    ]
    (loop, loop_text), (rss, rss_text), (refs, refs_text) = goals(rows)
    assert not loop and "worst wait 60,000 ms (min length over http)" in loop_text
    assert "2 of 3 cases past it (control: 12 ms)" in loop_text
    assert not rss and "1 more stopped first (peak unknown)" in rss_text  # 900 MB: a lower bound
    assert not refs and "references x100 over http: refused in 12,500 ms" in refs_text
    table = render(rows, ProbeSettings())
    assert table.count("[FAILS]") == 3 and ">=900.0" in table


def test_a_reference_served_must_be_off_the_loop_and_within_the_budget() -> None:
    rows = [_row("references x1000", "response.completed", peak=3300 * MiB)]
    assert [holds for holds, _ in goals(rows)] == [True, False, False]
