"""`bench fleet`: the discrete-event simulation (`simulate`), sans-IO and deterministic for a seed:
every policy runs on the same replicas and event loop, differing in a few branches; the peers'
own rules live in `fleet_policies`."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Hashable, Sequence

import attrs

from proto_server.core.routing import Router
from proto_server.core.scheduler import Scheduler
from proto_server_bench.fleet import (
    CONTINUUM,
    POLICIES,
    THUNDERAGENT,
    FleetSettings,
    Rollout,
    unbounded_need,
)
from proto_server_bench.fleet_policies import (
    FORCE_RESUME_S,
    ContinuumPins,
    ThunderAgent,
    continuum_counters,
)
from proto_server_bench.fleet_replica import EngineSequence, Replica

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
            overflow=settings.overflow,
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
