"""`proto-server bench fleet`: the server's scheduler past this machine, in virtual time.

N rollouts on R modelled engine replicas, a discrete-event simulation (a heap of events, no
sleeping, no clock): every figure is modelled. Each replica is engine-like: a bounded prefix
cache of blocks (the simulated GPU's `PrefixCache`: LRU eviction of free blocks, running
sequences' blocks pinned, as vLLM's), a bound on running sequences, and steps that prefill up to
a token budget at a modelled rate and decode one token for every running sequence at once; when
a growing sequence finds no free block, the newest running one is preempted (recomputed later).

The same seeded workload (`lognormal` draws with the issue's shapes) runs under each policy:

- plain: every segment forwarded as it comes, round-robin over the replicas, no admission
  (a load balancer in front of stock vLLM);
- affinity: the server's `Router` (a rollout stays on its replica, new ones go to the least
  loaded), no admission;
- continuum (modelled): the `Router`, and in each replica Continuum's pins and program order
  (`fleet_policies.ContinuumPins`);
- thunderagent (modelled): ThunderAgent's program scheduler in front of stock replicas
  (`fleet_policies.ThunderAgent`), its ticks, pauses and resumes as events;
- proto-server: the `Router` and, per replica, the server's `Scheduler` (admission of whole
  rollouts by KV capacity, keep-alive TTL), unchanged.

The two peers are models of their published policies, labelled so wherever a figure is shown;
what each keeps and leaves out is in its class's docstring.

The core (`simulate`) is sans-IO and deterministic for a seed; `main` prints, writes and plots.

Why one module of this length: `Replica`'s block names and `unbounded_need` share one model of the
cache (the shared prefix's full blocks are everyone's, the rest a rollout's own, a partial block
prefilled again), and the ratio printed means something only while they agree. The policies differ
in a few branches of `simulate`, so all of them run on the same replica and event loop, read in
one place; the peers' own rules live in `fleet_policies`.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs

from proto_server.bench.agents import PUBLISHED_WAIT_RATIO, lognormal, percentile
from proto_server.bench.fleet_policies import (
    FORCE_RESUME_S,
    ContinuumPins,
    ThunderAgent,
    continuum_counters,
)
from proto_server.bench.report import NO_PLOTS, pyplot
from proto_server.bench.tables import table
from proto_server.core.routing import Router
from proto_server.core.scheduler import Scheduler
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.server.config import ServerConfig

CONTINUUM, THUNDERAGENT = "continuum (modelled)", "thunderagent (modelled)"
POLICIES = ("plain", "affinity", CONTINUUM, THUNDERAGENT, "proto-server")
RATIOS = ("jct_mean_s", "jct_p50_s", "jct_p99_s", "makespan_s", "prefilled_tokens")
#: How much shorter proto-server's mean JCT is to be than the modelled ThunderAgent's.
THUNDERAGENT_GOAL = 1.3
PLOTS = ("fleet-jct.png", "fleet-prefilled.png")
Progress = Callable[[str], None]


@attrs.frozen(kw_only=True)
class FleetSettings:
    rollouts: int = 1000
    replicas: int = 8
    seed: int = 2
    #: Turns a rollout (log-normal, median and p99; vLLM's AgentX median of 43 scaled down).
    turns: tuple[float, float] = (8.0, 32.0)
    #: The instructions and tools every rollout shares, in tokens.
    shared_tokens: int = 1024
    #: Each rollout's own first message (log-normal, median and p99).
    context_tokens: tuple[float, float] = (2000.0, 8000.0)
    #: A tool output (log-normal, median and p99).
    tool_tokens: tuple[float, float] = (400.0, 4000.0)
    #: What the model decodes a turn (log-normal; AgentX's 444 a turn scaled down).
    output_tokens: tuple[float, float] = (64.0, 256.0)
    #: Tool waits between turns (log-normal): the published Codex gaps, 5.2 s median, 81.4 s p99.
    wait_s: tuple[float, float] = (5.2, 5.2 * PUBLISHED_WAIT_RATIO)
    #: Rollouts start uniformly over this window (0: all at once, as an RL step launches them).
    arrival_s: float = 0.0
    #: Each replica's KV cache, in tokens, and its block.
    cache_tokens: int = 262_144
    block_tokens: int = 16
    #: Running sequences a replica holds at most (vLLM's --max-num-seqs).
    max_running: int = 128
    #: Prompt tokens a step may prefill (vLLM's --max-num-batched-tokens), and at what rate.
    step_tokens: int = 8192
    prefill_rate: float = 10_000.0
    #: A step's decode time (one token for every running sequence).
    step_s: float = 0.03
    #: The server's admission: the share of a replica's cache its admitted rollouts may fill
    #: (--kv-target-fill) and how long a suspended one keeps its place (--admission-ttl).
    target_fill: float = 0.9
    ttl_s: float = 30.0
    #: The server's --admission-ttl-median (None: off).
    ttl_median: float | None = None
    #: The server's --admission-bypass: its oldest waiter is passed by at most this many.
    bypass: int = ServerConfig().admission_bypass
    #: The server's --admission-growth: a rollout is admitted for this many times its tokens.
    growth: float = ServerConfig().admission_growth
    #: ThunderAgent's --scheduler-interval and --use-acting-token-decay (its defaults).
    thunder_interval_s: float = 5.0
    thunder_decay: bool = False
    #: Continuum's TTL until it has seen more than 100 tool times (its fork's 2 s).
    continuum_ttl_s: float = 2.0
    out_dir: Path = Path("bench-results")

    def problems(self) -> list[str]:
        """What is wrong with these settings, in words (empty: nothing)."""
        found = []
        counts = (
            ("--rollouts", self.rollouts),
            ("--replicas", self.replicas),
            ("--block-tokens", self.block_tokens),
            ("--max-running", self.max_running),
            ("--step-tokens", self.step_tokens),
        )
        found += [f"{flag} must be at least 1, got {value}" for flag, value in counts if value < 1]
        if self.shared_tokens < 0:
            found.append(f"--shared-tokens must be at least 0, got {self.shared_tokens}")
        if self.cache_tokens < 2 * self.block_tokens:
            found.append(
                f"--cache-tokens must hold at least 2 blocks ({2 * self.block_tokens} "
                f"tokens), got {self.cache_tokens}"
            )
        for flag, (median, p99) in (
            ("--fleet-turns", self.turns),
            ("--context-tokens", self.context_tokens),
            ("--tool-tokens", self.tool_tokens),
            ("--output-tokens", self.output_tokens),
            ("--wait-s", self.wait_s),
        ):
            if not (0 < median <= p99 < math.inf):
                found.append(f"{flag}: expected 0 < MEDIAN <= P99, finite; got {median},{p99}")
        for flag, value in (
            ("--prefill-rate", self.prefill_rate),
            ("--step-ms", self.step_s),
            ("--ttl-s", self.ttl_s),
            ("--thunderagent-interval", self.thunder_interval_s),
            ("--continuum-ttl", self.continuum_ttl_s),
        ):
            if not (0 < value < math.inf):
                found.append(f"{flag} must be positive and finite, got {value}")
        if self.ttl_median is not None and not (0 < self.ttl_median < math.inf):
            found.append(f"--ttl-median must be positive and finite, got {self.ttl_median}")
        if self.bypass < 0:
            found.append(f"--bypass must be at least 0, got {self.bypass}")
        if not (0 <= self.arrival_s < math.inf):
            found.append(f"--arrival-s must be at least 0 and finite, got {self.arrival_s}")
        if not (0 < self.target_fill <= 1):
            found.append(f"--kv-target-fill must be in (0, 1], got {self.target_fill}")
        if not 1 <= self.growth <= 100:
            found.append(f"--admission-growth must be between 1 and 100, got {self.growth}")
        return found


# -- the workload --------------------------------------------------------------------------------


@attrs.frozen
class Rollout:
    """One rollout: its own context, and per turn what it decodes, then (but for the last) its
    tool's wait and output."""

    index: int
    start_s: float
    context_tokens: int
    output_tokens: tuple[int, ...]
    waits_s: tuple[float, ...]
    tool_tokens: tuple[int, ...]

    def prompt(self, turn: int, shared: int) -> int:
        """Turn `turn`'s prompt (0-based): everything before it, appended."""
        return (
            shared
            + self.context_tokens
            + sum(self.output_tokens[:turn])
            + sum(self.tool_tokens[:turn])
        )


