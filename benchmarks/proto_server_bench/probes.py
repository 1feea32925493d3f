"""`proto-server bench probes`: what one hostile request costs everyone else, with a bystander.

Each case is one request of a shape over a transport, against a `proto-server serve` process of
its own (memory.py's `Server`, under `--probe-max-memory`). Once the case is set up (its item
stored, its conversation warm, the server warmed by a small request), a bystander
(bystander.py, a process of its own) asks `GET /healthz` every 10 ms; the server's `VmRSS` is
read as the baseline and its `VmHWM` reset; then the ONE request is sent and timed to its answer.
Its worst wait is how long that request kept the event loop from others; the peak above the
baseline is what it made the process hold. A request is given up on after `--probe-timeout`, or
once the server's resident set passes 1.25x `--probe-max-memory` above the baseline (its goal has
failed by then, and the machine is spared the rest): the row says so, and its figures are
lower bounds.

The shapes: `control` (a small create: the noise floor of this machine); `references` (one
`--item-mb` item stored, then a body of nothing but `item_reference`s to it, `--references`
times, to `POST /v1/responses` and to `/v1/responses/input_tokens`); `warm references` (the
same over a WebSocket with `store: false`, the item in the warm conversation itself); `min
length` (a `json_schema` text format whose one string asks `--min-length` characters) and `min
length tool` (the same schema as a required function's parameters), both answered by the
built-in model; and every shape of `bench memory` at `--mb`.

memory.py's server, frames and sending (`armed`, `post`) and bystander.py's process are reused,
not repeated.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio

from proto_server.core.ranges import at_least, positive_finite
from proto_server.core.settings import setting
from proto_server.testing.client import WireClient, connect
from proto_server_bench import flags, memory
from proto_server_bench.bystander import watching
from proto_server_bench.memory import (
    END,
    EVENT_TIMEOUT_S,
    EXEC_COMMAND,
    MiB,
    Send,
    Server,
    answer_of,
    body_of,
    post,
    status_kib,
)

#: Each attack shape and the transports it is sent over (`input_tokens`: HTTP, counted only).
ATTACKS = {
    "control": ("http", "websocket"),
    "references": ("http", "input_tokens"),
    "warm references": ("websocket",),
    "min length": ("http", "websocket"),
    "min length tool": ("http", "websocket"),
}
SHAPES = (*ATTACKS, *memory.SHAPES)
#: Shapes answered by the built-in model (a schema's instance); the rest by memory.py's script.
BUILT_IN = frozenset({"control", "min length", "min length tool"})
ITEM_ID = "msg_probe_item"
REFERENCE = {"type": "item_reference", "id": ITEM_ID}
#: Past this share of --probe-max-memory above the baseline, a case is stopped.
RSS_STOP = 1.25
LOOP_GOAL_MS = 100.0
#: Events of an answer the length of a `minLength` come whole in its last events.
MAX_EVENT_BYTES = 1 << 30


@attrs.frozen(kw_only=True)
class ProbeSettings:
    """What `bench probes` runs: each field is a flag of its (sizes in MB on the command line)."""

    shapes: tuple[str, ...] = setting(
        SHAPES, flags.some_of(SHAPES), flag="--probe-shapes", parse=flags.names,
        metavar="NAMES", help=f"comma-separated subset of {','.join(SHAPES)} (bench memory's "
        "shapes at --mb)",
    )  # fmt: skip
    nbytes: int = setting(
        15 * MiB, flag="--mb", unit=MiB, parse=memory.megabytes, metavar="MB",
        help="size of each of bench memory's shapes' frame, in MB",
    )  # fmt: skip
    item_bytes: int = setting(
        4 * MiB, flag="--item-mb", unit=MiB, parse=memory.megabytes, metavar="MB",
        help="the referenced item's size",
    )  # fmt: skip
    references: tuple[int, ...] = setting(
        (100, 1000), flags.some_counts, parse=flags.counts, metavar="N,N",
        help="references to the item in one body, a case each",
    )  # fmt: skip
    min_length: int = setting(
        100_000_000, at_least(1), metavar="N", help="the minLength the min length shapes ask"
    )
    timeout_s: float = setting(
        60.0, positive_finite, flag="--probe-timeout", metavar="S",
        help="a case with no answer by then is given up on (the server killed), and says so",
    )  # fmt: skip
    repeats: int = setting(
        1, at_least(1), flag="--probe-repeats", metavar="N",
        help="runs of each case (the table shows medians)",
    )  # fmt: skip
    max_memory_mib: int = setting(
        2048, at_least(1), flag="--probe-max-memory", metavar="MIB",
        help="the servers' --max-memory",
    )  # fmt: skip

    def cases(self) -> list[tuple[str, str, int]]:
        """(shape, transport, references) of every case, in order."""
        cases = []
        for shape in self.shapes:
            over = ATTACKS.get(shape) or memory.TRANSPORTS[shape]
            counts = self.references if shape.endswith("references") else (0,)
            cases += [(shape, transport, n) for n in counts for transport in over]
        return cases


def label(shape: str, count: int) -> str:
    return f"{shape} x{count}" if count else shape


def _item(nbytes: int) -> dict[str, Any]:
    return {"type": "message", "role": "user", "id": ITEM_ID, "content": memory.text_of(nbytes)}


def attack_frame(shape: str, min_length: int) -> dict[str, Any]:
    """A small create: `control` as it is, or with a schema asking `min_length` characters."""
    create: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi"}
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": min_length}},
              "required": ["a"]}  # fmt: skip
    if shape == "min length":
        return create | {"text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}
    if shape == "min length tool":
        tool = {"type": "function", "name": "f", "parameters": schema}
        return create | {"tools": [tool], "tool_choice": "required"}
    return create


async def _answer(client: WireClient, text: str) -> str:
    """Send `text`; the event that ends its Response, the others read and let go."""
    await client.send(text)
    while True:
        event = await client.receive(waiting_for="the end of the Response")
        client.received.clear()
        if event["type"] in END:
            return answer_of(event["type"], event)


@asynccontextmanager
async def _created(
    running: Server, transport: str, frame: dict[str, Any]
) -> AsyncIterator[tuple[Send, int]]:
    """`frame` ready to send over `transport`, the server warmed by `control` first."""
    warm = attack_frame("control", 0)
    if transport == "http":
        url = running.http + "/v1/responses"
        async with httpx.AsyncClient(timeout=httpx.Timeout(EVENT_TIMEOUT_S)) as http:
            await post(http, url, body_of(warm))
            body = body_of(frame)
            yield partial(post, http, url, body), len(body)
        return
    async with connect(running.ws, max_message_size=MAX_EVENT_BYTES,
                       event_timeout_s=EVENT_TIMEOUT_S) as client:  # fmt: skip
        await _answer(client, orjson.dumps(warm).decode())
        text = orjson.dumps(frame).decode()
        yield partial(_answer, client, text), len(text)


@asynccontextmanager
async def _references(
    running: Server, transport: str, count: int, item_bytes: int
) -> AsyncIterator[tuple[Send, int]]:
    """One item stored (`store: true`), then a body of `count` references to it."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(EVENT_TIMEOUT_S)) as http:
        store = {"model": "m", "store": True, "tools": [EXEC_COMMAND], "input": [_item(item_bytes)]}
        stored = await post(http, running.http + "/v1/responses", body_of(store))
        if stored != "response.completed":
            raise RuntimeError(f"storing the referenced item: {stored}")
        refs = {"model": "m", "tools": [EXEC_COMMAND], "input": [REFERENCE] * count}
        if transport == "http":
            url, body = running.http + "/v1/responses", body_of(refs)
        else:
            url, body = running.http + "/v1/responses/input_tokens", orjson.dumps(refs)
        yield partial(post, http, url, body), len(body)


