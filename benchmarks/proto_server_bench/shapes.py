"""The traffic `bench agents` sends: named shapes, each defined in one place, and the pure
functions that draw a plan from one (the same shape and seed, the same plan).

A shape says how many rollouts there are and when each starts (`AtOnce`, `Poisson`,
`ClosedLoop`), how many turns each takes, how long its own first message is, and between turns
how long the tool takes and how many of the model's tokens it prints (log-normals, each given by
its median and 99th percentile). `burst` and `poisson` are shaped by the flags; the published
shapes (`PUBLISHED`) are traces' and benchmarks' figures scaled down to a vLLM CPU engine
(SmolLM2 on a few cores, a KV cache of a few thousand to ~46k tokens) by the factors below.
The plan has no text: `agents.make_agents` writes each rollout's context and tools' outputs to
the drawn sizes, from the same stream between the draws (a `Writer`), as it did before there
were shapes, so that `burst` with a seed is the workload it was.
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist
from typing import Protocol

import attrs

#: z of the 99th percentile of a standard normal (to 4 places, as the fleet's draws have it):
#: a log-normal's sigma from its median and p99.
Z99 = 2.3263
#: The Codex SWE-bench-Pro traces' gaps between turns: median 5.2 s, P99 81.4 s.
CODEX_GAP_MEDIAN_S, CODEX_GAP_P99_S = 5.2, 81.4
#: Their P99 over their median: the spread of every published shape's waits here.
CODEX_GAP_RATIO = CODEX_GAP_P99_S / CODEX_GAP_MEDIAN_S

# -- the scale: published figures to a CPU engine ------------------------------------------------

#: Time: the Codex gaps' 5.2 s median becomes 1 s (a rollout's waits add up to seconds, not
#: minutes), their shape (P99/median) kept.
TIME_SCALE = CODEX_GAP_MEDIAN_S
#: Turns: a median of 33 becomes 8; tokens a turn: +2,242 becomes ~112. With a 200-token context
#: 24 rollouts then hold ~40k tokens at their largest (each one's last prompt, the instructions
#: and the tool included): within the engine's own 2 GiB cache (~46k tokens, no pressure), and
#: 1.5x a cache of ~27k (`--num-gpu-blocks-override 830`); the longest rollout (16 turns) fits
#: the engine's 8,192-token context.
TURNS_SCALE, TOKENS_SCALE = 4, 20


@attrs.frozen
class LogNormal:
    """A log-normal by its median and 99th percentile (equal: always the median)."""

    median: float = attrs.field(validator=attrs.validators.gt(0))
    p99: float = attrs.field()

    @p99.validator
    def _ordered(self, _: attrs.Attribute[float], p99: float) -> None:
        if not self.median <= p99 < math.inf:
            raise ValueError(f"a log-normal needs 0 < median <= p99, finite: {self}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99

    def draw(self, rng: random.Random) -> float:
        return self.median * math.exp(rng.gauss(0.0, self.sigma))

    def __str__(self) -> str:
        return f"log-normal median {self.median:.4g}, p99 {self.p99:.4g}"


def lognormal(rng: random.Random, median: float, p99: float) -> float:
    """A draw from the log-normal with this median and 99th percentile."""
    return LogNormal(median, p99).draw(rng)


# -- when rollouts start -------------------------------------------------------------------------


@attrs.frozen
class AtOnce:
    """Every rollout at the start: an RL trainer's batch (and today's burst)."""

    def __str__(self) -> str:
        return "all at once"


@attrs.frozen
class Poisson:
    """A Poisson process at `rate_per_s`, conditioned on its count: n rollouts start at n
    uniform times over the horizon n / rate, sorted (so the last starts within it)."""

    rate_per_s: float = attrs.field(validator=attrs.validators.gt(0))

    def __str__(self) -> str:
        return f"Poisson arrivals at {self.rate_per_s:g}/s"


@attrs.frozen
class ClosedLoop:
    """A fixed number of agents, each running its rollouts one after another (sustained
    concurrency, as AA-AgentPerf keeps it): rollout i is agent i % agents's."""

    agents: int = attrs.field(validator=attrs.validators.ge(1))

    def __str__(self) -> str:
        return f"{self.agents} agents, each running its rollouts one after another"


Arrivals = AtOnce | Poisson | ClosedLoop


