"""`proto-server bench agents`: many rollouts on one engine, path after path.

N rollouts, each with a context of its own (a first message of about K of the model's tokens,
so that rollouts share nothing past the instructions and the tool), T turns with a forced call
on each but the last, and between turns a tool that takes a log-normal time and prints a
log-normal number of tokens, all drawn from a named shape (`shapes.py`: today's burst of N x T
at once, the same arriving as a Poisson process, or a published shape scaled to the CPU
engine), seeded: the same seed, the same workload. The client runs the tools (it sleeps): the
server only sees each rollout suspend and resume.

The same workload runs through each path, one path after the other, on the same engine:
proto-server's prototype WebSocket (one Response, suspended at each call), its launched
WebSocket (`previous_response_id`, `store: false`) and, on a real vLLM, the peers: vLLM's own
`/v1/responses` with the whole history, vLLM's `/v1/chat/completions` alone (the client keeps and
resends the messages, as an agent library does) and, given the URL of one the user started,
ThunderAgent (or any proxy that schedules programs by a `program_id` sent with chat completions)
in front of the same engine (the clients are `paths.py`'s and `chat.py`'s). On the
simulated GPU (the default) only proto-server's paths run and the engine's time is modelled.

Per path: makespan and rollouts per minute (an RL trainer's figure), the prompt tokens
prefilled (each turn's `input_tokens - cached_tokens`) against what an unbounded cache would
have prefilled, the cached share, TTFT p50/p99 over every turn and p50/p90 over the turns after
a tool (the client's first output event after its request) and the engine's preemptions
(`/metrics`).

This module holds the settings and the workload (`make_agents`); one path's run is
`agents_paths`, the engines and the run of every path `agents_run` (with the command, `main`),
what a run says `agents_report`. The paths' names (`ADMITTED`, `SPREAD`) are declared here, made
by `run_agents` and read back by `Target` and `spread_vs_one`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from proto_server.core.ranges import Range, at_least, between, one_of, positive, positive_finite
from proto_server.core.settings import flag_of, setting
from proto_server_bench import flags, shapes
from proto_server_bench.shapes import CODEX_GAP_RATIO, PUBLISHED, SHAPE_NAMES, LogNormal, Shape
from proto_server_bench.workload import _GUIDANCE, _code_line, _prose

Progress = Callable[[str], None]
Count = Callable[[str], int]
ENGINES = ("simulated", "vllm")
#: The engine's counters read before and after each path.
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "finished": "vllm:e2e_request_latency_seconds_count",
}
#: The admitting server's counters read before and after each of its paths.
SERVER_COUNTERS = {"demotions": "proto_server_admission_demotions_total"}
PLOTS = ("agents-ttft.png", "agents-cached-share-per-turn.png")
#: The name of a proto-server path served by the server that admits rollouts by KV capacity.
ADMITTED = " + admission"
#: The name of the launched path served by one proto-server in front of several engines.
SPREAD = " on {} engines"
ADMISSION_CHOICES = ("auto", "off", "on", "both")
#: vLLM's block, as the engine tests use it (the prefix cache's unit).
BLOCK_SIZE = 32
ENGINE_READY_S = 300.0
MAX_MODEL_LEN = 8192


def _proxy_root(url: str) -> bool:
    parts = urlsplit(url)
    return not url or (parts.scheme in ("http", "https") and bool(parts.hostname))


#: `--thunderagent-url`: none, or a proxy's root.
PROXY_ROOT = Range("the proxy's root, e.g. http://127.0.0.1:8710", _proxy_root)


#: Rollouts of the flags' shapes, unless `--rollouts` says.
DEFAULT_ROLLOUTS = 6
#: The settings that shape `burst` and `poisson` only: a published shape draws its own.
FLAGS_SHAPED = ("turns", "context_tokens", "output_tokens", "wait_s")


@attrs.frozen(kw_only=True)
class AgentsSettings:
    """What `bench agents` runs: each field is a flag of its (`problems` says what is wrong)."""

    #: The traffic's shape (`shapes.py`); burst and poisson take the flags below it.
    shape: str = setting(
        "burst", one_of(SHAPE_NAMES),
        help="the traffic: burst (--rollouts x --turns at once), poisson (the same arriving at "
        "--arrival-rate), or a published shape scaled to the CPU engine (docs/benchmarks.md)",
    )  # fmt: skip
    rollouts: int | None = setting(
        None, at_least(1), metavar="N",
        help="rollouts (default: 6 for burst and poisson, the published shape's own)",
    )  # fmt: skip
    arrival_rate: float = setting(
        0.5, positive_finite, metavar="PER_S",
        help="--shape poisson: rollouts arriving a second (the last within rollouts / rate s)",
    )  # fmt: skip
    turns: int = setting(
        4, at_least(2), help="turns a rollout (a forced call on each but the last)"
    )
    context_tokens: int = setting(
        450,
        at_least(1),
        metavar="N",
        help="each rollout's own first message, in the model's tokens",
    )
    #: A tool output's size in the model's tokens: median and 99th percentile.
    output_tokens: tuple[float, float] = setting(
        (180.0, 540.0), flags.ordered_pair, flag="--tool-tokens", parse=flags.median_p99,
        metavar="MEDIAN,P99",
        help="tool outputs' sizes in the model's tokens (log-normal)",
    )  # fmt: skip
    #: A tool's time in seconds: median and 99th percentile.
    wait_s: tuple[float, float] = setting(
        (1.0, CODEX_GAP_RATIO), flags.ordered_pair, flag="--wait-s", parse=flags.median_p99,
        metavar="MEDIAN,P99", help="tools' times in seconds (log-normal; the published gaps' "
        "P99/median, 81.4/5.2 s, scaled to a 1 s median)",
    )  # fmt: skip
    seed: int = setting(2, help="workload seed")
    engine: str = setting(
        "simulated", one_of(ENGINES),
        help="the simulated GPU (proto-server's paths, engine time modelled) or a vLLM CPU "
        "engine (SmolLM2, block size 32; vLLM's own /v1/responses too)",
    )  # fmt: skip
    #: vLLMs already running (each one's base, ending in /v1); none: start `engines` of them.
    engine_urls: tuple[str, ...] = setting(
        (), flag="--engine-url", metavar="URL",
        help="--engine vllm: a running engine's base (ending in /v1); again for another replica "
        "(the launched path then also runs through one server in front of all); default: "
        "start --engines of them",
    )  # fmt: skip
    #: Engines to start (without `engine_urls`): more than one adds the launched path through
    #: one proto-server in front of all of them, beside the same path on the first alone.
    engines: int = setting(
        1, at_least(1), metavar="N",
        help="--engine vllm: engines to start; more than 1 adds the launched path through one "
        "proto-server in front of all of them, beside it on the first alone",
    )  # fmt: skip
    gpu_blocks: int | None = setting(
        None, at_least(2), flag="--num-gpu-blocks-override", metavar="N",
        help="the engine's KV cache in blocks of 32 tokens (pressure; simulated or vllm)",
    )  # fmt: skip
    vllm_python: str = setting(
        ".vllm/bin/python", metavar="PATH",
        help="--engine vllm: the engine's interpreter ($PROTO_SERVER_VLLM_PYTHON wins)",
    )  # fmt: skip
    answer_tokens: int = setting(
        32, at_least(1), flag="--decode-tokens", metavar="N",
        help="most tokens decoded a turn (proto-server's --max-tokens; vLLM's max_output_tokens "
        "on the answer turn, 128 on a forced call's as bench vllm gives)",
    )  # fmt: skip
    prefill_rate: float = setting(
        100_000.0, positive_finite, metavar="TOKENS_PER_S",
        help="the simulated GPU's modelled prefill tokens/s for tokens not in its cache",
    )  # fmt: skip
    out_dir: Path = setting(
        Path("bench-results"), flag="--out", metavar="DIR", help="where agents.json and the "
        "plots go",
    )  # fmt: skip
    #: proto-server's paths without the server's admission by KV capacity, with it, or both
    #: side by side (a second server process admits; it needs a known cache size); auto: both
    #: where the cache's size is known (a vLLM engine, or a bounded simulated one), else off.
    admission: str = setting(
        "auto", one_of(ADMISSION_CHOICES),
        help="proto-server's paths without the server's admission by KV capacity "
        "(--kv-capacity-tokens; from the engine with vllm), with it, or both side by side; "
        "auto: both where the cache's size is known (vllm, or --num-gpu-blocks-override)",
    )  # fmt: skip
    #: The admitting server's `--admission-ttl` and `--admission-ttl-median` (None: its own).
    admission_ttl_s: float | None = setting(
        None, positive, flag="--admission-ttl", metavar="S",
        help="the admitting server's --admission-ttl (default: the server's own)",
    )  # fmt: skip
    admission_ttl_median: float | None = setting(
        None, between(0, 1000), metavar="K", help="the admitting server's --admission-ttl-median"
    )
    #: The admitting server's `--workers`: more than one share the engine's room through a
    #: store file they share (`--admission-shared`).
    admission_workers: int = setting(
        1, at_least(1), metavar="N",
        help="--engine vllm: the admitting server's --workers; more than 1 share the engine's "
        "room through a store file (--admission-shared)",
    )  # fmt: skip
    #: The admitting server's `--kv-target-fill` (None: its own).
    kv_target_fill: float | None = setting(
        None, between(0.01, 1), metavar="FRACTION", help="the admitting server's --kv-target-fill"
    )
    #: The admitting server's `--admission-growth` (None: its own).
    admission_growth: float | None = setting(
        None, between(1, 100), metavar="G",
        help="the admitting server's --admission-growth (default: the server's own)",
    )  # fmt: skip
    #: The admitting server's `--admission-overflow` (None: its own).
    admission_overflow: bool | None = setting(
        None, help="the admitting server's --admission-overflow (default: the server's own)"
    )
    #: A ThunderAgent the user started in front of the first engine (its root, or its /v1):
    #: adds the chat-completions path with a `program_id` per rollout through it.
    thunderagent_url: str = setting(
        "", PROXY_ROOT, metavar="URL",
        help="--engine vllm: a ThunderAgent you started in front of the first engine "
        "(thunderagent --backends ENGINE --router tr --metrics), or any proxy that takes a "
        "program_id with chat completions and POST /programs/release: adds its path",
    )  # fmt: skip

    @property
    def traffic(self) -> Shape:
        """The shape these settings draw from: a published one, or the flags' own."""
        if self.shape in PUBLISHED:
            return PUBLISHED[self.shape]
        return shapes.from_flags(
            poisson_rate=self.arrival_rate if self.shape == "poisson" else None,
            rollouts=DEFAULT_ROLLOUTS, turns=self.turns, context_tokens=self.context_tokens,
            tool_tokens=LogNormal(*self.output_tokens), waits_s=LogNormal(*self.wait_s),
        )  # fmt: skip

    @property
    def rollout_count(self) -> int:
        """`rollouts`, or the shape's own number."""
        return self.rollouts or self.traffic.rollouts

    @property
    def admits(self) -> str:
        """`admission` decided: off, on or both."""
        if self.admission != "auto":
            return self.admission
        return "both" if self.engine == "vllm" or self.gpu_blocks is not None else "off"

    def _given(self, name: str) -> bool:
        """Whether the field `name` is other than its default (its flag was given)."""
        return bool(getattr(self, name) != getattr(attrs.fields(AgentsSettings), name).default)

    def problems(self) -> list[str]:
        """What is wrong with these settings together, in words (empty: nothing); each field's
        own range is its validator's."""
        found = []
        for name in FLAGS_SHAPED if self.shape in PUBLISHED else ():
            if self._given(name):
                flag = flag_of((AgentsSettings,), name)
                found.append(f"{flag}: --shape {self.shape} draws its own (burst and poisson "
                             "take it)")  # fmt: skip
        if self._given("arrival_rate") and self.shape != "poisson":
            found.append("--arrival-rate: only --shape poisson takes it")
        if self.engine_urls and self.engine != "vllm":
            found.append("--engine-url needs --engine vllm")
        if self.engines > 1 and self.engine != "vllm":
            found.append("--engines: more than 1 needs --engine vllm")
        elif self.engines > 1 and self.engine_urls:
            found.append("--engines starts engines: give it or --engine-url, not both")
        if self.thunderagent_url and self.engine != "vllm":
            found.append("--thunderagent-url needs --engine vllm (it fronts a vLLM engine)")
        if self.admission_workers > 1 and self.engine != "vllm":
            found.append(
                "--admission-workers: more than 1 needs --engine vllm (each worker would have a "
                "simulated GPU of its own)"
            )
        if self.admits != "off" and self.engine != "vllm" and self.gpu_blocks is None:
            found.append("--admission on the simulated GPU needs --num-gpu-blocks-override")
        return found


