"""What the streaming measurements say: medians per case, issue 13's targets, a table.

Each case is summarized by the median of its repeats, per server (this tree, and the other tree
of `--against`, if one was measured), so a before-and-after comparison is two columns of one run.
The targets are judged on this tree's medians only.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from proto_server_bench.streaming import StreamResult
from proto_server_bench.tables import Target, table

THIS = "this tree"
NUMBERS = (
    "tokens",
    "frames",
    "seconds",
    "tokens_per_s",
    "frames_per_s",
    "server_cpu_share",
    "cpu_us_per_token",
    "cpu_us_per_frame",
    "latency_ms_median",
    "latency_ms_p99",
)


def _key(result: StreamResult) -> tuple[Any, ...]:
    return (result.server, result.name, result.merge_deltas, result.client_frames_per_s)


def summarize_streaming(results: Sequence[StreamResult]) -> list[dict[str, Any]]:
    """One row per server and case, in the order they ran: medians over the repeats; every
    stream of every repeat counts towards `checked`."""
    groups: dict[tuple[Any, ...], list[StreamResult]] = {}
    for result in results:
        groups.setdefault(_key(result), []).append(result)
    rows = []
    for group in groups.values():
        first = group[0]
        row = attrs.asdict(first, filter=lambda a, _: a.name not in (*NUMBERS, "repeat"))
        for name in NUMBERS:
            values = [v for r in group if (v := getattr(r, name)) is not None]
            row[name] = statistics.median(values) if values else None
        row["repeats"] = len(group)
        row["checked"] = sum(r.checked for r in group)
        row["streams_run"] = sum(r.streams for r in group)
        row["violation"] = next((r.violation for r in group if r.violation), None)
        rows.append(row)
    return rows


def _find(rows: Sequence[dict[str, Any]], *, server: str, streams: int, rate: bool, merge: bool,
          slow: bool = False) -> dict[str, Any] | None:  # fmt: skip
    for row in rows:
        if (
            row["server"] == server
            and row["streams"] == streams
            and (row["decode_rate"] is not None) == rate
            and row["merge_deltas"] == merge
            and (row["client_frames_per_s"] is not None) == slow
        ):
            return row
    return None


def streaming_targets(rows: Sequence[dict[str, Any]]) -> list[Target]:
    """Issue 13's targets, on this tree's medians; the stream checker must pass every stream."""
    found: list[Target] = []
    paced = _find(rows, server=THIS, streams=1, rate=True, merge=True)
    if paced is not None and paced["latency_ms_median"] is not None:
        found.append(
            Target(
                f"one stream at {paced['decode_rate']:,.0f} tok/s: server CPU <= 25 us/token, "
                "release -> write median < 1 ms, p99 < 5 ms",
                paced["cpu_us_per_token"] <= 25
                and paced["latency_ms_median"] < 1
                and paced["latency_ms_p99"] < 5,
                f"{paced['cpu_us_per_token']:.1f} us/token ({paced['server_cpu_share']:.0%} of a "
                f"core), {paced['latency_ms_median']:.2f} ms median, p99 "
                f"{paced['latency_ms_p99']:.2f} ms, {paced['tokens_per_s']:,.0f} tok/s",
            )
        )
    one = _find(rows, server=THIS, streams=1, rate=False, merge=True)
    if one is not None:
        found.append(
            Target(
                "one stream, unlimited decode: >= 40,000 tok/s delivered",
                one["tokens_per_s"] >= 40_000,
                f"{one['tokens_per_s']:,.0f} tok/s, {one['cpu_us_per_token']:.1f} us/token",
            )
        )
    many = [r for r in rows if r["server"] == THIS and r["streams"] > 1]
    for row in (r for r in many if r["decode_rate"] is not None):
        found.append(
            Target(
                f"{row['streams']} streams at {row['decode_rate']:,.0f} tok/s each (engine-like "
                "steps): server CPU <= 25 us/token, every stream checked",
                row["cpu_us_per_token"] <= 25 and row["checked"] == row["streams_run"],
                f"{row['cpu_us_per_token']:.1f} us/token, {row['tokens_per_s']:,.0f} tok/s, "
                f"{row['checked']}/{row['streams_run']} streams passed the checker",
            )
        )
    for row in (r for r in many if r["decode_rate"] is None):
        found.append(
            Target(
                f"{row['streams']} streams, unlimited decode: >= 60,000 tok/s in total, every "
                "stream checked",
                row["tokens_per_s"] >= 60_000 and row["checked"] == row["streams_run"],
                f"{row['tokens_per_s']:,.0f} tok/s, {row['checked']}/{row['streams_run']} "
                "streams passed the checker",
            )
        )
    unmerged = _find(rows, server=THIS, streams=1, rate=False, merge=False)
    if unmerged is not None:
        found.append(
            Target(
                "per-frame cost (--no-merge-deltas, unlimited decode) <= 40 us",
                unmerged["cpu_us_per_frame"] <= 40,
                f"{unmerged['cpu_us_per_frame']:.1f} us/frame, "
                f"{unmerged['frames_per_s']:,.0f} frames/s",
            )
        )
    slow = _find(rows, server=THIS, streams=1, rate=True, merge=False, slow=True)
    merged = _find(rows, server=THIS, streams=1, rate=True, merge=True, slow=True)
    if slow is not None and merged is not None:
        found.append(
            Target(
                f"a client taking {slow['client_frames_per_s']:,.0f} frames/s: merged deltas "
                "keep tokens/s up",
                merged["tokens_per_s"] > 1.2 * slow["tokens_per_s"],
                f"{merged['tokens_per_s']:,.0f} tok/s merged vs {slow['tokens_per_s']:,.0f} not",
            )
        )
    checked = sum(r["checked"] for r in rows)
    run = sum(r["streams_run"] for r in rows)
    violation = next((r["violation"] for r in rows if r["violation"]), None)
    found.append(
        Target(
            "every stream passes the stream checker (same events, order, texts, usage)",
            checked == run,
            f"{checked}/{run} streams" + (f"; first violation: {violation}" if violation else ""),
        )
    )
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_streaming(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table: one line per case and server (medians of the repeats)."""
    repeats = max((r["repeats"] for r in rows), default=0)
    lines = [
        "Streaming (prototype dialect, one server process; measured; median of "
        f"{repeats} repeat(s); server CPU from the server process; latency = token released by "
        "the simulated GPU -> its frame written):",
    ]
    servers = {r["server"] for r in rows}
    header = ["case", *(["server"] if len(servers) > 1 else []), "streams", "merged",
              "tokens/s", "frames/s", "server CPU", "us/token", "us/frame", "latency ms",
              "p99 ms", "checked"]  # fmt: skip
    body = []
    for r in rows:
        fps = r["client_frames_per_s"]
        body.append(
            [
                r["name"] + (f" ({fps:,.0f} fps)" if fps else ""),
                *([r["server"]] if len(servers) > 1 else []),
                str(r["streams"]),
                "yes" if r["merge_deltas"] else "no",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['frames_per_s']:,.0f}",
                f"{r['server_cpu_share']:.0%}",
                f"{r['cpu_us_per_token']:.1f}",
                f"{r['cpu_us_per_frame']:.1f}",
                _ms(r["latency_ms_median"]),
                _ms(r["latency_ms_p99"]),
                f"{r['checked']}/{r['streams_run']}",
            ]
        )
    lines += table(header, body)
    if len(servers) > 1:
        lines += ["", "Ratios, this tree / the other (same case, medians):"]
        for r in rows:
            if r["server"] != THIS:
                continue
            other = next((o for o in rows if o["server"] != THIS and _same_case(o, r)), None)
            if other is None:
                continue
            lines.append(
                f"  {r['name']}{' (merged)' if r['merge_deltas'] else ''}: tokens/s "
                f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x, us/token "
                f"{r['cpu_us_per_token'] / other['cpu_us_per_token']:.2f}x, us/frame "
                f"{r['cpu_us_per_frame'] / other['cpu_us_per_frame']:.2f}x"
            )
    return lines


def _same_case(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("name", "merge_deltas", "client_frames_per_s"))