def make_rollouts(settings: FleetSettings) -> list[Rollout]:
    """The workload, from `settings.seed`."""
    rng = random.Random(settings.seed)
    made = []
    for index in range(settings.rollouts):
        turns = max(2, round(lognormal(rng, *settings.turns)))
        start = rng.uniform(0.0, settings.arrival_s) if settings.arrival_s else 0.0
        context = max(1, round(lognormal(rng, *settings.context_tokens)))
        outputs = tuple(
            max(1, round(lognormal(rng, *settings.output_tokens))) for _ in range(turns)
        )
        waits = tuple(lognormal(rng, *settings.wait_s) for _ in range(turns - 1))
        tools = tuple(
            max(1, round(lognormal(rng, *settings.tool_tokens))) for _ in range(turns - 1)
        )
        made.append(Rollout(index, start, context, outputs, waits, tools))
    return made


def unbounded_need(rollouts: Sequence[Rollout], settings: FleetSettings, replicas: int) -> int:
    """What caches that never evict would prefill, each rollout kept on one replica: the shared
    prefix's full blocks once per replica used, then per turn its prompt less the full blocks of
    what was there before (the previous prompt and answer; on a first turn, the shared prefix).
    A partial last block is prefilled again, as vLLM does."""
    block = settings.block_tokens
    shared_blocks = settings.shared_tokens // block
    need = min(replicas, len(rollouts)) * shared_blocks * block
    for r in rollouts:
        known = shared_blocks
        for turn, output in enumerate(r.output_tokens):
            prompt = r.prompt(turn, settings.shared_tokens)
            need += prompt - known * block
            known = (prompt + output) // block
    return need


