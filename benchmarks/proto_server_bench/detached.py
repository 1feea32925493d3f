"""`proto-server bench detached`: what streamed Responses whose clients went away cost the
server while it keeps their events for a reattach (`--reattach-grace`).

One `proto-server serve` process (memory.Server). A Response streamed whole first warms it up
and its resident set is the baseline; then N clients each stream a Response over SSE, read a
few events and close their connection, so that every Response runs on detached, to its end,
its events kept. Once all have ended, the resident set and what the process memory budget
(`--max-memory`) charges are read again, and ten Responses are reattached from their first
event to count what is kept of each. The ratios printed: the resident set each Response added over
the bytes of its kept events (what it costs against what it holds), and over what the budget
charged for it (at most 1: the budget covers it).
"""

from __future__ import annotations

import itertools
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio

from proto_server.core.ranges import at_least, between, positive_finite
from proto_server.core.settings import setting
from proto_server_bench.memory import MiB, Server, reset_peak, server, status_kib

#: How long the Responses may take to end once their clients went.
SETTLE_S = 300.0
#: How many Responses are reattached to count what is kept of each (the mean is printed).
SAMPLE = 10


@attrs.frozen(kw_only=True)
class DetachedSettings:
    """What `bench detached` runs: each field is a flag of its."""

    responses: int = setting(1000, at_least(1), help="Responses whose clients go away")
    words: int = setting(200, at_least(1), help="words each Response's answer says")
    read: int = setting(
        5, between(1, 100), metavar="EVENTS", help="events each client reads before it goes"
    )
    concurrency: int = setting(50, between(1, 500), metavar="N", help="clients streaming at once")
    decode_rate: float = setting(
        1000.0, positive_finite, flag="--decode-rate", metavar="TOKENS_PER_S",
        help="the simulated GPU's decode speed: slow enough that each Response still streams "
        "when its client goes (one written whole before it went is not kept)",
    )  # fmt: skip
    max_memory_mib: int = setting(
        2048, at_least(64), flag="--max-memory-mib", metavar="MIB",
        help="the server's --max-memory, in MiB",
    )  # fmt: skip


def _script(words: int) -> dict[str, Any]:
    return {"segments": [{"text": "word " * words}]}


async def _stream(http: httpx.AsyncClient, read: int | None) -> tuple[str, int]:
    """Stream one Response over SSE; read `read` events (None: all) and go. Its id, and the
    bytes read."""
    body = {"model": "m", "input": "Say it.", "stream": True}
    response_id, seen, nbytes = "", 0, 0
    async with http.stream("POST", "/v1/responses", json=body) as answer:
        async for line in answer.aiter_lines():
            nbytes += len(line) + 1
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            if not response_id:
                response_id = event["response"]["id"]
            seen += 1
            if read is not None and seen >= read:
                break  # the connection is closed as the block ends: the client went
    return response_id, nbytes


async def _stored(http: httpx.AsyncClient, response_id: str) -> bool:
    """Whether `response_id` ended (a Response is in the store once it ended)."""
    return (await http.get(f"/v1/responses/{response_id}")).status_code == 200


async def _all_ended(http: httpx.AsyncClient, ids: list[str]) -> None:
    """Until every one of `ids` ended, the earliest first (polled: nothing tells a client
    when a Response it left ends)."""
    for response_id in ids:
        for _ in itertools.count():  # a remote state: nothing but asking again tells of it
            if await _stored(http, response_id):
                break
            await trio.sleep(0.2)


async def _kept_of(http: httpx.AsyncClient, response_id: str) -> tuple[int, int]:
    """The events kept of `response_id` and their bytes, as a reattach from the first replays
    them."""
    events, nbytes = 0, 0
    url = f"/v1/responses/{response_id}?stream=true&starting_after=-1"
    async with http.stream("GET", url) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                events += 1
                nbytes += len(line) - 6
    return events, nbytes


async def _measure(running: Server, settings: DetachedSettings) -> dict[str, Any]:
    progress = partial(print, file=sys.stderr, flush=True)
    limits = httpx.Limits(max_connections=settings.concurrency)
    async with httpx.AsyncClient(base_url=running.http, timeout=60, limits=limits) as http:
        await _stream(http, None)  # warm-up, read to its end: nothing of it is kept
        baseline = status_kib(running.pid, "VmRSS")
        charged_before = await running.gauge("proto_server_memory_used_bytes")
        reset_peak(running.pid)
        ids: list[str] = []
        started = time.perf_counter()
        gate = trio.Semaphore(settings.concurrency)

        async def one() -> None:
            async with gate:
                ids.append((await _stream(http, settings.read))[0])

        async with trio.open_nursery() as nursery:
            for _ in range(settings.responses):
                nursery.start_soon(one)
        went = time.perf_counter() - started
        progress(f"detached: {len(ids)} clients went after {settings.read} events each "
                 f"({went:.1f} s); waiting for their Responses to end")  # fmt: skip
        with trio.move_on_after(SETTLE_S):
            await _all_ended(http, ids)
        done = sum([await _stored(http, response_id) for response_id in ids])
        rss = status_kib(running.pid, "VmRSS")
        peak = status_kib(running.pid, "VmHWM")
        charged = await running.gauge("proto_server_memory_used_bytes") - charged_before
        sample = [await _kept_of(http, response_id) for response_id in ids[:SAMPLE]]
        events = sum(e for e, _ in sample) / len(sample)
        event_bytes = sum(b for _, b in sample) / len(sample)
    n = settings.responses
    return {
        "responses": n,
        "ended": done,
        "baseline": baseline,
        "rss": rss,
        "peak": peak,
        "rss_each": (rss - baseline) / n,
        "charged": charged,
        "charged_each": charged / n,
        "kept_events_each": events,
        "kept_bytes_each": event_bytes,
    }


def run(settings: DetachedSettings, out: Path) -> int:
    """The figures on stdout, and detached.json in `out`; 1 when the budget did not cover the
    resident set the Responses added."""
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--max-memory", str(settings.max_memory_mib * MiB), "--reattach-grace", "3600",
             "--max-connections", str(max(1000, 2 * settings.concurrency)),
             "--decode-rate", f"{settings.decode_rate:g}"]  # fmt: skip
    with server(flags, script=_script(settings.words)) as running:
        row = trio.run(_measure, running, settings)
    covered = row["rss_each"] <= row["charged_each"]
    print(
        f"{row['responses']} detached Responses ({row['ended']} ended, their events kept), "
        f"each {row['kept_events_each']:.0f} events of {row['kept_bytes_each'] / 1024:.1f} KiB "
        f"(the mean of {min(SAMPLE, row['responses'])} reattached from their first):\n"
        f"  resident set {row['baseline'] / MiB:.1f} -> {row['rss'] / MiB:.1f} MiB, "
        f"{row['rss_each'] / 1024:.1f} KiB each, "
        f"{row['rss_each'] / max(1, row['kept_bytes_each']):.2f}x its events' bytes; "
        f"the budget charged {row['charged_each'] / 1024:.1f} KiB each "
        f"(resident / charged {row['rss_each'] / max(1.0, row['charged_each']):.2f}: "
        f"{'covered' if covered else 'NOT covered'}); peak {row['peak'] / MiB:.1f} MiB"
    )
    path = out / "detached.json"
    path.write_bytes(orjson.dumps(row, option=orjson.OPT_INDENT_2))
    print(f"Saved {path}")
    return 0 if covered else 1
