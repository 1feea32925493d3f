"""What an operator scrapes: `GET /metrics` in the Prometheus text format (`prometheus_client`).

The metrics are the process's own, module-level, as Prometheus clients keep them. Under
`--workers` the supervisor gives every worker one directory (`PROMETHEUS_MULTIPROC_DIR`) before
it starts, so each worker's values live in files there and a scrape of any worker adds up all
of them (`prometheus_client`'s multi-process mode: counters and histograms summed, the open
connections and suspended Responses summed over the workers alive).

Counted where it happens, each at one place: connections (app.py), the events and bytes each
connection writes and the Responses they end (`sent`, from the WebSocket writer and the SSE
writer), turns with their tokens and phases (`turn_ended`, from the sampling loop's record),
suspensions and evictions (suspension.py, memory.py), store calls and the state of the SQLite
file (`TimedStore`), what the chat-template renderer's cache did (`rendered`, after each
render: the engine's renderer keeps its own counts, taken from here).

The series are declared once, module-level, and each gauge's
`multiprocess_mode` must agree with how `exposition` and `worker_gone` add up the workers' files,
so declaration, merge and scrape are read together. `TimedStore` is here as the one place the
store's two series are counted.
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from proto_server.core.render import Renderer
from proto_server.core.shared_capacity import Load
from proto_server.engine.model_renderer import ModelRenderer
from proto_server.engine.replicas import ReplicaState
from proto_server.server.store import (
    ANONYMOUS,
    FileStore,
    ItemStore,
    LoadStore,
    ProbedStore,
    ResponseStore,
    StoredResponse,
    SuspendedResponse,
    SuspensionStore,
)
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ErrorEvent, ServerEvent
from proto_server.wire.items import Item

#: Set by the supervisor of `--workers` for its workers: their shared directory of values.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
#: In that directory: what dead workers counted, one file per type, read as any worker's is...
ARCHIVE = "archive"
#: ...and the lock a scrape shares and a merge takes alone, so a scrape never counts a dead
#: worker's values twice (in its file and in the archive) or misses them.
_MERGE_LOCK = "merge.lock"
#: The types whose values outlive their process (a dead worker's live gauges are dropped).
_KEPT_TYPES = ("counter", "histogram", "summary")
#: The `reason` of `proto_server_evictions` for a rendering the renderer let go.
RENDER_CACHE_EVICTED = "render_cache"
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

CONNECTIONS = Gauge(
    "proto_server_connections_open", "Open connections (WebSocket and HTTP)",
    multiprocess_mode="livesum",
)  # fmt: skip
SUSPENDED = Gauge(
    "proto_server_suspended_responses", "Prototype Responses suspended on tool calls",
    multiprocess_mode="livesum",
)  # fmt: skip
RESUMES = Counter(
    "proto_server_resumes",
    "Suspended prototype Responses resumed by id from the store (rebuilt cold), by outcome",
    ["outcome"],
)  # fmt: skip
RESPONSES = Counter(
    "proto_server_responses", "Responses ended, by dialect and final status",
    ["dialect", "status"],
)  # fmt: skip
SEND_TIMEOUTS = Counter(
    "proto_server_send_timeouts",
    "Connections let go because their client accepted no bytes for --send-timeout, by transport",
    ["transport"],
)
EVICTIONS = Counter("proto_server_evictions", "Responses or caches let go, by reason", ["reason"])
RENDER_CACHE = Counter(
    "proto_server_render_cache",
    "Messages the chat-template renderer found among those it kept (hit) or rendered (miss)",
    ["outcome"],
)
RENDER_CACHE_KEPT = Gauge(
    "proto_server_render_cache_bytes", "Bytes of rendered messages kept (--render-cache-mb)",
    multiprocess_mode="livesum",
)  # fmt: skip
TURNS = Counter(
    "proto_server_turns",
    "Turns by where their state came from (fresh, cache, store, rebuilt, append, compacted, "
    "failover: prefilled again on another engine replica)",
    ["source"],
)
TOKENS = Counter(
    "proto_server_tokens",
    "Tokens: rendered by the server, in prompts, of those already cached",
    ["kind"],
)
PHASE = Histogram(
    "proto_server_phase_seconds",
    "Per turn: prepare (request in to the generator starting), decode (the generator's "
    "segments), first_event (request in to its first event handed to the writer)",
    ["phase"],
    buckets=_SLOW,
)
WRITE = Histogram(
    "proto_server_event_write_seconds", "Writing one event to the client's socket",
    ["transport"], buckets=_FAST,
)  # fmt: skip
FRAMES = Counter("proto_server_frames_out", "Events written, by transport", ["transport"])
BYTES = Counter("proto_server_bytes_out", "Bytes of events written, by transport", ["transport"])
LARGE_EVENTS = Counter(
    "proto_server_large_events",
    "Events over --max-event-bytes, by dialect, transport and what was done: output_omitted "
    "(a prototype snapshot sent without its output), sent_whole (its clients need all of it)",
    ["dialect", "transport", "action"],
)
ERRORS = Counter("proto_server_errors", "Error events and failed Responses sent, by code", ["code"])
STORE = Histogram(
    "proto_server_store_seconds", "Calls to the persisted store, by operation and outcome",
    ["operation", "outcome"], buckets=_FAST + _SLOW[-6:],
)  # fmt: skip
STORE_FILE_LOST = Gauge(
    "proto_server_store_file_lost",
    "1 while the SQLite file at --store is not the one the server opened (deleted or "
    "replaced): /readyz answers 503 and store calls fail store_unavailable",
    multiprocess_mode="livemax",
)
MEMORY_USED = Gauge(
    "proto_server_memory_used_bytes",
    "What the process memory budget (--max-memory) charges now: kept rollouts, queued and "
    "waiting requests and steers, frames in preparation",
    multiprocess_mode="livesum",
)
MEMORY_PEAK = Gauge(
    "proto_server_memory_peak_bytes",
    "The most the process memory budget ever charged (`proto-server bench memory` compares it "
    "with the peak RSS)",
    multiprocess_mode="livemax",
)

# admission by KV capacity (server/rollouts/admission.py), when --kv-capacity-tokens is set
ADMISSION_TTL = Gauge(
    "proto_server_admission_ttl_seconds",
    "How long a suspended admitted rollout keeps its place now (--admission-ttl, or "
    "--admission-ttl-median times the median time away, if shorter)",
    multiprocess_mode="livemax",
)
KV_CAPACITY = Gauge(
    "proto_server_kv_capacity_tokens",
    "Engine KV cache tokens the server schedules against (--kv-capacity-tokens x --kv-target-fill)",
    multiprocess_mode="livemax",
)
KV_RESERVED = Gauge(
    "proto_server_kv_reserved_tokens",
    "Tokens reserved for admitted rollouts: what they hold, or --admission-growth times it",
    multiprocess_mode="livesum",
)  # fmt: skip
ADMISSION_PEERS = Gauge(
    "proto_server_admission_peers",
    "Server processes admitting against the engines together (--admission-shared), this one "
    "included, as its last look at their loads found them",
    multiprocess_mode="livemax",
)
ADMITTED = Gauge(
    "proto_server_admitted_rollouts", "Rollouts admitted to the engine (streaming or kept)",
    multiprocess_mode="livesum",
)  # fmt: skip
ADMISSION_WAITING = Gauge(
    "proto_server_waiting_rollouts", "Rollouts waiting for room in the engine's KV cache",
    multiprocess_mode="livesum",
)  # fmt: skip
ADMISSION_DEMOTIONS = Counter(
    "proto_server_admission_demotions",
    "Suspended rollouts whose kept place lapsed (--admission-ttl) while others waited",
)
ADMISSION_RECLAIMS = Counter(
    "proto_server_admission_reclaims",
    "Suspended rollouts whose place was taken back for another key's waiter, their key holding "
    "more than its fair share",
)
ADMISSION_OVERFLOWS = Counter(
    "proto_server_admission_overflows",
    "Suspended rollouts that gave their place up because the admitted ones had outgrown the "
    "KV capacity (--admission-overflow)",
)
ADMISSION_WAIT = Histogram(
    "proto_server_admission_wait_seconds", "How long rollouts that had to wait waited",
    buckets=_SLOW,
)  # fmt: skip

# engine replicas (engine/replicas.py), when --engine-url is given more than once
ENGINE_UP = Gauge(
    "proto_server_engine_up",
    "1 while an engine replica answers, 0 while it is taken out (by a failed segment or probe)",
    ["engine"], multiprocess_mode="livemin",
)  # fmt: skip
ENGINE_ROLLOUTS = Gauge(
    "proto_server_engine_rollouts", "Rollouts placed on each engine replica",
    ["engine"], multiprocess_mode="livesum",
)  # fmt: skip
ENGINE_TOKENS = Gauge(
    "proto_server_engine_tokens", "Tokens the rollouts placed on each engine replica hold",
    ["engine"], multiprocess_mode="livesum",
)  # fmt: skip
ENGINE_FAILOVERS = Counter(
    "proto_server_engine_failovers",
    "Rollouts moved off an engine replica that went down (prefilled again on another), by "
    "the replica they were warm on",
    ["engine"],
)


class ReplicaMetrics:
    """The engine replicas' series: `ReplicatedGenerator` reports to it."""

    def replica_changed(self, state: ReplicaState) -> None:
        ENGINE_UP.labels(state.name).set(1 if state.up else 0)
        ENGINE_ROLLOUTS.labels(state.name).set(state.rollouts)
        ENGINE_TOKENS.labels(state.name).set(state.tokens)

    def rollout_moved(self, lost: str, engine: str) -> None:
        ENGINE_FAILOVERS.labels(lost).inc()