# -- one replica ---------------------------------------------------------------------------------


@attrs.define
class EngineSequence:
    """A segment on a replica: one turn of one rollout."""

    rollout: int
    turn: int
    prompt: int
    output: int
    generated: int = 0
    prefill_left: int = 0
    held: list[int] = attrs.field(factory=list)
    #: Preempted in the step under way (it runs again from the waiting queue).
    preempted: bool = False
    #: The rollout's last turn (it ends in no tool call).
    last: bool = False
    #: When it was submitted to the replica.
    asked: float = 0.0


class Replica:
    """An engine replica: waiting and running sequences over a bounded prefix cache; with
    `pins`, Continuum's engine (its pins, its queue by rollout, its choice of whom to preempt)."""

    def __init__(self, settings: FleetSettings, pins: ContinuumPins | None = None) -> None:
        self.s = settings
        self.pins = pins
        self.now = 0.0
        self.block = settings.block_tokens
        self.shared_blocks = settings.shared_tokens // self.block
        self.cache = PrefixCache(block_tokens=self.block, capacity_tokens=settings.cache_tokens)
        self.waiting: collections.deque[EngineSequence] = collections.deque()
        self.running: list[EngineSequence] = []
        self.finishing: list[EngineSequence] = []
        self._preempted: list[EngineSequence] = []
        self.busy = False
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.preemptions = 0

    def name(self, rollout: int, block: int) -> int:
        """A block's name: the shared prefix's are everyone's, the rest the rollout's own (its
        sequence only grows, so a block's position names its content)."""
        return -block - 1 if block < self.shared_blocks else rollout * 1_000_000 + block

    def submit(self, seq: EngineSequence, now: float) -> None:
        """`seq` joins the waiting queue: at its end, or with pins in its rollout's place."""
        seq.asked = now
        if self.pins is None:
            self.waiting.append(seq)
            return
        self.pins.arrived(seq.rollout, now)
        self._queue(seq)

    def _queue(self, seq: EngineSequence) -> None:
        assert self.pins is not None
        order = self.pins.order
        at = bisect.bisect_right(self.waiting, order(seq.rollout), key=lambda s: order(s.rollout))
        self.waiting.insert(at, seq)

    def _admit(self) -> None:
        """Waiting sequences into the running batch while the batch and the free blocks allow
        (the first always, when nothing runs)."""
        cache, capacity = self.cache, self.cache.capacity_blocks
        while self.waiting and len(self.running) < self.s.max_running:
            seq = self.waiting[0]
            length = seq.prompt + seq.generated
            names = [self.name(seq.rollout, b) for b in range(length // self.block)]
            if self.running and cache.pinned_blocks + len(names) + 1 > capacity:
                break
            self.waiting.popleft()
            hit = cache.cached_blocks(names)
            seq.held = cache.pin(names[:hit])
            cache.insert(names, hit)
            seq.held += cache.pin(names[hit:])
            seq.prefill_left = length - hit * self.block
            self.prompt_tokens += length
            self.cached_tokens += hit * self.block
            self.running.append(seq)
            if self.pins is not None:
                waited = self.now - seq.asked
                self.pins.admitted(seq.rollout, seq.turn, waited, self.now, cache)

    def step(self, now: float = 0.0) -> float:
        """One engine step at `now`: admit, prefill within the budget, decode a token for every
        sequence past its prefill; returns its modelled duration (its finished sequences are
        `finishing` until then)."""
        self.now = now
        if self.pins is not None and self.pins.due(now):
            self.pins.expire(now, {seq.rollout for seq in self.waiting}, self.cache)
        self._admit()
        budget = self.s.step_tokens
        prefilled = 0
        for seq in self.running:
            if seq.prefill_left and budget:
                take = min(seq.prefill_left, budget)
                seq.prefill_left -= take
                budget -= take
                prefilled += take
        for seq in list(self.running):
            if seq.prefill_left or seq.preempted:
                continue
            seq.generated += 1
            length = seq.prompt + seq.generated
            if length % self.block == 0 and not self._grow(
                seq, self.name(seq.rollout, length // self.block - 1)
            ):
                continue
            if seq.generated >= seq.output:
                self.finishing.append(seq)
        if self.finishing:
            done = {id(seq) for seq in self.finishing}
            self.running = [seq for seq in self.running if id(seq) not in done]
        for seq in self._preempted:
            seq.preempted = False
        self._preempted.clear()
        return self.s.step_s + prefilled / self.s.prefill_rate

    def _grow(self, seq: EngineSequence, name: int) -> bool:
        """`seq` needs a new block: with none free, preempt the newest running (recomputed
        when it runs again), as vLLM does; False when that was `seq` itself."""
        finishing = {id(s) for s in self.finishing}
        while self.cache.pinned_blocks >= self.cache.capacity_blocks:
            victims = [s for s in self.running if id(s) not in finishing and not s.preempted]
            if len(victims) < 2:
                break  # alone, it holds more than the cache (as the prefix cache allows)
            victim = victims[-1] if self.pins is None else self._continuum_victim(victims)
            self.running.remove(victim)
            self.cache.unpin(victim.held)
            victim.held = []
            victim.preempted = True
            self._preempted.append(victim)
            if self.pins is None:
                self.waiting.appendleft(victim)
            else:
                self._queue(victim)
            self.preemptions += 1
            if victim is seq:
                return False
        self.cache.insert([name])
        seq.held += self.cache.pin([name])
        return True

    def _continuum_victim(self, victims: list[EngineSequence]) -> EngineSequence:
        """The rollout that arrived last, a last turn only if nothing else runs."""
        assert self.pins is not None
        order = self.pins.order
        return max(victims, key=lambda s: (not s.last, order(s.rollout)))

    def finish(self, now: float = 0.0) -> list[EngineSequence]:
        """The sequences the last step finished (at `now`): their blocks are free (cached)
        again, or, with pins, pinned on after a turn that ends in a tool call."""
        done, self.finishing = self.finishing, []
        for seq in done:
            if self.pins is not None and not seq.last:
                tokens = seq.prompt + seq.output
                self.pins.finished(seq.rollout, seq.held, tokens, now, self.cache)
            else:
                self.cache.unpin(seq.held)
            seq.held = []
        return done

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


# -- the simulation ------------------------------------------------------------------------------


@attrs.frozen
class PolicyRun:
    policy: str
    jct_s: tuple[float, ...]
    makespan_s: float
    prompt_tokens: int
    cached_tokens: int
    unbounded_need_tokens: int
    preemptions: int
    evictions: int
    demotions: int
    admission_wait_s: float
    steps: int
    cpu_s: float
    #: A peer's own counters (ThunderAgent's pauses and resumes, Continuum's pins).
    counters: dict[str, float] = attrs.field(factory=dict)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


_READY, _STEP, _EXPIRE, _TICK, _TIMEOUT = 0, 1, 2, 3, 4


def simulate(settings: FleetSettings, rollouts: Sequence[Rollout], policy: str) -> PolicyRun:
    """Run `rollouts` under `policy` in virtual time: deterministic, no I/O."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    started = time.process_time()
    count = settings.replicas
    pins = [
        ContinuumPins(
            default_ttl_s=settings.continuum_ttl_s,
            reload_s_per_token=1 / settings.prefill_rate,
        )
        if policy == CONTINUUM
        else None
        for _ in range(count)
    ]
    replicas = [Replica(settings, pins[r]) for r in range(count)]
    router = Router(count, capacities=[settings.cache_tokens] * count)
    thunder = ThunderAgent(count, settings.cache_tokens, decay=settings.thunder_decay)
    capacity = max(1, int(settings.cache_tokens * settings.target_fill))
    schedulers = [
        Scheduler(
            capacity,
            ttl_s=settings.ttl_s,
            ttl_median=settings.ttl_median,
            bypass=settings.bypass,
            growth=settings.growth,
        )
        for _ in range(count)
    ]
    events: list[tuple[float, int, int, int]] = []
    order = itertools.count()
    turn_of = [0] * len(rollouts)
    placed = [0] * len(rollouts)
    asked = [0.0] * len(rollouts)
    ends = [0.0] * len(rollouts)
    expiries: set[tuple[float, int]] = set()
    admission_wait = 0.0
    steps = 0
    left = len(rollouts)
    round_robin = itertools.count()
    shared = settings.shared_tokens

    def push(at: float, kind: int, what: int) -> None:
        heapq.heappush(events, (at, next(order), kind, what))

    def submit(index: int, now: float) -> None:
        nonlocal admission_wait
        admission_wait += now - asked[index]
        r, turn = rollouts[index], turn_of[index]
        replica = replicas[placed[index]]
        prompt = r.prompt(turn, shared)
        last = turn + 1 == len(r.output_tokens)
        replica.submit(EngineSequence(index, turn, prompt, r.output_tokens[turn], last=last), now)
        if not replica.busy:
            replica.busy = True
            push(now, _STEP, placed[index])

    def watch_expiry(replica: int) -> None:
        at = schedulers[replica].next_expiry()
        if at < math.inf and (at, replica) not in expiries:
            expiries.add((at, replica))
            push(at, _EXPIRE, replica)

    def ready(index: int, now: float) -> None:
        """Rollout `index`'s next segment is ready (it began, or its tool answered)."""
        asked[index] = now
        r, turn = rollouts[index], turn_of[index]
        tokens = r.prompt(turn, shared) + r.output_tokens[turn]
        if policy == "plain":
            placed[index] = next(round_robin) % count
            submit(index, now)
            return
        if policy == THUNDERAGENT:  # it knows the request's prompt, not yet its answer
            backend = thunder.request(index, r.prompt(turn, shared), now)
            if backend is None:
                push(now + FORCE_RESUME_S, _TIMEOUT, index)
            else:
                placed[index] = backend
                submit(index, now)
            return
        placed[index] = router.place(index, tokens).replica
        if policy != "proto-server":
            submit(index, now)
            return
        scheduler = schedulers[placed[index]]
        answer = scheduler.request(index, "fleet", tokens, now)
        if answer.admitted:
            submit(index, now)
        wake(answer.woken, now)
        watch_expiry(placed[index])

    def wake(keys: Sequence[Hashable], now: float) -> None:
        for key in keys:
            assert isinstance(key, int)
            submit(key, now)

    def finished(seq: EngineSequence, now: float) -> None:
        nonlocal left
        index = seq.rollout
        r = rollouts[index]
        if seq.turn + 1 < len(r.output_tokens):
            turn_of[index] = seq.turn + 1
            if policy == THUNDERAGENT:
                thunder.finished(index, seq.prompt + seq.output, now)
            if policy == "proto-server":
                wake(schedulers[placed[index]].suspend(index, now), now)
                watch_expiry(placed[index])
            push(now + r.waits_s[seq.turn], _READY, index)
            return
        ends[index] = now
        left -= 1
        router.release(index)
        if policy == THUNDERAGENT:
            thunder.release(index)
        if policy == "proto-server":
            wake(schedulers[placed[index]].release(index), now)
            watch_expiry(placed[index])

    for r in rollouts:
        push(r.start_s, _READY, r.index)
    if policy == THUNDERAGENT:
        push(min(r.start_s for r in rollouts) + settings.thunder_interval_s, _TICK, 0)
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == _READY:
            ready(what, now)
        elif kind == _EXPIRE:
            expiries.discard((now, what))
            wake(schedulers[what].expire(now), now)
            watch_expiry(what)
        elif kind == _TICK:
            for index, backend in thunder.tick(now):
                placed[index] = backend
                submit(index, now)
            if left:
                push(now + settings.thunder_interval_s, _TICK, 0)
        elif kind == _TIMEOUT:
            # The timer of the request now waiting, not of an earlier one since resumed.
            current = now == asked[what] + FORCE_RESUME_S
            forced = thunder.timeout(what) if current else None
            if forced is not None:
                placed[what] = forced
                submit(what, now)
        else:
            replica = replicas[what]
            for seq in replica.finish(now):
                finished(seq, now)
            if replica.has_work:
                steps += 1
                push(now + replica.step(now), _STEP, what)
            else:
                replica.busy = False
    jct = tuple(ends[r.index] - r.start_s for r in rollouts)
    return PolicyRun(
        policy=policy,
        jct_s=jct,
        makespan_s=max(ends) - min(r.start_s for r in rollouts),
        prompt_tokens=sum(r.prompt_tokens for r in replicas),
        cached_tokens=sum(r.cached_tokens for r in replicas),
        unbounded_need_tokens=unbounded_need(rollouts, settings, count),
        preemptions=sum(r.preemptions for r in replicas),
        evictions=sum(r.cache.evicted for r in replicas),
        demotions=sum(s.demotions for s in schedulers),
        admission_wait_s=admission_wait,
        steps=steps,
        cpu_s=time.process_time() - started,
        counters=(
            thunder.counters()
            if policy == THUNDERAGENT
            else continuum_counters([p for p in pins if p is not None])
            if policy == CONTINUUM
            else {}
        ),
    )


# -- what a run says -----------------------------------------------------------------------------


def summarize(run: PolicyRun) -> dict[str, Any]:
    jct = run.jct_s
    need = run.unbounded_need_tokens
    return {
        "policy": run.policy,
        "time": "modelled (virtual time)",
        "jct_mean_s": statistics.fmean(jct),
        "jct_p50_s": percentile(jct, 0.5),
        "jct_p99_s": percentile(jct, 0.99),
        "makespan_s": run.makespan_s,
        "prompt_tokens": run.prompt_tokens,
        "cached_tokens": run.cached_tokens,
        "prefilled_tokens": run.prefilled_tokens,
        "unbounded_need_tokens": need,
        "prefilled_vs_unbounded": run.prefilled_tokens / need if need else math.nan,
        "kv_hit_rate": run.cached_tokens / run.prompt_tokens if run.prompt_tokens else math.nan,
        "preemptions": run.preemptions,
        "evictions_blocks": run.evictions,
        "demotions": run.demotions,
        "admission_wait_s_mean": run.admission_wait_s / max(1, len(jct)),
        "engine_steps": run.steps,
        "cpu_s": run.cpu_s,
        "counters": run.counters,
    }


def run_fleet(settings: FleetSettings, progress: Progress) -> dict[str, Any]:
    """Every policy on the same workload; the figures, side by side."""
    rollouts = make_rollouts(settings)
    turns = [len(r.output_tokens) for r in rollouts]
    finals = [
        r.prompt(len(r.output_tokens) - 1, settings.shared_tokens) + r.output_tokens[-1]
        for r in rollouts
    ]
    progress(
        f"fleet: {len(rollouts)} rollouts, {sum(turns)} turns on {settings.replicas} "
        f"modelled replicas of {settings.cache_tokens:,} cached tokens"
    )
    runs = []
    for policy in POLICIES:
        run = simulate(settings, rollouts, policy)
        progress(f"fleet: {policy}: {run.steps:,} modelled engine steps, {run.cpu_s:.1f} s CPU")
        runs.append(run)
    summaries = [summarize(run) for run in runs]
    by_name = {p["policy"]: p for p in summaries}
    proto = by_name["proto-server"]

    def over_proto(peer: str) -> dict[str, float]:
        return {key: by_name[peer][key] / proto[key] if proto[key] else math.nan for key in RATIOS}

    return {
        "settings": attrs.asdict(settings, value_serializer=_plain),
        "workload": {
            "rollouts": len(rollouts),
            "turns": {"total": sum(turns), "median": statistics.median(turns), "max": max(turns)},
            "final_context_tokens": {"median": statistics.median(finals), "max": max(finals)},
            "working_set_vs_caches": sum(finals) / (settings.cache_tokens * settings.replicas),
        },
        "policies": summaries,
        "plain_over_proto_server": over_proto("plain"),
        "thunderagent_over_proto_server": over_proto(THUNDERAGENT),
        "continuum_over_proto_server": over_proto(CONTINUUM),
        "jct_s": {run.policy: list(run.jct_s) for run in runs},
    }


def _plain(instance: Any, field: Any, value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def render(data: dict[str, Any]) -> str:
    s, w = data["settings"], data["workload"]
    lines = [
        f"proto-server bench fleet (MODELLED: virtual time, a discrete-event simulation): "
        f"{w['rollouts']} rollouts ({w['turns']['total']:,} turns, median "
        f"{w['turns']['median']:.0f}) on {s['replicas']} replicas, each a KV cache of "
        f"{s['cache_tokens']:,} tokens in "
        f"blocks of {s['block_tokens']}, at most {s['max_running']} running, prefill "
        f"{s['prefill_rate']:,.0f} tok/s, a decode step {s['step_s'] * 1000:.0f} ms; final "
        f"contexts median {w['final_context_tokens']['median']:,.0f} tokens; working set "
        f"{w['working_set_vs_caches']:.1f}x the caches; tool waits log-normal median "
        f"{s['wait_s'][0]} s, p99 {s['wait_s'][1]:.1f} s; seed {s['seed']}",
        "",
    ]
    header = [
        "policy",
        "JCT mean s",
        "JCT p50 s",
        "JCT p99 s",
        "makespan s",
        "KV hit rate",
        "prefilled",
        "prefilled/unbounded",
        "preemptions",
        "evicted blocks",
        "demotions",
    ]
    rows = [
        [
            p["policy"],
            f"{p['jct_mean_s']:.1f}",
            f"{p['jct_p50_s']:.1f}",
            f"{p['jct_p99_s']:.1f}",
            f"{p['makespan_s']:.1f}",
            f"{p['kv_hit_rate']:.1%}",
            f"{p['prefilled_tokens']:,}",
            f"{p['prefilled_vs_unbounded']:.2f}x",
            str(p["preemptions"]),
            f"{p['evictions_blocks']:,}",
            str(p["demotions"]),
        ]
        for p in data["policies"]
    ]
    lines += table(header, rows)
    lines += ["", *_peer_lines(data["policies"]), ""]
    r = data["plain_over_proto_server"]
    t = data["thunderagent_over_proto_server"]
    c = data["continuum_over_proto_server"]
    lines += [
        _ratio_line("plain forwarding / proto-server", r),
        _ratio_line("thunderagent (modelled) / proto-server", t),
        _ratio_line("continuum (modelled) / proto-server", c),
        f"Goal: JCT at least 2x better than plain forwarding: "
        f"{'HOLDS' if r['jct_mean_s'] >= 2 else 'FAILS'} on the mean ({r['jct_mean_s']:.2f}x)",
        f"Goal: JCT at least {THUNDERAGENT_GOAL}x better than the modelled ThunderAgent policy: "
        f"{'HOLDS' if t['jct_mean_s'] >= THUNDERAGENT_GOAL else 'FAILS'} on the mean "
        f"({t['jct_mean_s']:.2f}x)",
    ]
    return "\n".join(lines)


def _ratio_line(name: str, r: dict[str, float]) -> str:
    return (
        f"{name} (above 1: proto-server better): JCT mean {r['jct_mean_s']:.2f}x, p50 "
        f"{r['jct_p50_s']:.2f}x, p99 {r['jct_p99_s']:.2f}x, makespan {r['makespan_s']:.2f}x, "
        f"prefilled {r['prefilled_tokens']:.2f}x"
    )


def _peer_lines(policies: list[dict[str, Any]]) -> list[str]:
    """What the modelled peers did, by their own counters."""
    lines = []
    for p in policies:
        c = p["counters"]
        if p["policy"] == THUNDERAGENT:
            lines.append(
                f"{THUNDERAGENT}: {c['ticks']:,} scheduler ticks; {c['queued_new']:,} new "
                f"programs queued; {c['pauses']:,} pauses at tool boundaries "
                f"({c['paused_after_mark']:,} of them marked while running, {c['marks']:,} "
                f"marks); {c['resumes']:,} resumes ({c['migrations']:,} to another replica, "
                f"{c['forced_resumes']:,} forced after 30 min)"
            )
        elif p["policy"] == CONTINUUM:
            lines.append(
                f"{CONTINUUM}: {c['pins']:,} pins (TTL mean {c['ttl_s_mean']:.1f} s), "
                f"{c['pins_used']:,} used by the next turn, {c['pins_expired']:,} expired"
            )
    return lines


def write_files(data: dict[str, Any], directory: Path) -> list[Path] | str:
    """fleet.json and the PNGs, or why there are no plots (matplotlib is the `bench` extra)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fleet.json").write_text(json.dumps(data, indent=2))
    plt = pyplot()
    if plt is None:
        return NO_PLOTS
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    for policy, jct in data["jct_s"].items():
        ordered = sorted(jct)
        axes.step(
            ordered,
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            label=policy,
        )
    axes.set(
        title="Job completion time per rollout (modelled, virtual time)",
        xlabel="s",
        ylabel="share of rollouts",
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[0])
    plt.close(figure)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    names = [p["policy"] for p in data["policies"]]
    axes.bar(names, [p["prefilled_tokens"] for p in data["policies"]], label="prefilled")
    need = data["policies"][0]["unbounded_need_tokens"]
    axes.axhline(need, color="black", linestyle="--", label="an unbounded cache's need")
    axes.set(title="Prefilled tokens per policy (modelled)", ylabel="tokens")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[1])
    plt.close(figure)
    return [directory / name for name in PLOTS]


def main(settings: FleetSettings) -> int:
    """The command: the run, its table on stdout, its files; 2 on bad settings."""
    problems = settings.problems()
    if problems:
        for problem in problems:
            print(f"proto-server bench fleet: {problem}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    data = run_fleet(settings, progress)
    print(render(data))
    plots = write_files(data, settings.out_dir)
    print(f"\nSaved {settings.out_dir / 'fleet.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 0
