"""`bench fleet`'s peers: ThunderAgent's and Continuum's policies, modelled (not their code).

Each is a model of a published policy, written here from its paper and its open-source code
(read, not copied), expressed over `bench fleet`'s replicas and workload. What each keeps and
what it leaves out is said in its class; docs/benchmarks.md says it again beside the figures.

- `ThunderAgent` (arXiv 2602.13692; github HaoKang-Timmy/ThunderAgent, router mode `tr`, its
  defaults): a front end before unmodified engines. It tracks programs (a rollout's
  `program_id`) and, per backend, the tokens of the programs registered there against the
  engine's whole KV cache; every `--scheduler-interval` (5 s) it first resumes paused programs
  (priority groups, smallest first, placed best-fit-decreasing over the backends), then, on a
  backend over capacity, pauses programs at tool boundaries, smallest first.
- `ContinuumPins` (arXiv 2511.02230; github Hanchenli/vllm-continuum): inside one engine, a
  turn that ends in a tool call keeps its KV pinned for a time-to-live chosen by the paper's
  rule, and the waiting queue is served program by program, first come first served.

The two are the benchmark's peers, read together against docs/benchmarks.md's account of what
each model keeps and leaves out; each class is whole on its own (`fleet_simulate.simulate` drives
them), its docstrings that account, beside the code it describes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Collection, Iterable, Sequence

import attrs

from proto_server.engine.prefix_cache import PrefixCache

#: ThunderAgent's `BUFFER_PER_PROGRAM`: tokens of decode headroom counted for every program.
BUFFER_PER_PROGRAM = 100
#: ThunderAgent's `_wait_for_resume` timeout: a program paused this long is resumed regardless.
FORCE_RESUME_S = 1800.0
#: Continuum's cold start: with this many tool times seen or fewer, the TTL is the default.
CONTINUUM_RECORDS = 100


@attrs.define
class Program:
    """What ThunderAgent knows of one program."""

    tokens: int = 0
    steps: int = 0
    #: REASONING (a request in flight or waiting) or, when False, ACTING (on its tool).
    reasoning: bool = True
    backend: int | None = None
    #: Where it was when paused (None: a new program queued before it had a backend).
    origin: int | None = None
    #: PAUSED: in the global pool, its next request held until a tick resumes it.
    paused: bool = False
    #: A request of it waits for the resume.
    pending: bool = False
    #: Tokens counted as about to be released: it was REASONING when its backend went over.
    marked: int = 0
    acting_since: float = 0.0


@attrs.frozen
class Pause:
    """One pause, as the tests read it: the program was on its tool (a tool boundary) and its
    backend over capacity when it was decided."""

    rollout: int
    at: float
    at_tool_boundary: bool
    over_capacity: bool
    #: Marked while running, paused when its turn ended.
    marked: bool


class ThunderAgent:
    """ThunderAgent's `tr` scheduler over `backends` engines of `capacity` KV tokens each.

    Kept, as its code does: a program's tokens are its last request's (the prompt while it
    runs, prompt and answer once it answered); a backend's use is the sum of its registered
    programs' tokens, acting ones at weight 1 (`--acting-token-weight`), plus 100 a program,
    against the engine's whole cache (block count x block size); no prefix sharing is subtracted
    (`shared_tokens` is never updated at its latest commit). A new program goes to the backend
    with the fewest tokens that has room for it, unless programs are queued, then it queues too.
    Every tick (`--scheduler-interval`, 5 s): resume, then pause. Resume: paused programs
    grouped (a request waiting, then new programs, then those still on their tool), each group
    smallest first (tokens when paused), taken while their sum fits the backends' total room,
    then placed largest first, each on the backend with the most room (best fit decreasing),
    possibly not the one it left (its KV is then prefilled again there); with
    `--use-acting-token-decay` (`decay`) acting tokens count 2^-t after t seconds on their tool
    when measuring that room. Pause, on a backend over capacity: programs on their tool, smallest
    first, are paused at once (their KV left to the engine's LRU); then running ones, smallest
    first, are marked and paused when their turn ends (a tool boundary). A program paused 30
    minutes is resumed regardless. The rollout's client releases it when done.

    Mended, as the issue's measurement of it was: `_greedy_resume` reads the paused pool's
    `(id, program, info)` tuples as programs and fails every tick at its latest commit; here it
    resumes as written. `_pause_until_safe` marks running programs "accounting for future
    paused tokens" but loops on a capacity that does not count them (it would mark every running
    program); here the marked tokens count as released (`capacity_overflow(include_future_
    release=True)`, which it defines for that). Left out: estimating tokens from characters (it
    calibrates a ratio from the engine's usage; here it knows them), its metrics, health checks
    and HTTP.
    """

    def __init__(self, backends: int, capacity: int, *, decay: bool = False) -> None:
        self.capacity = capacity
        self.decay = decay
        self.programs: dict[int, Program] = {}
        #: The global paused pool: program and its tokens when paused, in the order paused.
        self.pool: dict[int, int] = {}
        self.registered: list[dict[int, Program]] = [{} for _ in range(backends)]
        #: Per backend: registered programs' tokens, and tokens marked to be released.
        self.used = [0] * backends
        self.future = [0] * backends
        self.pauses: list[Pause] = []
        #: Per tick that resumed any: the programs' tokens taken to resume, in the order taken.
        self.taken: list[list[int]] = []
        self.resumes = 0
        self.marks = 0
        self.migrations = 0
        self.forced = 0
        self.queued = 0
        self.ticks = 0

    # -- what the rollouts' requests tell it ---------------------------------------------------

    def request(self, rollout: int, tokens: int, now: float) -> int | None:
        """A request of `rollout` holding `tokens`: the backend it goes to, or None while it is
        paused (or queued, if new) until a tick resumes it."""
        p = self.programs.get(rollout)
        if p is None:
            p = self.programs[rollout] = Program()
        p.steps += 1
        self._set_tokens(p, tokens)
        p.reasoning = True
        if p.paused:
            p.pending = True
            return None
        if p.backend is None:
            backend = self._new_backend(tokens)
            if backend is not None:
                self._register(rollout, p, backend)
                return backend
            p.paused = p.pending = True
            self.pool[rollout] = tokens
            self.queued += 1
            return None
        return p.backend

    def finished(self, rollout: int, tokens: int, now: float) -> None:
        """A request of `rollout` answered, the program holding `tokens`: it is on its tool
        (ACTING); marked, it is paused now, at that tool boundary."""
        p = self.programs[rollout]
        p.reasoning = False
        p.acting_since = now
        self._set_tokens(p, tokens)
        if p.marked and p.backend is not None:
            self.future[p.backend] -= p.marked
            p.marked = 0
            self._pause(rollout, p, now, marked=True)

    def release(self, rollout: int) -> None:
        """`rollout` ended: the client releases its program."""
        p = self.programs.pop(rollout)
        self.pool.pop(rollout, None)
        if p.backend is not None:
            self.future[p.backend] -= p.marked
            self._unregister(rollout, p)

    def timeout(self, rollout: int) -> int | None:
        """`rollout`'s request has waited `FORCE_RESUME_S`: resumed regardless, to where it was
        (a new program: the backend with the fewest programs); None if it was resumed since."""
        p = self.programs.get(rollout)
        if p is None or not (p.paused and p.pending):
            return None
        del self.pool[rollout]
        if p.origin is not None:
            backend = p.origin
        else:
            counts = [len(r) for r in self.registered]
            backend = counts.index(min(counts))
        self.forced += 1
        self._resume(rollout, p, backend)
        return backend

    # -- the periodic scheduler ----------------------------------------------------------------

    def tick(self, now: float) -> list[tuple[int, int]]:
        """One scheduler check: resume, then pause where over capacity; the resumed programs
        whose request waited, each with its backend (the others go there when they ask)."""
        self.ticks += 1
        resumed = self._greedy_resume(now)
        for backend in range(len(self.registered)):
            if self.remaining(backend) < 0:
                self._pause_until_safe(backend, now)
        return [(r, b) for r, b, pending in resumed if pending]

    def remaining(self, backend: int, now: float | None = None) -> float:
        """Room left on `backend` by ThunderAgent's count (negative: over capacity); with `now`
        and decay, acting tokens weighted 2^-t."""
        programs = self.registered[backend]
        used: float = self.used[backend]
        if now is not None and self.decay:
            used = sum(
                p.tokens if p.reasoning else p.tokens * 2.0 ** -(now - p.acting_since)
                for p in programs.values()
            )
        return self.capacity - (int(used) + BUFFER_PER_PROGRAM * len(programs))

    def _greedy_resume(self, now: float) -> list[tuple[int, int, bool]]:
        rooms = [(b, self.remaining(b, now)) for b in range(len(self.registered))]
        caps = [(b, room) for b, room in rooms if room > BUFFER_PER_PROGRAM]
        total = sum(room for _, room in caps)
        if not caps or not self.pool:
            return []
        by_size = sorted(self.pool, key=self.pool.__getitem__)
        programs = self.programs
        groups: tuple[list[int], list[int], list[int]] = ([], [], [])
        for r in by_size:
            p = programs[r]
            groups[1 if p.steps == 1 else 0 if p.pending else 2].append(r)
        chosen, cumulative = [], 0
        for r in groups[0] + groups[1] + groups[2]:
            need = programs[r].tokens + BUFFER_PER_PROGRAM
            if cumulative + need <= total:
                chosen.append(r)
                cumulative += need
        if not chosen:
            return []
        self.taken.append([programs[r].tokens for r in chosen])
        chosen.sort(key=lambda r: -programs[r].tokens)
        caps.sort(key=lambda c: -c[1])
        smallest = programs[chosen[-1]].tokens + BUFFER_PER_PROGRAM
        resumed = []
        for r in chosen:
            if not caps or smallest > caps[0][1]:
                break
            p = programs[r]
            need = p.tokens + BUFFER_PER_PROGRAM
            backend, room = caps[0]
            if need > room:
                continue
            del self.pool[r]
            pending = p.pending
            self._resume(r, p, backend)
            resumed.append((r, backend, pending))
            if room - need > BUFFER_PER_PROGRAM:
                caps[0] = (backend, room - need)
                caps.sort(key=lambda c: -c[1])
            else:
                caps.pop(0)
        return resumed

    def _pause_until_safe(self, backend: int, now: float) -> None:
        programs = self.registered[backend]
        acting = sorted(
            (r for r, p in programs.items() if not p.reasoning), key=lambda r: programs[r].tokens
        )
        for r in acting:
            if self.remaining(backend) + self.future[backend] >= 0:
                return
            self._pause(r, programs[r], now, marked=False)
        running = sorted(
            (r for r, p in programs.items() if p.reasoning and not p.marked),
            key=lambda r: programs[r].tokens,
        )
        for r in running:
            if self.remaining(backend) + self.future[backend] >= 0:
                return
            p = programs[r]
            p.marked = max(1, p.tokens)
            self.future[backend] += p.marked
            self.marks += 1

    def counters(self) -> dict[str, float]:
        """What it did, for `bench fleet`'s summary."""
        pauses = self.pauses
        return {
            "ticks": self.ticks,
            "pauses": len(pauses),
            "pauses_at_tool_boundary": sum(p.at_tool_boundary for p in pauses),
            "pauses_over_capacity": sum(p.over_capacity for p in pauses),
            "marks": self.marks,
            "paused_after_mark": sum(p.marked for p in pauses),
            "queued_new": self.queued,
            "resumes": self.resumes,
            "migrations": self.migrations,
            "forced_resumes": self.forced,
        }

    # -- inside --------------------------------------------------------------------------------

    def _new_backend(self, tokens: int) -> int | None:
        if self.pool:
            return None  # programs are queued: a new one waits behind them
        best, fewest = None, math.inf
        for b in range(len(self.registered)):
            if self.remaining(b) >= tokens + BUFFER_PER_PROGRAM and self.used[b] < fewest:
                best, fewest = b, self.used[b]
        return best

    def _set_tokens(self, p: Program, tokens: int) -> None:
        if p.backend is not None and not p.paused:
            self.used[p.backend] += tokens - p.tokens
        p.tokens = tokens

    def _register(self, rollout: int, p: Program, backend: int) -> None:
        p.backend = backend
        self.registered[backend][rollout] = p
        self.used[backend] += p.tokens

    def _unregister(self, rollout: int, p: Program) -> None:
        assert p.backend is not None
        del self.registered[p.backend][rollout]
        self.used[p.backend] -= p.tokens
        p.backend = None

    def _pause(self, rollout: int, p: Program, now: float, *, marked: bool) -> None:
        assert p.backend is not None
        # A marked one was marked because its backend was over capacity.
        over = marked or self.remaining(p.backend) + self.future[p.backend] < 0
        self.pauses.append(Pause(rollout, now, not p.reasoning, over, marked))
        p.origin = p.backend
        self._unregister(rollout, p)
        p.paused = True
        self.pool[rollout] = p.tokens

    def _resume(self, rollout: int, p: Program, backend: int) -> None:
        self.resumes += 1
        if p.origin is not None and p.origin != backend:
            self.migrations += 1
        p.paused = p.pending = False
        p.origin = None
        self._register(rollout, p, backend)


@attrs.frozen
class Pin:
    """One pin, as the tests read it: when, for how long, and when and why it was let go."""

    rollout: int
    at: float
    ttl_s: float
    released_at: float
    #: "returned" (the next turn came and used it) or "expired".
    why: str


class ContinuumPins:
    """Continuum's pins and program order inside one engine (its vLLM fork, per engine).

    Kept: a turn that ends in a tool call (every turn but a rollout's last) keeps its blocks
    pinned for a TTL; at each engine step, pins past their TTL are let go unless the rollout's
    next turn is already waiting (vLLM-continuum's `unpin_requests_regular`); a returning turn
    runs on its pinned blocks. The TTL is the paper's rule (Sec. 4.2, Eq. 2, as the fork's
    `calc_ttl_continuum_dynamic` writes it): until more than 100 tool times are known, the
    default (`--continuum-ttl`, the fork's `FIXED_THRESHOLD_CONTINUUM`, 2 s); then the tau
    among 0 and the known tool times that maximises P(tool time <= tau) x (T x eta + reload) -
    tau, no pin if that is not positive. Here the tool times are this engine's (one tool, so
    its records and all records are the same); reload is the turn's tokens at the modelled
    prefill rate; T is the mean time returning turns waited in this engine's queue; eta is 1
    (the fork's value before it has two samples). The waiting queue is ordered by each
    rollout's first arrival (program-level first come first served), and preemption takes the
    rollout that arrived last, a rollout's last turn only if nothing else is running. Left out:
    CPU offload, tool times guessed from the command text (one tool here), any bound on pinned
    memory (the fork has none).
    """

    def __init__(self, *, default_ttl_s: float, reload_s_per_token: float) -> None:
        self.default_ttl_s = default_ttl_s
        self.reload_s_per_token = reload_s_per_token
        self._times: list[float] = []  # the tool times seen, sorted
        self._first: dict[int, tuple[float, int]] = {}
        self._departed: dict[int, float] = {}
        self._pinned: dict[int, tuple[list[int], float, float]] = {}
        self._expiries: list[tuple[float, int, float]] = []
        self._waited = 0.0
        self._returns = 0
        self.log: list[Pin] = []
        self.ttl_total = 0.0

    def order(self, rollout: int) -> tuple[float, int]:
        """Its place in the waiting queue: when the rollout first arrived."""
        return self._first[rollout]

    def arrived(self, rollout: int, now: float) -> None:
        """A turn of `rollout` came: after the first, its tool's time is recorded."""
        self._first.setdefault(rollout, (now, rollout))
        departed = self._departed.pop(rollout, None)
        if departed is not None:
            bisect.insort(self._times, now - departed)

    def admitted(
        self, rollout: int, turn: int, waited: float, now: float, cache: PrefixCache
    ) -> None:
        """A turn of `rollout` starts running after `waited` s in the queue: its pin, if any,
        is handed over to it (its blocks are pinned by the running sequence now)."""
        if turn:
            self._waited += waited
            self._returns += 1
        pin = self._pinned.pop(rollout, None)
        if pin is not None:
            blocks, at, ttl = pin
            cache.unpin(blocks)
            self.log.append(Pin(rollout, at, ttl, now, "returned"))

    def ttl(self, tokens: int) -> float:
        """The TTL for a turn of `tokens` that ended in a tool call (0: no pin)."""
        times = self._times
        if len(times) <= CONTINUUM_RECORDS:
            return self.default_ttl_s
        delay = self._waited / self._returns if self._returns else 0.0
        benefit = delay + tokens * self.reload_s_per_token
        best, best_reward, n = 0.0, 0.0, len(times)
        for i, tau in enumerate(times):
            if benefit - tau <= best_reward:
                break  # the reward of this tau and of every longer one is at most that
            reward = (i + 1) / n * benefit - tau
            if reward > best_reward:
                best, best_reward = tau, reward
        return best

    def finished(
        self, rollout: int, blocks: list[int], tokens: int, now: float, cache: PrefixCache
    ) -> None:
        """A turn that ends in a tool call finished holding `blocks` (pinned by it): pinned on
        for the TTL, or let go."""
        self._departed[rollout] = now
        ttl = self.ttl(tokens)
        if ttl <= 0.01:  # the fork pins only for more than 10 ms
            cache.unpin(blocks)
            return
        self._pinned[rollout] = (blocks, now, ttl)
        self.ttl_total += ttl
        heapq.heappush(self._expiries, (now + ttl, rollout, now))

    def due(self, now: float) -> bool:
        """Whether a pin's TTL has run out by `now`."""
        return bool(self._expiries) and self._expiries[0][0] <= now

    def expire(self, now: float, waiting: Collection[int], cache: PrefixCache) -> None:
        """At an engine step: pins past their TTL are let go, but for rollouts already back."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, rollout, at = heapq.heappop(expiries)
            pin = self._pinned.get(rollout)
            if pin is None or pin[1] != at or rollout in waiting:
                continue  # handed over already, or handed over when it is admitted
            del self._pinned[rollout]
            cache.unpin(pin[0])
            self.log.append(Pin(rollout, at, pin[2], now, "expired"))

    @property
    def pinned(self) -> Iterable[int]:
        return self._pinned.keys()


def continuum_counters(engines: Sequence[ContinuumPins]) -> dict[str, float]:
    """What the engines' pins did, for `bench fleet`'s summary."""
    log = [pin for pins in engines for pin in pins.log]
    made = len(log) + sum(len(list(pins.pinned)) for pins in engines)
    return {
        "pins": made,
        "pins_used": sum(pin.why == "returned" for pin in log),
        "pins_expired": sum(pin.why == "expired" for pin in log),
        "ttl_s_mean": sum(pins.ttl_total for pins in engines) / made if made else 0.0,
    }