_TERMINAL = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
    "response.cancelled": "cancelled",
}


#: Per transport, its three series, looked up once: this runs for every event sent.
_OUT = {
    transport: (FRAMES.labels(transport), BYTES.labels(transport), WRITE.labels(transport))
    for transport in ("websocket", "sse", "json")
}


def sent(event: ServerEvent, *, dialect: str, transport: str, size: int, seconds: float) -> None:
    """One event went to a client: `size` bytes in `seconds`."""
    frames, nbytes, write = _OUT[transport]
    frames.inc()
    nbytes.inc(size)
    write.observe(seconds)
    ended(event, dialect=dialect)


def ended(event: ServerEvent, *, dialect: str) -> None:
    """What `event` ends or says went wrong, whether or not its client got it (one cut for
    `--send-timeout` never does)."""
    status = _TERMINAL.get(event.type)
    if status is not None:
        RESPONSES.labels(dialect, status).inc()
        error = getattr(getattr(event, "response", None), "error", None)
        if error is not None:
            ERRORS.labels(error.code).inc()
    elif isinstance(event, ErrorEvent):
        ERRORS.labels(event.error.code).inc()


def turn_ended(
    *, source: str, rendered: int, prompt: int, cached: int, prepare_s: float | None,
    decode_s: float, first_event_s: float | None,
) -> None:  # fmt: skip
    TURNS.labels(source).inc()
    TOKENS.labels("rendered").inc(rendered)
    TOKENS.labels("prompt").inc(prompt)
    TOKENS.labels("cached").inc(cached)
    for phase, seconds in (("prepare", prepare_s), ("decode", decode_s),
                           ("first_event", first_event_s)):  # fmt: skip
        if seconds is not None:
            PHASE.labels(phase).observe(seconds)