# -- the workload --------------------------------------------------------------------------------


@attrs.frozen
class Agent:
    """One rollout's own context, its tools' outputs and waits (turn 2..T's), and when and by
    which agent it runs (`shapes.RolloutPlan`'s)."""

    index: int
    context: str
    outputs: tuple[str, ...]
    waits_s: tuple[float, ...]
    agent: int = 0
    at_s: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.outputs) + 1


def _text(count: Count, tokens: int, line: Callable[[], str]) -> str:
    """Lines from `line()` until about `tokens` of the model's tokens (at least one line)."""
    lines: list[str] = []
    total = 0
    while not lines or total < tokens:
        text = line()
        lines.append(text)
        total += count(text + "\n")
    return "\n".join(lines)


def _numbered(rng: random.Random) -> Callable[[], str]:
    """Numbered lines of code, as `nl` prints a file."""
    numbers = iter(range(1, 10**9))
    return lambda: f"{next(numbers):>5}\t{_code_line(rng)}"


@attrs.define
class _Texts:
    """`shapes.Writer`: each rollout's context and tools' outputs, in the model's tokens."""

    count: Count
    nonce: str
    context_tokens: int
    contexts: list[str] = attrs.Factory(list)
    outputs: list[list[str]] = attrs.Factory(list)

    def context(self, rng: random.Random, index: int) -> None:
        words = rng.getrandbits(64)
        head = f"Rollout {index} ({self.nonce} {words:016x}): the repository's notes follow."
        prose = _prose(rng, self.context_tokens * 8, _GUIDANCE)
        paragraphs = iter(prose.split("\n\n"))
        text = _text(self.count, self.context_tokens, partial(next, paragraphs))
        self.contexts.append(head + "\n" + text)
        self.outputs.append([])

    def output(self, rng: random.Random, tokens: int) -> None:
        self.outputs[-1].append(_text(self.count, tokens, _numbered(rng)))


def make_agents(settings: AgentsSettings, count: Count, nonce: str) -> list[Agent]:
    """The rollouts of `settings.traffic` from `settings.seed`, written as drawn (`nonce` only
    tags each context's first line)."""
    shape = settings.traffic
    texts = _Texts(count, nonce, shape.context_tokens)
    plans = shapes.draw(shape, settings.seed, settings.rollout_count, texts)
    return [
        Agent(plan.index, context, tuple(outputs), plan.waits_s, plan.agent, plan.at_s)
        for plan, context, outputs in zip(plans, texts.contexts, texts.outputs, strict=True)
    ]


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile (`share` in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]