# -- a shape -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Shape:
    """A workload by name: what it is, where its figures come from, how they were scaled."""

    name: str
    what: str
    #: The published figures it follows (empty for the flags' shapes).
    source: str = ""
    #: How they were scaled to the CPU engine.
    scaling: str = ""
    rollouts: int = attrs.field(validator=attrs.validators.ge(1))
    arrivals: Arrivals
    #: Turns a rollout (rounded), kept within [min_turns, max_turns].
    turns: LogNormal
    min_turns: int = attrs.field(default=2, validator=attrs.validators.ge(2))
    max_turns: int = attrs.field()
    #: Each rollout's own first message, in the model's tokens.
    context_tokens: int = attrs.field(validator=attrs.validators.ge(1))
    #: A tool's output in the model's tokens, and its time in seconds.
    tool_tokens: LogNormal
    waits_s: LogNormal

    @max_turns.validator
    def _turns(self, _: attrs.Attribute[int], max_turns: int) -> None:
        if max_turns < self.min_turns:
            raise ValueError(f"{self.name}: max_turns {max_turns} < min_turns {self.min_turns}")

    def describe(self, rollouts: int | None = None) -> str:
        """One line: the shape's parameters (with `rollouts` instead of its own, if given)."""
        turns = (
            f"{self.min_turns} turns"
            if self.min_turns == self.max_turns
            else f"turns {self.turns} ({self.min_turns} to {self.max_turns})"
        )
        return (f"{self.name}: {rollouts or self.rollouts} rollouts, {self.arrivals}; {turns}; "
                f"contexts ~{self.context_tokens} tokens; tool outputs {self.tool_tokens} tokens; "
                f"tool times {self.waits_s} s")  # fmt: skip


@attrs.frozen
class RolloutPlan:
    """One rollout as drawn: whose it is, when it may start, its turns, and after each turn but
    the last, its tool's output size and time."""

    index: int
    #: The agent that runs it: one agent's rollouts run one after another.
    agent: int
    #: The earliest it starts, in seconds from the run's start.
    at_s: float
    turns: int
    tool_tokens: tuple[int, ...]
    waits_s: tuple[float, ...]


def arrivals(shape: Shape, rollouts: int, rng: random.Random) -> list[tuple[int, float]]:
    """Each rollout's (agent, earliest start), in order of index."""
    how = shape.arrivals
    if isinstance(how, Poisson):
        horizon = rollouts / how.rate_per_s
        return list(enumerate(sorted(rng.uniform(0.0, horizon) for _ in range(rollouts))))
    if isinstance(how, ClosedLoop):
        return [(index % how.agents, 0.0) for index in range(rollouts)]
    return [(index, 0.0) for index in range(rollouts)]


class Writer(Protocol):
    """What writes a plan's texts from the draw's own stream, between its draws (so that a
    seed gives the workload `bench agents` drew before there were shapes)."""

    def context(self, rng: random.Random, index: int) -> None:
        """Rollout `index`'s own first message, before its turns are drawn."""

    def output(self, rng: random.Random, tokens: int) -> None:
        """The next tool output of about `tokens`, drawn just before."""


def draw(
    shape: Shape, seed: int, rollouts: int | None = None, writer: Writer | None = None
) -> tuple[RolloutPlan, ...]:
    """The plan of `rollouts` rollouts (the shape's own number by default) from `seed`, each
    rollout's texts written by `writer` between its draws (none: the plan alone, whose draws
    differ from a written one's but not in distribution)."""
    rng = random.Random(seed)
    plans = []
    for index, (agent, at_s) in enumerate(arrivals(shape, rollouts or shape.rollouts, rng)):
        if writer is not None:
            writer.context(rng, index)
        turns = shape.min_turns  # a fixed count is not drawn
        if shape.min_turns < shape.max_turns:
            turns = min(shape.max_turns, max(shape.min_turns, round(shape.turns.draw(rng))))
        sizes, waits = [], []
        for _ in range(turns - 1):
            sizes.append(max(1, round(shape.tool_tokens.draw(rng))))
            if writer is not None:
                writer.output(rng, sizes[-1])
            waits.append(shape.waits_s.draw(rng))
        plans.append(RolloutPlan(index, agent, at_s, turns, tuple(sizes), tuple(waits)))
    return tuple(plans)


def from_flags(
    *,
    poisson_rate: float | None,
    rollouts: int,
    turns: int,
    context_tokens: int,
    tool_tokens: LogNormal,
    waits_s: LogNormal,
) -> Shape:
    """`burst` (all at once) or, with a rate, `poisson`: the flags' sizes and times."""
    return Shape(
        name="burst" if poisson_rate is None else "poisson",
        what="the flags' rollouts, " + ("all at once" if poisson_rate is None else "arriving"),
        rollouts=rollouts,
        arrivals=AtOnce() if poisson_rate is None else Poisson(poisson_rate),
        turns=LogNormal(turns, turns), min_turns=turns, max_turns=turns,
        context_tokens=context_tokens, tool_tokens=tool_tokens, waits_s=waits_s,
    )  # fmt: skip


