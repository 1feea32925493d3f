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

This module holds the settings and the workload; one replica is `fleet_replica`, the simulation
`fleet_simulate`, what a run says (and the command, `main`) `fleet_report`. `Replica`'s block
names and `unbounded_need` (here) share one model of the cache (the shared prefix's full blocks
are everyone's, the rest a rollout's own, a partial block prefilled again): the ratio printed
means something only while they agree.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from proto_server.core.ranges import Range, at_least, between, positive_finite
from proto_server.core.settings import setting
from proto_server.server.process.config import ServerConfig
from proto_server_bench import flags
from proto_server_bench.shapes import CODEX_GAP_RATIO, lognormal

CONTINUUM, THUNDERAGENT = "continuum (modelled)", "thunderagent (modelled)"
POLICIES = ("plain", "affinity", CONTINUUM, THUNDERAGENT, "proto-server")
RATIOS = ("jct_mean_s", "jct_p50_s", "jct_p99_s", "makespan_s", "prefilled_tokens")
#: How much shorter proto-server's mean JCT is to be than the modelled ThunderAgent's.
THUNDERAGENT_GOAL = 1.3
PLOTS = ("fleet-jct.png", "fleet-prefilled.png")
Progress = Callable[[str], None]


def _median_4x(text: str) -> tuple[float, float]:
    """`--context-tokens N`: a log-normal of median N, its p99 4N."""
    median = float(int(text))
    return median, 4 * median


