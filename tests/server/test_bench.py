"""`proto-server bench`, reduced: it runs end to end, and its table and JSON are well formed.

Timings are not asserted: this machine is shared and noisy; docs/benchmarks.md shows a real run.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from proto_server_bench.memory import TRANSPORTS, MiB
from proto_server_bench.probes import ProbeSettings
from proto_server_bench.report import PLOTS
from proto_server_bench.runner import TRANSPORT_NAMES

from proto_server.cli import main


def test_a_reduced_bench_runs_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--turns", "3", "--repeats", "1", "--decode-rates", "4000",
            "--prefill-rate", "1e7", "--stream-tokens", "64", "--streams", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr()
    assert "starting the server process" in out.err  # progress
    table = out.out
    for heading in ("Per rollout", "Per turn, server side", "Streaming", "Targets:"):
        assert heading in table
    for name in TRANSPORT_NAMES:
        assert table.count(name) >= 2  # in the rollout table and the per-turn table
    assert f"Saved {tmp_path / 'bench.json'}" in table

    data = orjson.loads((tmp_path / "bench.json").read_bytes())
    assert {r["transport"] for r in data["rollouts"]} == set(TRANSPORT_NAMES)
    assert len(data["raw"]) == len(TRANSPORT_NAMES)
    for rollout in data["raw"]:
        assert len(rollout["turns"]) == 3
        for turn in rollout["turns"]:
            assert turn["client"]["bytes_up"] > 0 and turn["client"]["bytes_down"] > 0
            assert turn["server"]["server_cpu_ms"] > 0
            assert turn["server"]["prompt_tokens"] >= turn["server"]["cached_tokens"]
    prototype = next(r for r in data["raw"] if r["transport"] == "ws-prototype")
    stateless = next(r for r in data["raw"] if r["transport"] == "http-stateless")
    # the warm path renders only what is new, the stateless one everything again
    last = -1
    assert (
        prototype["turns"][last]["server"]["rendered_tokens"]
        < stateless["turns"][last]["server"]["rendered_tokens"]
    )
    assert {s["name"] for s in data["streaming"]} == {
        "one stream, 4,000 tok/s", "one stream, unlimited decode",
        "one stream, unlimited, unmerged", "2 streams, unlimited", "4 streams, 500 tok/s each",
        "slow client",
    }  # fmt: skip
    assert all(s["checked"] == s["streams_run"] for s in data["streaming"])
    assert all(t["holds"] in (True, False) for t in data["targets"])
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 1000


def test_bench_streaming_against_a_tree_without_benchmarks_says_what_to_run_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a tree from before the benchmarks left the package cannot run this run's benchmark code
    (tmp_path / "proto_server").mkdir()
    assert main(["bench", "streaming", "--against", str(tmp_path)]) == 2
    assert "no benchmarks/ there" in capsys.readouterr().err


def test_bench_streaming_alone_against_another_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`proto-server bench streaming`: the cases only, here this tree against itself (as
    `--against` measures a base commit's tree); every stream read by the checker."""
    tree = Path(__file__).resolve().parents[2]
    args = ["bench", "streaming", "--stream-tokens", "256", "--streams", "2",
            "--stream-repeats", "2", "--against", str(tree), "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr()
    assert "streaming [2/2]" in out.err
    for heading in ("Streaming (prototype dialect", "Ratios, this tree / the other", "Targets"):
        assert heading in out.out
    data = orjson.loads((tmp_path / "streaming.json").read_bytes())
    cases = 7
    assert len(data["raw"]) == 2 * 2 * cases  # two servers, two repeats
    assert len(data["streaming"]) == 2 * cases and {s["server"] for s in data["streaming"]} == {
        "this tree",
        tree.name,
    }
    for row in data["streaming"]:
        assert row["repeats"] == 2 and row["checked"] == row["streams_run"] > 0
        assert row["tokens_per_s"] > 0 and row["cpu_us_per_token"] > 0
        assert row["cpu_us_per_frame"] > 0
    paced = data["streaming"][0]
    assert (
        paced["decode_rate"] == 4000 and 0 < paced["latency_ms_median"] <= paced["latency_ms_p99"]
    )
    assert data["pacing_floor_us_per_token"] > 0 and "Pacing floor" in out.out
    assert all(us > 0 for us in data["cold_wake_us"].values()) and "Cold wakes" in out.out
    stepped = next(t for t in data["targets"] if "engine-like steps" in t["name"])
    assert "8/8 streams passed" in stepped["detail"]  # 4 streams, two repeats
    checker = data["targets"][-1]
    assert checker["holds"] is True and "streams" in checker["detail"]


def _exit_code(argv: list[str]) -> int:
    """What `main` returns, or argparse's exit status where it refuses a flag itself."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code  # type: ignore[return-value]


def test_bench_refuses_a_rollout_without_a_tool_round(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--turns", "1"]) == 2
    assert "proto-server bench all: --turns: must be at least 2, got 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--stream-rate", "--prefill-rate", "--client-fps"])
@pytest.mark.parametrize("rate", ["0", "-5", "nan", "inf", "1,2"])
def test_bench_refuses_a_rate_that_is_not_one_positive_number(
    capsys: pytest.CaptureFixture[str], flag: str, rate: str
) -> None:
    assert _exit_code(["bench", "streaming", flag, rate]) == 2
    assert flag in capsys.readouterr().err


async def test_the_deflate_bench_measures_both_side_by_side() -> None:
    import trio
    from proto_server_bench.deflate import measure, report

    with trio.fail_after(60):
        results = await measure(repeats=2, rounds=2, seed=0)
    plain, deflated = results["ws-launched"], results["ws-launched-deflate"]
    assert len(plain) == len(deflated) == 2
    for off, on in zip(plain, deflated, strict=True):
        assert on["turns"] == off["turns"] == 3
        assert on["bytes_down"] < off["bytes_down"] / 4  # the extension was really used
        assert on["bytes_up"] < off["bytes_up"]
        assert off["server_cpu_ms"] > 0 and on["server_cpu_ms"] > 0
    table = report(results)
    assert "server_cpu_ms" in table and "ratio" in table


@pytest.mark.slow
def test_bench_memory_every_shape_peaks_within_its_charge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`proto-server bench memory` at 1 MB: each shape (a create over HTTP and over a
    WebSocket, a steer, an inject) against a real server process of its own; its peak RSS above
    the baseline is within what the process budget charged for it in the same run. Before the
    renderer cut long texts into chunks, one run with no whitespace took about 50x its size in
    the tokenizer alone (past the 48x charge)."""
    assert main(["bench", "memory", "--mb", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "memory [10/10]: big inject over websocket" in out.err
    assert "worst peak/charge" in out.out
    rows = orjson.loads((tmp_path / "memory.json").read_bytes())["shapes"]
    assert {(r["shape"], r["transport"]) for r in rows} == {
        (shape, transport) for shape, over in TRANSPORTS.items() for transport in over
    }
    for row in rows:
        assert row["peak_reset"] and row["frame"] > 0.9 * MiB, row
        assert row["answer"] in ("response.completed", "response.steer.pending"), row
        assert row["peak"] <= row["charge"], row


@pytest.mark.parametrize(
    "flags",
    [
        ["--mb", "0"],
        ["--mb", "nan"],
        ["--mb", "inf"],
        ["--shapes", "nope"],
        ["--steer-flood", "0", "9", "15"],
        ["--steer-flood", "1.5", "9", "15"],
        ["--steer-flood", "2", "2", "1", "--flood-max-memory", "0", "5"],
    ],
)
def test_bench_memory_refuses_sizes_and_counts_it_cannot_measure(
    flags: list[str], tmp_path: Path
) -> None:
    assert _exit_code(["bench", "memory", *flags, "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_bench_detached_measures_responses_whose_clients_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`proto-server bench detached` with 12 clients against a real server process: each goes
    after 3 events, every Response runs on to its end with its events kept (a reattach from
    the first replays them), and the resident set and the budget's charge are reported. Whether
    the budget covers the resident set is what the bench is for, not asserted here."""
    args = ["bench", "detached", "--responses", "12", "--read", "3", "--words", "50",
            "--decode-rate", "100", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) in (0, 1)  # 1: the budget did not cover the resident set
    out = capsys.readouterr()
    assert "12 detached Responses (12 ended" in out.out
    row = orjson.loads((tmp_path / "detached.json").read_bytes())
    assert row["responses"] == row["ended"] == 12
    assert row["kept_events_each"] > 3 and row["kept_bytes_each"] > 0  # more than they read
    assert row["charged_each"] > row["kept_bytes_each"]  # each kept event is charged


@pytest.mark.parametrize(
    "flags", [["--responses", "0"], ["--read", "0"], ["--words", "0"], ["--decode-rate", "0"]]
)
def test_bench_detached_refuses_what_it_cannot_measure(flags: list[str], tmp_path: Path) -> None:
    assert _exit_code(["bench", "detached", *flags, "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_bench_probes_reports_every_case_with_its_bystander(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`proto-server bench probes` at tiny sizes: each case against a server of its own, a row
    with its answer, its time, the bystander's worst wait and its peak, and a line per goal.
    Whether a goal holds is not asserted (the loop goal is a timing on a shared machine)."""
    shapes = "control,references,warm references,min length,min length tool,big steer"
    args = ["bench", "probes", "--probe-shapes", shapes, "--item-mb", "0.05", "--references",
            "2,3", "--min-length", "1000", "--mb", "0.05", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) in (0, 1)  # 1: a goal failed
    out = capsys.readouterr()
    assert "probes [13/13] big steer over websocket" in out.err
    data = orjson.loads((tmp_path / "probes.json").read_bytes())
    rows = {(r["shape"], r["transport"]): r for r in data["cases"]}
    assert list(rows) == [
        ("control", "http"), ("control", "websocket"),
        ("references x2", "http"), ("references x2", "input_tokens"),
        ("references x3", "http"), ("references x3", "input_tokens"),
        ("warm references x2", "websocket"), ("warm references x3", "websocket"),
        ("min length", "http"), ("min length", "websocket"),
        ("min length tool", "http"), ("min length tool", "websocket"),
        ("big steer", "websocket"),
    ]  # fmt: skip
    for (shape, transport), row in rows.items():
        assert row["stopped"] is None and not row["refused"], row
        assert f"{shape:<22} {transport:<12}" in out.out
        expected = {"input_tokens": "HTTP 200 ", "websocket": "response."}.get(transport, "")
        assert row["answer"].startswith(expected or "response.completed"), row
        assert row["frame"] > 0 and row["max_memory"] == 2048 * MiB and row["peak"] is not None
        assert row["answer_s"] > 0 and row["worst_gap_ms"] >= row["worst_wait_ms"] > 0
        (run,) = row["runs"]
        assert run["peak_reset"] and run["probes"] >= 1 and run["failures"] == 0
    assert rows[("references x3", "input_tokens")]["answer"].endswith(" tokens")
    assert rows[("big steer", "websocket")]["answer"] == "response.steer.pending"
    assert [g["goal"].split(":")[0] for g in data["goals"]] == [
        "the loop never blocked more than 100 ms by one request",
        "peak RSS within --max-memory plus the baseline for every shape",
        "references to a big item",
    ]
    assert out.out.count("[HOLDS]") + out.out.count("[FAILS]") == 3
    assert data["settings"]["references"] == [2, 3]


@pytest.mark.parametrize(
    "flags",
    [
        ["--probe-shapes", "nope"],
        ["--probe-shapes", ""],
        ["--item-mb", "0"],
        ["--references", "0"],
        ["--references", "a,b"],
        ["--min-length", "1.5"],
        ["--min-length", "1,2"],
        ["--probe-timeout", "nan"],
        ["--probe-repeats", "0"],
        ["--probe-max-memory", "0"],
    ],
)
def test_bench_probes_refuses_flags_it_cannot_measure_with(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["bench", "probes", *flags]) == 2
    assert flags[0] in capsys.readouterr().err


def test_bench_probes_cases_follow_the_shapes_and_counts() -> None:
    settings = ProbeSettings(shapes=("references", "warm references", "huge string"),
                             references=(100, 1000))  # fmt: skip
    assert settings.cases() == [
        ("references", "http", 100), ("references", "input_tokens", 100),
        ("references", "http", 1000), ("references", "input_tokens", 1000),
        ("warm references", "websocket", 100), ("warm references", "websocket", 1000),
        ("huge string", "http", 0), ("huge string", "websocket", 0),
    ]  # fmt: skip