@asynccontextmanager
async def _warm_references(
    running: Server, count: int, item_bytes: int
) -> AsyncIterator[tuple[Send, int]]:
    """A warm conversation (`store: false`) holding the item; its next turn references it."""
    async with connect(running.ws, max_message_size=MAX_EVENT_BYTES,
                       event_timeout_s=EVENT_TIMEOUT_S) as client:  # fmt: skip
        previous, call_id = await memory.called(client, store=False, input=[_item(item_bytes)])
        client.received.clear()
        output = {"type": "function_call_output", "call_id": call_id, "output": "ok"}
        frame = {"type": "response.create", "model": "m", "store": False,
                 "tools": [EXEC_COMMAND], "previous_response_id": previous,
                 "input": [output, *[REFERENCE] * count]}  # fmt: skip
        text = orjson.dumps(frame).decode()
        yield partial(_answer, client, text), len(text)


def _armed(
    running: Server, settings: ProbeSettings, shape: str, transport: str, count: int
) -> AbstractAsyncContextManager[tuple[Send, int]]:
    if shape == "references":
        return _references(running, transport, count, settings.item_bytes)
    if shape == "warm references":
        return _warm_references(running, count, settings.item_bytes)
    if shape in ATTACKS:
        return _created(running, transport, attack_frame(shape, settings.min_length))
    return memory.armed(running, shape, transport, settings.nbytes)