def rendered(renderer: Renderer) -> None:
    """After a render: what the renderer's cache did since the last call (if it keeps one)."""
    if not isinstance(renderer, ModelRenderer):
        return
    cache = renderer.rendered
    hits, misses, evicted = cache.take_counts()
    RENDER_CACHE.labels("hit").inc(hits)
    RENDER_CACHE.labels("miss").inc(misses)
    EVICTIONS.labels(RENDER_CACHE_EVICTED).inc(evicted)
    RENDER_CACHE_KEPT.set(cache.nbytes)


def exposition() -> bytes:
    """The scrape: this process's metrics, or every worker's under `--workers`."""
    directory = os.environ.get(MULTIPROC_ENV)
    if directory:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
        with _locked(directory, fcntl.LOCK_SH):
            return prometheus_client.generate_latest(registry)
    return prometheus_client.generate_latest()


@contextmanager
def _locked(directory: str, how: int) -> Iterator[None]:
    with open(os.path.join(directory, _MERGE_LOCK), "a") as lock:
        fcntl.flock(lock, how)
        yield  # closing the file lets go of the lock


def worker_gone(pid: int, directory: str) -> None:
    """A worker ended: its live gauges no longer count, and what it counted (counters,
    histograms) is added to the archive of its type and its own files removed, so a restarted
    worker leaves one file per type behind however often it dies, and every total stays exact.

    Values are summed key by key: a file holds each series' own value (histogram buckets not
    yet cumulative), so the sum of two files reads as both did."""
    with _locked(directory, fcntl.LOCK_EX):
        mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        for kind in _KEPT_TYPES:
            dead = os.path.join(directory, f"{kind}_{pid}.db")
            if not os.path.exists(dead):
                continue
            archive = os.path.join(directory, f"{kind}_{ARCHIVE}.db")
            totals: defaultdict[str, float] = defaultdict(float)
            for path in (archive, dead):
                if os.path.exists(path):
                    values = MmapedDict.read_all_values_from_file(path)  # type: ignore[no-untyped-call]
                    for key, value, _, _ in values:
                        totals[key] += value
            partial = os.path.join(directory, f"{kind}_{ARCHIVE}.partial")  # not a `*.db`
            merged = MmapedDict(partial)  # type: ignore[no-untyped-call]
            try:
                for key, value in totals.items():
                    merged.write_value(key, value, 0.0)  # type: ignore[no-untyped-call]
            finally:
                merged.close()  # type: ignore[no-untyped-call]
            os.replace(partial, archive)
            os.remove(dead)