@attrs.frozen(kw_only=True)
class FleetSettings:
    """What `bench fleet` runs: each field is a flag of its (`problems` says what is wrong)."""

    rollouts: int = setting(1000, at_least(1), help="rollouts")
    replicas: int = setting(8, at_least(1), help="modelled engine replicas")
    seed: int = setting(2, help="workload seed")
    #: Turns a rollout (log-normal, median and p99; vLLM's AgentX median of 43 scaled down).
    turns: tuple[float, float] = setting(
        (8.0, 32.0), flags.ordered_pair, parse=flags.median_p99, metavar="MEDIAN,P99",
        help="turns a rollout (log-normal; at least 2)",
    )  # fmt: skip
    #: The instructions and tools every rollout shares, in tokens.
    shared_tokens: int = setting(
        1024, at_least(0), metavar="N", help="the prefix every rollout shares (instructions, tools)"
    )
    #: Each rollout's own first message (log-normal, median and p99).
    context_tokens: tuple[float, float] = setting(
        (2000.0, 8000.0), flags.ordered_pair, parse=_median_4x, metavar="N",
        help="each rollout's own first message, in tokens: the log-normal's median, its p99 4x",
    )  # fmt: skip
    #: A tool output (log-normal, median and p99).
    tool_tokens: tuple[float, float] = setting(
        (400.0, 4000.0), flags.ordered_pair, parse=flags.median_p99, metavar="MEDIAN,P99",
        help="tool outputs' sizes in tokens (log-normal)",
    )  # fmt: skip
    #: What the model decodes a turn (log-normal; AgentX's 444 a turn scaled down).
    output_tokens: tuple[float, float] = setting(
        (64.0, 256.0), flags.ordered_pair, parse=flags.median_p99, metavar="MEDIAN,P99",
        help="tokens decoded a turn (log-normal)",
    )  # fmt: skip
    #: Tool waits between turns (log-normal): the published Codex gaps, 5.2 s median, 81.4 s p99.
    wait_s: tuple[float, float] = setting(
        (5.2, 5.2 * CODEX_GAP_RATIO), flags.ordered_pair, flag="--wait-s",
        parse=flags.median_p99, metavar="MEDIAN,P99",
        help="tools' times in seconds (log-normal; the published Codex gaps)",
    )  # fmt: skip
    #: Rollouts start uniformly over this window (0: all at once, as an RL step launches them).
    arrival_s: float = setting(
        0.0, Range("at least 0 and finite", lambda value: 0 <= value < math.inf),
        flag="--arrival-s", metavar="S",
        help="rollouts start uniformly over this window (0: all at once)",
    )  # fmt: skip
    #: Each replica's KV cache, in tokens, and its block.
    cache_tokens: int = setting(262_144, metavar="N", help="each replica's KV cache in tokens")
    block_tokens: int = setting(
        16, at_least(1), metavar="N", help="the KV cache's block (vLLM's --block-size)"
    )
    #: Running sequences a replica holds at most (vLLM's --max-num-seqs).
    max_running: int = setting(
        128,
        at_least(1),
        metavar="N",
        help="running sequences a replica holds (vLLM's --max-num-seqs)",
    )
    #: Prompt tokens a step may prefill (vLLM's --max-num-batched-tokens), and at what rate.
    step_tokens: int = setting(
        8192, at_least(1), metavar="N",
        help="prompt tokens a step prefills at most (vLLM's --max-num-batched-tokens)",
    )  # fmt: skip
    prefill_rate: float = setting(
        10_000.0,
        positive_finite,
        metavar="TOKENS_PER_S",
        help="modelled prefill tokens/s of a replica",
    )
    #: A step's decode time (one token for every running sequence).
    step_s: float = setting(
        0.03, positive_finite, flag="--step-ms", unit=0.001, metavar="MS",
        help="modelled time of a decode step (a token for every running sequence)",
    )  # fmt: skip
    #: The server's admission: the share of a replica's cache its admitted rollouts may fill
    #: (--kv-target-fill) and how long a suspended one keeps its place (--admission-ttl).
    target_fill: float = setting(
        0.9, Range("in (0, 1]", lambda value: 0 < value <= 1), flag="--kv-target-fill",
        metavar="FRACTION",
        help="proto-server's policy: share of a replica's cache admitted rollouts fill",
    )  # fmt: skip
    ttl_s: float = setting(
        30.0, positive_finite, flag="--ttl-s", metavar="S",
        help="proto-server's policy: how long a suspended rollout keeps its place (the "
        "server's --admission-ttl)",
    )  # fmt: skip
    #: The server's --admission-ttl-median (None: off).
    ttl_median: float | None = setting(
        None, positive_finite, metavar="K",
        help="proto-server's policy: the place kept K times the median time away, at most "
        "--ttl-s (the server's --admission-ttl-median)",
    )  # fmt: skip
    #: The server's --admission-bypass: its oldest waiter is passed by at most this many.
    bypass: int = setting(
        ServerConfig().admission_bypass, at_least(0), metavar="N",
        help="proto-server's policy: waiters smallest first, the oldest passed by at most N "
        "(the server's --admission-bypass; 0: first come first served)",
    )  # fmt: skip
    #: The server's --admission-growth: a rollout is admitted for this many times its tokens.
    growth: float = setting(
        ServerConfig().admission_growth, between(1, 100), flag="--admission-growth", metavar="G",
        help="proto-server's policy: a rollout admitted for G times its tokens",
    )  # fmt: skip
    #: The server's --admission-overflow.
    overflow: bool = setting(
        ServerConfig().admission_overflow, flag="--admission-overflow",
        help="proto-server's policy: the admitted that outgrew the room give suspended places "
        "up (the server's --admission-overflow)",
    )  # fmt: skip
    #: ThunderAgent's --scheduler-interval and --use-acting-token-decay (its defaults).
    thunder_interval_s: float = setting(
        5.0, positive_finite, flag="--thunderagent-interval", metavar="S",
        help="the modelled ThunderAgent: its --scheduler-interval (pause and resume every S "
        "seconds)",
    )  # fmt: skip
    thunder_decay: bool = setting(
        False, flag="--thunderagent-decay",
        help="the modelled ThunderAgent: its --use-acting-token-decay (a program on its tool "
        "counts 2^-t of its tokens after t s, when resuming)",
    )  # fmt: skip
    #: Continuum's TTL until it has seen more than 100 tool times (its fork's 2 s).
    continuum_ttl_s: float = setting(
        2.0, positive_finite, flag="--continuum-ttl", metavar="S",
        help="the modelled Continuum: the TTL it pins for until it has seen more than 100 tool "
        "times (its 2 s)",
    )  # fmt: skip
    out_dir: Path = setting(
        Path("bench-results"), flag="--out", metavar="DIR", help="where fleet.json and the "
        "plots go",
    )  # fmt: skip

    def problems(self) -> list[str]:
        """What is wrong with these settings together, in words (empty: nothing); each field's
        own range is its validator's."""
        if self.cache_tokens < 2 * self.block_tokens:
            return [
                f"--cache-tokens must hold at least 2 blocks ({2 * self.block_tokens} "
                f"tokens), got {self.cache_tokens}"
            ]
        return []


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