def _status(pid: int, field: str) -> int | None:
    """`status_kib`, or None once the process is gone."""
    try:
        return status_kib(pid, field)
    except (OSError, RuntimeError):
        return None


async def _bounded(send: Send, pid: int, most: int, timeout_s: float) -> tuple[str, str | None]:
    """`send()`'s answer, or why it was given up on first: `timeout`, or `memory` once the
    process holds more than `most` bytes. A failure to send or to read is an answer too."""
    answer, stopped = "", None

    async def sending() -> None:
        nonlocal answer
        try:
            answer = await send()
        except Exception as exc:  # a lost connection is what this client saw: say so
            answer = f"{type(exc).__name__}: {exc}"[:120]
        nursery.cancel_scope.cancel()

    async def guarding() -> None:
        nonlocal stopped
        while True:  # /proc has nothing to wait on: it is read every 50 ms
            rss = _status(pid, "VmRSS")
            if rss is not None and rss > most:
                break
            await trio.sleep(0.05)
        stopped = "memory"
        nursery.cancel_scope.cancel()

    with trio.move_on_after(timeout_s) as waited:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sending)
            nursery.start_soon(guarding)
    return answer, "timeout" if waited.cancelled_caught else stopped


async def _probe(
    running: Server, settings: ProbeSettings, shape: str, transport: str, count: int
) -> dict[str, Any]:
    pid = running.pid
    async with _armed(running, settings, shape, transport, count) as (send, size):
        async with watching(running.http) as bystander:
            baseline = status_kib(pid, "VmRSS")
            reset = memory.reset_peak(pid)
            most = baseline + int(RSS_STOP * settings.max_memory_mib * MiB)
            started = time.perf_counter()
            answer, stopped = await _bounded(send, pid, most, settings.timeout_s)
            answer_s = time.perf_counter() - started
            peak = _status(pid, "VmHWM")
            waits = await bystander.stop()
        if stopped:
            running.process.kill()  # before the client lets go: it may be blocked for minutes
    return {"answer": answer, "stopped": stopped, "answer_s": answer_s, "frame": size,
            "baseline": baseline, "peak": None if peak is None else peak - baseline,
            "peak_reset": reset, **waits}  # fmt: skip