class TimedStore:
    """A store whose every call is timed into `proto_server_store_seconds`."""

    def __init__(self, store: ResponseStore) -> None:
        self.inner = store

    @contextmanager
    def _timed(self, operation: str) -> Iterator[None]:
        started = time.perf_counter()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except ProtocolError:
            outcome = "ok"  # it answered: what was asked of it is refused (too much to read)
            raise
        finally:
            STORE.labels(operation, outcome).observe(time.perf_counter() - started)
            self._file_checked()

    def _file_checked(self) -> None:
        """The SQLite file's state as its last check saw it (every call and `/readyz` check)."""
        if isinstance(self.inner, FileStore):
            STORE_FILE_LOST.set(0 if self.inner.file_lost is None else 1)

    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        with self._timed("put"):
            if ends_suspension is None:
                await self.inner.put(stored)
            else:
                await self.inner.put(stored, ends_suspension=ends_suspension)

    @property
    def suspensions(self) -> SuspensionStore | None:
        """The inner store, if it keeps suspended Responses (a test's dict store may not)."""
        return self.inner if isinstance(self.inner, SuspensionStore) else None

    def _suspending(self) -> SuspensionStore:
        inner = self.suspensions
        assert inner is not None, "this store keeps no suspended Responses"
        return inner

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        with self._timed("suspend"):
            await self._suspending().suspend(suspended, since=since, expected=expected)

    async def suspended(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> SuspendedResponse | None:
        with self._timed("suspended"):
            return await self._suspending().suspended(response_id, owner=owner)

    async def claim(
        self, response_id: str, *, owner: str, version: int, lapsed_before: float = -math.inf
    ) -> bool:
        with self._timed("claim"):
            return await self._suspending().claim(
                response_id, owner=owner, version=version, lapsed_before=lapsed_before
            )

    async def release(self, response_id: str, *, version: int) -> None:
        with self._timed("release"):
            await self._suspending().release(response_id, version=version)

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        with self._timed("get"):
            return await self.inner.get(response_id, owner=owner)

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        with self._timed("chain"):
            return await self.inner.chain(response_id, owner=owner)

    async def items(
        self, item_ids: Sequence[str], *, owner: str, max_bytes: int | None = None
    ) -> dict[str, Item]:
        """The inner store's items of these ids (none, if it cannot look items up)."""
        if not isinstance(self.inner, ItemStore):
            return {}
        with self._timed("items"):
            return await self.inner.items(item_ids, owner=owner, max_bytes=max_bytes)

    async def delete(self, response_id: str, *, owner: str) -> bool:
        """Whether the inner store held and deleted it (one that cannot delete holds nothing
        it could)."""
        if not isinstance(self.inner, ItemStore):
            return False
        with self._timed("delete"):
            return await self.inner.delete(response_id, owner=owner)

    @property
    def loads(self) -> LoadStore | None:
        """The inner store, if the server processes can share their loads through it."""
        return self if isinstance(self.inner, LoadStore) else None

    async def publish_load(self, peer: str, load: Load, *, stale_s: float) -> list[Load]:
        assert isinstance(self.inner, LoadStore), "this store keeps no loads"
        with self._timed("publish_load"):
            return await self.inner.publish_load(peer, load, stale_s=stale_s)

    async def withdraw(self, peer: str) -> None:
        assert isinstance(self.inner, LoadStore), "this store keeps no loads"
        with self._timed("withdraw"):
            await self.inner.withdraw(peer)

    async def readiness(self) -> str | None:
        """The inner store's answer to `/readyz`, if it has one (else it is as ready as this)."""
        inner = self.inner
        problem = await inner.readiness() if isinstance(inner, ProbedStore) else None
        self._file_checked()
        return problem

    async def aclose(self) -> None:
        await self.inner.aclose()