# -- the published shapes ------------------------------------------------------------------------

#: A coding agent's rollout, scaled from the Codex traces: its turns, its tools' outputs.
CODING_TURNS = LogNormal(33 / TURNS_SCALE, 2 * 33 / TURNS_SCALE)
CODING_TOOL_TOKENS = LogNormal(2242 / TOKENS_SCALE, 3 * 2242 / TOKENS_SCALE)
#: The rollout's own first message (its task) and the most turns it takes (the longest fits the
#: engine's context).
CODING_CONTEXT_TOKENS, CODING_MAX_TURNS = 200, 16
_CODING_SCALING = (
    f"turns /{TURNS_SCALE} (median 8.25; p99 2x the median, the traces' spread not being "
    f"published; 2 to 16), tokens a turn /{TOKENS_SCALE} (tool outputs median 112, p99 3x), "
    "contexts of 200 tokens (the task: what Codex shares, instructions and tools, is "
    "the shared prefix here): 24 rollouts hold ~40k tokens at their largest, within the CPU "
    "engine's own cache; input:output is not kept: the model's call each turn (~30 tokens of "
    "SmolLM2) does not shrink with the prompts, so it comes out nearer 30:1 than 131:1 (each "
    "path reports its own)"
)

SWE_BENCH_PRO = Shape(
    name="swe-bench-pro",
    what="an RL trainer's batch of coding rollouts, all started at once (rollouts per minute)",
    source="Codex SWE-bench-Pro traces: median 33 turns, +2,242 tokens a turn, input:output "
    "131:1, gaps between turns median 5.2 s and P99 81.4 s",
    scaling=f"{_CODING_SCALING}; time /{TIME_SCALE:g} (gaps median 1 s, P99 15.65 s)",
    rollouts=24,
    arrivals=AtOnce(),
    waits_s=LogNormal(CODEX_GAP_MEDIAN_S / TIME_SCALE, CODEX_GAP_P99_S / TIME_SCALE),
    turns=CODING_TURNS,
    max_turns=CODING_MAX_TURNS,
    context_tokens=CODING_CONTEXT_TOKENS,
    tool_tokens=CODING_TOOL_TOKENS,
)

#: The share of a coding agent's follow-ups that come within 1 s (vLLM router #285).
FOLLOWUPS_WITHIN_1S = 0.865
#: The median that puts that share within 1 s, with the Codex gaps' spread.
_FOLLOWUP_MEDIAN_S = math.exp(
    -NormalDist().inv_cdf(FOLLOWUPS_WITHIN_1S) * math.log(CODEX_GAP_RATIO) / Z99
)

CODING_FOLLOWUPS = Shape(
    name="coding-followups",
    what="coding-agent sessions arriving over time, most follow-ups within a second",
    source="a coding agent's follow-ups come within 1 s 86.5% of the time (vLLM router #285)",
    scaling=f"{_CODING_SCALING}; gaps unscaled: a log-normal with the Codex gaps' spread "
    f"(P99/median 15.65) whose median ({_FOLLOWUP_MEDIAN_S:.3f} s) puts 86.5% within 1 s; "
    "sessions arrive at 0.5/s (24 over ~48 s)",
    rollouts=24,
    arrivals=Poisson(0.5),
    waits_s=LogNormal(_FOLLOWUP_MEDIAN_S, _FOLLOWUP_MEDIAN_S * CODEX_GAP_RATIO),
    turns=CODING_TURNS,
    max_turns=CODING_MAX_TURNS,
    context_tokens=CODING_CONTEXT_TOKENS,
    tool_tokens=CODING_TOOL_TOKENS,
)

AGENTPERF = Shape(
    name="agentperf",
    what="a fixed number of agents, each working through trajectories one after another",
    source="AA-AgentPerf: sustained concurrent agents replaying coding trajectories, a median "
    "tool-call delay of 1 s",
    scaling=f"{_CODING_SCALING}; tool times unscaled: median 1 s (AA-AgentPerf's), P99 15.65 s "
    "(the Codex gaps' spread; AA publishes the median only); 8 agents x 3 trajectories",
    rollouts=24,
    arrivals=ClosedLoop(8),
    waits_s=LogNormal(1.0, CODEX_GAP_RATIO),
    turns=CODING_TURNS,
    max_turns=CODING_MAX_TURNS,
    context_tokens=CODING_CONTEXT_TOKENS,
    tool_tokens=CODING_TOOL_TOKENS,
)

PUBLISHED = {shape.name: shape for shape in (SWE_BENCH_PRO, CODING_FOLLOWUPS, AGENTPERF)}
#: `--shape`: the flags' two, then the published ones.
SHAPE_NAMES = ("burst", "poisson", *PUBLISHED)