def measure(
    settings: ProbeSettings, progress: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Every case, `repeats` times, each run against a server of its own; a row per case."""
    biggest = max(settings.nbytes, settings.item_bytes)
    flags = ["--max-message-bytes", str(max(2 * biggest, 1 << 24)),
             "--max-memory", str(settings.max_memory_mib)]  # fmt: skip
    rows = []
    cases = settings.cases()
    for number, (shape, transport, count) in enumerate(cases, 1):
        runs = []
        for repeat in range(settings.repeats):
            progress(f"probes [{number}/{len(cases)}] {label(shape, count)} over {transport}"
                     + (f", repeat {repeat + 1}" if settings.repeats > 1 else ""))  # fmt: skip
            with memory.server(flags, script=shape not in BUILT_IN) as running:
                runs.append(trio.run(_probe, running, settings, shape, transport, count))
            progress(f"  {_answered(runs[-1])}, worst wait {runs[-1]['worst_wait_ms']:,.0f} ms")
        rows.append(_summary(shape, transport, count, settings, runs))
    return rows


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(run[key] for run in runs))


def _summary(
    shape: str, transport: str, count: int, settings: ProbeSettings, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The case's row: medians of its times, its highest peak, every run kept."""
    peaks = [run["peak"] for run in runs if run["peak"] is not None]
    return {
        "shape": label(shape, count),
        "transport": transport,
        "frame": runs[0]["frame"],
        "answer": _answered(runs[-1]),
        "refused": _refused(runs[-1]),
        "stopped": next((run["stopped"] for run in runs if run["stopped"]), None),
        "answer_s": _median(runs, "answer_s"),
        "worst_wait_ms": _median(runs, "worst_wait_ms"),
        "worst_gap_ms": _median(runs, "worst_gap_ms"),
        "peak": max(peaks, default=None),
        "max_memory": settings.max_memory_mib * MiB,
        "runs": runs,
    }


def _answered(run: dict[str, Any]) -> str:
    if run["stopped"] == "timeout":
        return f"none in {run['answer_s']:.0f} s (--probe-timeout)"
    if run["stopped"] == "memory":
        return f"none in {run['answer_s']:.1f} s: stopped past {RSS_STOP:g}x --max-memory"
    return str(run["answer"])


def _refused(run: dict[str, Any]) -> bool:
    answer = str(run["answer"])
    return not run["stopped"] and answer.startswith(
        ("HTTP 4", "HTTP 5", "error", "response.failed")
    )


def goals(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """Each goal, and whether it holds, with the figure that says so."""

    def where(row: dict[str, Any]) -> str:
        return f"{row['shape']} over {row['transport']}"

    found = []
    slow = [r for r in rows if r["worst_wait_ms"] > LOOP_GOAL_MS]
    worst = max(rows, key=lambda r: r["worst_wait_ms"])
    control = [f"{r['worst_wait_ms']:,.0f}" for r in rows if r["shape"] == "control"]
    found.append((not slow, f"the loop never blocked more than {LOOP_GOAL_MS:g} ms by one "
                  f"request: worst wait {worst['worst_wait_ms']:,.0f} ms ({where(worst)}); "
                  f"{len(slow)} of {len(rows)} cases past it"
                  + (f" (control: {', '.join(control)} ms)" if control else "")))  # fmt: skip
    past = [r for r in rows if r["peak"] is not None and r["peak"] > r["max_memory"]]
    unknown = [r for r in rows if r not in past and (r["stopped"] or r["peak"] is None)]
    high = max(rows, key=lambda r: -1 if r["peak"] is None else r["peak"])
    found.append((not past and not unknown, "peak RSS within --max-memory plus the baseline "
                  "for every shape: "
                  f"highest {_mb(high['peak'])} MB above the baseline ({where(high)}), "
                  f"--max-memory {_mb(high['max_memory'])} MB; {len(past)} of {len(rows)} "
                  f"cases past it, {len(unknown)} more stopped first (peak unknown)"))  # fmt: skip
    refs = [r for r in rows if "references" in r["shape"]]
    if refs:
        held = [_reference_holds(r) for r in refs]
        figures = "; ".join(
            f"{where(r)}: {_outcome(r)} in {r['answer_s'] * 1000:,.0f} ms, worst wait "
            f"{r['worst_wait_ms']:,.0f} ms"
            for r in refs
        )
        found.append((all(held), "references to a big item: refused in under "
                      f"{LOOP_GOAL_MS:g} ms, or served within the budget off the loop: "
                      f"{figures}"))  # fmt: skip
    return found


def _outcome(row: dict[str, Any]) -> str:
    return "no answer" if row["stopped"] else "refused" if row["refused"] else "served"


def _reference_holds(row: dict[str, Any]) -> bool:
    if row["stopped"]:
        return False
    if row["refused"]:
        return bool(row["answer_s"] * 1000 < LOOP_GOAL_MS)
    peak = row["peak"]
    return peak is not None and peak <= row["max_memory"] and row["worst_wait_ms"] <= LOOP_GOAL_MS


def _mb(nbytes: float | None) -> str:
    return "?" if nbytes is None else f"{nbytes / MiB:,.1f}"


def render(rows: list[dict[str, Any]], settings: ProbeSettings) -> str:
    lines = [
        f"{'shape':<22} {'over':<12} {'request B':>11} {'answer s':>9} {'worst wait ms':>13} "
        f"{'peak MB':>8} {'max MB':>7}  answer"
    ]
    for r in rows:
        peak = (">=" if r["stopped"] else "") + _mb(r["peak"])
        lines.append(
            f"{r['shape']:<22} {r['transport']:<12} {r['frame']:>11,} "
            f"{r['answer_s']:>9.2f} {r['worst_wait_ms']:>13,.0f} {peak:>8} "
            f"{_mb(r['max_memory']):>7}  {r['answer']}"
        )
    repeats = f"median of {settings.repeats} runs; " if settings.repeats > 1 else ""
    lines += ["", f"({repeats}peak: the highest above the baseline; worst wait: the bystander's "
              "longest for GET /healthz while the request was in flight)", "Goals:"]  # fmt: skip
    lines += [f"  [{'HOLDS' if holds else 'FAILS'}] {text}" for holds, text in goals(rows)]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------


def run(settings: ProbeSettings, out: Path) -> int:
    """The cases' table and the goals, saved as probes.json in `out`; 1 if a goal fails."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = measure(settings, partial(print, file=sys.stderr, flush=True))
    took = time.perf_counter() - started
    print(f"proto-server bench probes: {len(rows)} cases, --max-memory "
          f"{settings.max_memory_mib} MiB; took {took:.0f} s\n")  # fmt: skip
    print(render(rows, settings))
    found = goals(rows)
    path = out / "probes.json"
    data = {"settings": attrs.asdict(settings), "cases": rows,
            "goals": [{"holds": holds, "goal": text} for holds, text in found]}  # fmt: skip
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    print(f"Saved {path}")
    return 0 if all(holds for holds, _ in found) else 1
