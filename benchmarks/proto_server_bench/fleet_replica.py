"""`bench fleet`: one modelled engine replica: a bounded prefix cache of blocks (the simulated GPU's
`PrefixCache`), a bound on running sequences, steps that prefill up to a token budget and decode a
token for every running sequence, the newest preempted when a block is missing. Its block names
are the cache model `fleet.unbounded_need` counts against: the two must agree."""

from __future__ import annotations

import bisect
import collections

import attrs

from proto_server.engine.prefix_cache import PrefixCache
from proto_server_bench.fleet import FleetSettings
from proto_server_bench.fleet_policies import ContinuumPins

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
