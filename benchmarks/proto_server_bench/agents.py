"""`proto-server bench agents`: many rollouts at once on one engine, path after path.

N rollouts run at once, each with a context of its own (a first message of about K of the
model's tokens, so that rollouts share nothing past the instructions and the tool), T turns with
a forced call on each but the last, and between turns a tool that takes a log-normal time and
prints a log-normal number of tokens (both seeded: the same seed, the same workload). The client
runs the tools (it sleeps): the server only sees each rollout suspend and resume. The published
shapes are the Codex SWE-bench Pro traces' (gaps between turns: median 5.2 s, P99 81.4 s); the
defaults keep their ratio, scaled down to a 1 s median for a small machine.

The same workload runs through each path, one path after the other, on the same engine:
proto-server's prototype WebSocket (one Response, suspended at each call), its launched
WebSocket (`previous_response_id`, `store: false`) and, on a real vLLM, the peers: vLLM's own
`/v1/responses` with the whole history, vLLM's `/v1/chat/completions` alone (the client keeps and
resends the messages, as an agent library does) and, given the URL of one the user started,
ThunderAgent (or any proxy that schedules programs by a `program_id` sent with chat completions)
in front of the same engine (the clients are `bench.paths`' and `bench.chat`'s). On the
simulated GPU (the default) only proto-server's paths run and the engine's time is modelled.

Per path: makespan, the prompt tokens prefilled (each turn's `input_tokens - cached_tokens`)
against what an unbounded cache would have prefilled, the cached share, TTFT p50/p99 over every
turn and p50/p90 over the turns after a tool (the client's first output event after its request)
and the engine's preemptions (`/metrics`).

Why one module of this length: the workload, each path's run and the report share the records
`Agent`, `AgentTurn` and `PathRun`. The paths' names (`ADMITTED`, `SPREAD`) are made by
`run_agents` and read back by `Target` and `spread_vs_one`: split, a name would be built in one
file and parsed in another.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from proto_server.bench.chat import CHAT, PROGRAMS, open_chat
from proto_server.bench.paths import (
    ASK,
    INSTRUCTIONS,
    LAUNCHED,
    PATH_FAILURES,
    PROTOTYPE,
    STATELESS,
    Items,
    Said,
    follow_up,
    open_path,
    start_proto_server,
    start_serve,
)
from proto_server.bench.report import NO_PLOTS, pyplot
from proto_server.bench.tables import table
from proto_server.bench.workload import _GUIDANCE, _code_line, _prose

Progress = Callable[[str], None]
Count = Callable[[str], int]
ENGINES = ("simulated", "vllm")
#: The published gaps between turns (Codex SWE-bench Pro traces): P99 over median.
PUBLISHED_WAIT_RATIO = 81.4 / 5.2
#: z of the 99th percentile of a standard normal: a log-normal's sigma from its median and p99.
Z99 = 2.3263
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


@attrs.frozen(kw_only=True)
class AgentsSettings:
    rollouts: int = 6
    turns: int = 4
    context_tokens: int = 450
    #: A tool output's size in the model's tokens: median and 99th percentile.
    output_tokens: tuple[float, float] = (180.0, 540.0)
    #: A tool's time in seconds: median and 99th percentile.
    wait_s: tuple[float, float] = (1.0, PUBLISHED_WAIT_RATIO)
    seed: int = 0
    engine: str = "simulated"
    #: vLLMs already running (each one's base, ending in /v1); none: start `engines` of them.
    engine_urls: tuple[str, ...] = ()
    #: Engines to start (without `engine_urls`): more than one adds the launched path through
    #: one proto-server in front of all of them, beside the same path on the first alone.
    engines: int = 1
    gpu_blocks: int | None = None
    vllm_python: str = ".vllm/bin/python"
    answer_tokens: int = 32
    prefill_rate: float = 20_000.0
    out_dir: Path = Path("bench-results")
    #: proto-server's paths without the server's admission by KV capacity, with it, or both
    #: side by side (a second server process admits; it needs a known cache size); auto: both
    #: where the cache's size is known (a vLLM engine, or a bounded simulated one), else off.
    admission: str = "auto"
    #: The admitting server's `--admission-ttl` and `--admission-ttl-median` (None: its own).
    admission_ttl_s: float | None = None
    admission_ttl_median: float | None = None
    #: The admitting server's `--workers`: more than one share the engine's room through a
    #: store file they share (`--admission-shared`).
    admission_workers: int = 1
    #: The admitting server's `--kv-target-fill` (None: its own).
    kv_target_fill: float | None = None
    #: The admitting server's `--admission-growth` (None: its own).
    admission_growth: float | None = None
    #: A ThunderAgent the user started in front of the first engine (its root, or its /v1):
    #: adds the chat-completions path with a `program_id` per rollout through it.
    thunderagent_url: str = ""

    @property
    def admits(self) -> str:
        """`admission` decided: off, on or both."""
        if self.admission != "auto":
            return self.admission
        return "both" if self.engine == "vllm" or self.gpu_blocks is not None else "off"

    def problems(self) -> list[str]:
        """What is wrong with these settings, in words (empty: nothing)."""
        found = []
        if self.rollouts < 1 or self.turns < 2:
            found.append("--rollouts must be at least 1 and --turns at least 2")
        if self.context_tokens < 1 or self.answer_tokens < 1:
            found.append("--context-tokens and --decode-tokens must be at least 1")
        for flag, (median, p99) in (("--tool-tokens", self.output_tokens),
                                    ("--wait-s", self.wait_s)):  # fmt: skip
            if not (0 < median <= p99 < math.inf):
                found.append(f"{flag}: expected 0 < MEDIAN <= P99, finite; got {median} {p99}")
        if self.gpu_blocks is not None and self.gpu_blocks < 2:
            found.append("--num-gpu-blocks-override needs at least 2 blocks")
        if self.engine_urls and self.engine != "vllm":
            found.append("--engine-url needs --engine vllm")
        if self.engines < 1 or (self.engines > 1 and self.engine != "vllm"):
            found.append("--engines must be at least 1, and more than 1 needs --engine vllm")
        elif self.engines > 1 and self.engine_urls:
            found.append("--engines starts engines: give it or --engine-url, not both")
        if self.thunderagent_url and self.engine != "vllm":
            found.append("--thunderagent-url needs --engine vllm (it fronts a vLLM engine)")
        proxy = urlsplit(self.thunderagent_url)
        if self.thunderagent_url and (proxy.scheme not in ("http", "https") or not proxy.hostname):
            found.append(
                "--thunderagent-url must be the proxy's root, e.g. http://127.0.0.1:8710, got "
                f"{self.thunderagent_url!r}"
            )
        if self.admission_ttl_s is not None and not self.admission_ttl_s > 0:
            found.append(f"--admission-ttl must be positive, got {self.admission_ttl_s}")
        learned = self.admission_ttl_median
        if learned is not None and not 0 <= learned <= 1000:
            found.append(f"--admission-ttl-median must be between 0 and 1000, got {learned}")
        if self.admission_workers < 1 or (self.admission_workers > 1 and self.engine != "vllm"):
            found.append(
                "--admission-workers must be at least 1, and more than 1 needs --engine vllm "
                "(each worker would have a simulated GPU of its own)"
            )
        fill = self.kv_target_fill
        if fill is not None and not 0.01 <= fill <= 1:
            found.append(f"--kv-target-fill must be between 0.01 and 1, got {fill}")
        growth = self.admission_growth
        if growth is not None and not 1 <= growth <= 100:
            found.append(f"--admission-growth must be between 1 and 100, got {growth}")
        if self.admission not in ADMISSION_CHOICES:
            found.append(f"--admission: one of {', '.join(ADMISSION_CHOICES)}")
        elif self.admits != "off" and self.engine != "vllm" and self.gpu_blocks is None:
            found.append("--admission on the simulated GPU needs --num-gpu-blocks-override")
        return found


# -- the workload --------------------------------------------------------------------------------


@attrs.frozen
class Agent:
    """One rollout's own context, its tools' outputs and waits (turn 2..T's)."""

    index: int
    context: str
    outputs: tuple[str, ...]
    waits_s: tuple[float, ...]


def lognormal(rng: random.Random, median: float, p99: float) -> float:
    """A draw from the log-normal with this median and 99th percentile."""
    return median * math.exp(rng.gauss(0.0, math.log(p99 / median) / Z99))


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


def make_agents(settings: AgentsSettings, count: Count, nonce: str) -> list[Agent]:
    """The rollouts, from `settings.seed` (`nonce` only tags each context's first line)."""
    rng = random.Random(settings.seed)
    agents = []
    for index in range(settings.rollouts):
        words = rng.getrandbits(64)
        head = f"Rollout {index} ({nonce} {words:016x}): the repository's notes follow."
        prose = _prose(rng, settings.context_tokens * 8, _GUIDANCE)
        paragraphs = iter(prose.split("\n\n"))
        context = head + "\n" + _text(count, settings.context_tokens, partial(next, paragraphs))
        outputs, waits = [], []
        for turn in range(2, settings.turns + 1):
            size = max(1, round(lognormal(rng, *settings.output_tokens)))
            outputs.append(_text(count, size, _numbered(rng)))
            waits.append(lognormal(rng, *settings.wait_s))
            del turn
        agents.append(Agent(index, context, tuple(outputs), tuple(waits)))
    return agents


# -- one path ------------------------------------------------------------------------------------


@attrs.frozen
class AgentTurn:
    path: str
    rollout: int
    turn: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    turn_s: float
    #: When the turn's request went, from the path's start.
    at_s: float


@attrs.frozen
class PathRun:
    path: str
    turns: tuple[AgentTurn, ...]
    makespan_s: float
    #: The engine's counters over the path (empty on the simulated GPU).
    engine: dict[str, float]
    failed: str | None = None
    #: The admitting server's demotions over the path (None: a path it does not serve).
    demotions: float | None = None


@attrs.frozen
class Target:
    """Where a path's clients go."""

    proto_url: str
    engine_url: str
    model: str
    answer_tokens: int
    #: The proto-server that admits rollouts by the engine's KV capacity (its paths' names end
    #: in `ADMITTED`).
    admitted_url: str = ""
    #: The proto-server in front of every engine, and its path's name (`SPREAD`).
    spread_url: str = ""
    spread: str = ""
    #: The program-scheduling proxy's base (ending in /v1), for `PROGRAMS`.
    programs_url: str = ""

    def url(self, path: str) -> str:
        if self.spread and path == self.spread:
            return self.spread_url
        if path == PROGRAMS:
            return self.programs_url
        return self.admitted_url if path.endswith(ADMITTED) else self.proto_url

    def dialect(self, path: str) -> str:
        """The client's path (`bench.paths`' name) that `path` runs."""
        return LAUNCHED if path == self.spread else path.removesuffix(ADMITTED)


async def engine_counters(
    http: httpx.AsyncClient, wanted: Mapping[str, str] = COUNTERS
) -> dict[str, float]:
    """The `wanted` counters of a Prometheus scrape (the engine's, by default) now, each
    summed over its label sets."""
    values = dict.fromkeys(wanted, 0.0)
    names = {name: key for key, name in wanted.items()}
    scrape = await http.get("/metrics")
    scrape.raise_for_status()  # never zeros for a scrape that failed
    for line in scrape.text.splitlines():
        key = names.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            values[key] += float(line.rsplit(" ", 1)[1])
    return values


async def demotions(target: Target, path: str) -> float | None:
    """The admitting server's demotions so far (places that lapsed while others waited), for
    a path it serves; None for another path."""
    if not path.endswith(ADMITTED):
        return None
    origin = target.admitted_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=origin, timeout=30) as server:
        return (await engine_counters(server, SERVER_COUNTERS))["demotions"]


async def summed_counters(engines: Sequence[httpx.AsyncClient]) -> dict[str, float]:
    """`engine_counters` over several engines, added up."""
    values = dict.fromkeys(COUNTERS, 0.0)
    for engine in engines:
        for key, value in (await engine_counters(engine)).items():
            values[key] += value
    return values


async def _rollout(
    path: str,
    target: Target,
    agent: Agent,
    instructions: str,
    started: float,
    record: Callable[[AgentTurn], None],
) -> None:
    """One rollout through one path: the tool's waits are the client's own sleeps."""
    dialect = target.dialect(path)
    opener = open_chat if dialect in (CHAT, PROGRAMS) else open_path
    opened = opener(dialect, target.url(path), target.engine_url, target.model, instructions,
                    target.answer_tokens)  # fmt: skip
    async with opened as send:
        new: Items = [{"role": "user", "content": f"{agent.context}\n\n{ASK}"}]
        last = len(agent.outputs) + 1
        for turn in range(1, last + 1):
            at = time.perf_counter() - started
            said: Said = await send(new, "required" if turn < last else "none")
            record(AgentTurn(path, agent.index, turn, *said.usage, said.ttft_s, said.turn_s, at))
            if turn < last:
                await trio.sleep(agent.waits_s[turn - 1])
                new = follow_up(said.output, agent.outputs[turn - 1])


async def run_path(
    path: str,
    target: Target,
    agents: Sequence[Agent],
    nonce: str,
    engines: Sequence[httpx.AsyncClient],
    progress: Progress,
) -> PathRun:
    """Every rollout at once through `path`; a failure ends the path (and says why), not the run.
    `engines`: whose counters it reads (summed), none on the simulated GPU."""
    instructions = f"[{nonce} {path}] {INSTRUCTIONS}"  # nothing of another path's is cached
    turns: list[AgentTurn] = []
    before = await summed_counters(engines) if engines else {}
    demoted = await demotions(target, path)
    started = time.perf_counter()
    done = 0

    async def one(agent: Agent) -> None:
        nonlocal done
        await _rollout(path, target, agent, instructions, started, turns.append)
        done += 1
        mine = [t for t in turns if t.rollout == agent.index]
        cached = sum(t.cached_tokens for t in mine) / max(1, sum(t.input_tokens for t in mine))
        progress(f"{path}: rollout {agent.index} done ({done}/{len(agents)}) at "
                 f"{time.perf_counter() - started:.1f} s, cached share {cached:.0%}")  # fmt: skip

    failed = None
    try:
        async with trio.open_nursery() as nursery:
            for agent in agents:
                nursery.start_soon(one, agent)
    except* PATH_FAILURES as group:
        failed = "; ".join(f"{e.__class__.__name__}: {e}" for e in group.exceptions)
        progress(f"{path} failed: {failed}")
    makespan = time.perf_counter() - started
    counted: dict[str, float] = {}
    if engines:
        wanted = before["finished"] + len(turns)
        for _ in range(100):  # the engine counts a request a moment after its stream ends
            after = await summed_counters(engines)
            if after["finished"] >= wanted:
                break
            await trio.sleep(0.05)
        counted = {key: after[key] - before[key] for key in COUNTERS}
    if demoted is not None:
        demoted = cast(float, await demotions(target, path)) - demoted
    ordered = sorted(turns, key=lambda t: (t.rollout, t.turn))
    return PathRun(path, tuple(ordered), makespan, counted, failed, demoted)


# -- engines -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def engine_python(settings: AgentsSettings) -> str:
    """The engine's interpreter: $PROTO_SERVER_VLLM_PYTHON (as the engine tests), else the flag."""
    return os.environ.get("PROTO_SERVER_VLLM_PYTHON") or settings.vllm_python


def engine_command(python: str, model_dir: Path, port: int, gpu_blocks: int | None) -> list[str]:
    """vLLM's OpenAI server as the engine tests start it (SmolLM2, block size 32, prefix caching,
    the hermes parser for its own endpoint's calls), its cache bounded by `gpu_blocks`; it
    schedules by priority, which a request without one (every path but an admitting
    proto-server's) leaves in arrival order."""
    # the engine refuses a cache that cannot hold one request of its longest (it found one
    # block less than the override usable)
    longest = MAX_MODEL_LEN
    if gpu_blocks is not None:
        longest = min(longest, (gpu_blocks - 1) * BLOCK_SIZE)
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "smollm2",
        "--dtype", "float32", "--max-model-len", str(longest), "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--scheduling-policy", "priority",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if gpu_blocks is not None:
        command += ["--num-gpu-blocks-override", str(gpu_blocks)]
    return command


@contextlib.asynccontextmanager
async def started_engine(
    settings: AgentsSettings, progress: Progress, number: int = 1
) -> AsyncIterator[str]:
    """A vLLM CPU engine of this run's own (its log in the output folder), stopped after."""
    from proto_server.engine.model_files import (
        default_cache_dir,
        default_model_path,
        model_directory,
    )

    python = engine_python(settings)
    model_dir = model_directory(default_model_path(), default_cache_dir())
    port = _free_port()
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.out_dir / ("agents-engine" + (f"-{number}" if number > 1 else "") + ".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    url = f"http://127.0.0.1:{port}/v1"
    progress(f"starting vLLM on port {port} (log: {log_path})")
    with log_path.open("ab") as log:
        process = await trio.lowlevel.open_process(
            engine_command(python, model_dir, port, settings.gpu_blocks),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            with trio.fail_after(ENGINE_READY_S):
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"vLLM exited ({process.returncode}); see {log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(f"{url}/models")).status_code == 200:
                            break
                    await trio.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with trio.move_on_after(30):
            await process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def run_agents(settings: AgentsSettings, progress: Progress) -> dict[str, Any]:
    """Every path in turn on one engine (and, with several, the launched path on all of them);
    the run's JSON (settings, workload, paths, summary)."""
    nonce = f"{os.getpid()}-{time.time_ns() % 10**9}"
    spread = spread_url = ""
    async with contextlib.AsyncExitStack() as stack:
        if settings.engine == "vllm":
            from proto_server.engine.model_files import load_tokenizer
            from proto_server.engine.vllm import discover, tokenizer_source

            urls = list(settings.engine_urls)
            for number in range(1, settings.engines + 1) if not urls else ():
                started = started_engine(settings, progress, number)
                urls.append(await stack.enter_async_context(started))
            url = urls[0]
            model = await discover(url, None)
            tokenizer = load_tokenizer(tokenizer_source(model, None)).tokenizer

            def count(text: str) -> int:
                return len(tokenizer.encode(text, add_special_tokens=False))

            paths: tuple[str, ...] = (PROTOTYPE, LAUNCHED, STATELESS, CHAT)
            if settings.thunderagent_url:
                paths += (PROGRAMS,)
            name = model.name
            # proto-server's paths without admission (on by default in front of vLLM)
            process, proto_url = await start_proto_server(
                url, settings.answer_tokens, ["--no-kv-capacity-from-engine"]
            )
            stack.push_async_callback(_stop, process)
            # the engine this run started schedules by priority (none given: arrival order)
            admitting = ["--kv-capacity-from-engine"]
            if not settings.engine_urls:
                admitting.append("--engine-priority")
            engines = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=each.removesuffix("/v1"), timeout=30)
                )
                for each in urls
            ]
            if len(urls) > 1:  # the launched path again, through one server in front of all
                others = [flag for each in urls[1:] for flag in ("--engine-url", each)]
                front, spread_url = await start_proto_server(url, settings.answer_tokens, others)
                stack.push_async_callback(_stop, front)
                spread = LAUNCHED + SPREAD.format(len(urls))
        else:
            from proto_server.core.tokenizer import o200k_base

            encoding = o200k_base()

            def count(text: str) -> int:
                return len(encoding.encode_ordinary(text))

            paths, name, url, engines = (PROTOTYPE, LAUNCHED), "proto-sim", "", []
            flags = ["--prefill-rate", str(settings.prefill_rate)]
            admitting = []
            if settings.gpu_blocks is not None:  # the simulated GPU's cache, as bounded
                tokens = str(settings.gpu_blocks * BLOCK_SIZE)
                flags += ["--prefix-cache-tokens", tokens]
                admitting = ["--kv-capacity-tokens", tokens]
            process, proto_url = await start_serve(flags)
            stack.push_async_callback(_stop, process)
        admitted_url = ""
        if settings.admission_ttl_s is not None:
            admitting += ["--admission-ttl", f"{settings.admission_ttl_s:g}"]
        if settings.admission_ttl_median is not None:
            admitting += ["--admission-ttl-median", f"{settings.admission_ttl_median:g}"]
        if settings.kv_target_fill is not None:
            admitting += ["--kv-target-fill", f"{settings.kv_target_fill:g}"]
        if settings.admission_growth is not None:
            admitting += ["--admission-growth", f"{settings.admission_growth:g}"]
        if settings.admission_workers > 1:  # they share the engine's room through the file
            shared = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "store.sqlite3"
            admitting += ["--workers", str(settings.admission_workers), "--store", str(shared)]
        if settings.admits != "off":
            if settings.engine == "vllm":
                admitter, admitted_url = await start_proto_server(
                    url, settings.answer_tokens, admitting
                )
            else:
                admitter, admitted_url = await start_serve([*flags, *admitting])
            stack.push_async_callback(_stop, admitter)
            ours = tuple(p for p in paths if p in (PROTOTYPE, LAUNCHED))
            admitted = tuple(p + ADMITTED for p in ours)
            if settings.admits == "on":
                paths = (*admitted, *paths[len(ours) :])
            else:  # side by side: each of ours, then the same with admission
                paths = (*(p for pair in zip(ours, admitted, strict=True) for p in pair),
                         *paths[len(ours) :])  # fmt: skip
        if spread:  # after the launched paths on one engine, for the side-by-side
            last = max(i for i, p in enumerate(paths) if p.startswith(LAUNCHED))
            paths = (*paths[: last + 1], spread, *paths[last + 1 :])
        agents = make_agents(settings, count, nonce)
        programs = settings.thunderagent_url.rstrip("/").removesuffix("/v1")
        target = Target(proto_url, url, name, settings.answer_tokens, admitted_url,
                        spread_url, spread, programs and programs + "/v1")  # fmt: skip
        runs = []
        for index, path in enumerate(paths, 1):
            progress(f"[{index}/{len(paths)}] {path}: {len(agents)} rollouts x "
                     f"{settings.turns} turns")  # fmt: skip
            counted = engines if path == spread else engines[:1]
            runs.append(await run_path(path, target, agents, nonce, counted, progress))
    return report(settings, agents, runs, count)


async def _stop(process: trio.Process) -> None:
    process.terminate()
    with trio.move_on_after(30):
        await process.wait()


# -- what a run says -----------------------------------------------------------------------------


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile (`share` in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _shared_prefix(turns: Sequence[AgentTurn]) -> tuple[int, int]:
    """(the prefix all rollouts share, in tokens, how many first turns there are). The prefix
    (the instructions, the tool) is taken as the most any first turn found cached: each
    rollout's context is its own, so no first turn can find more in the cache than that."""
    firsts = [t.cached_tokens for t in turns if t.turn == 1]
    return max(firsts, default=0), len(firsts)


def _resumed(turns: Sequence[AgentTurn]) -> list[tuple[AgentTurn, int]]:
    """Each turn after a rollout's first, with its new tokens: its prompt less the previous
    prompt and what the model said (whose KV the decode made)."""
    resumed = []
    previous: dict[int, AgentTurn] = {}
    for turn in sorted(turns, key=lambda t: (t.rollout, t.turn)):
        last = previous.get(turn.rollout)
        if last is not None:
            new = max(0, turn.input_tokens - last.input_tokens - last.output_tokens)
            resumed.append((turn, new))
        previous[turn.rollout] = turn
    return resumed


def unbounded_need(turns: Sequence[AgentTurn]) -> int:
    """What a cache that never evicts would have prefilled for these turns: per rollout, its
    first prompt whole, then each turn's new tokens; the prefix all rollouts share counts once."""
    shared, firsts = _shared_prefix(turns)
    need = sum(t.input_tokens for t in turns if t.turn == 1) - shared * max(0, firsts - 1)
    return need + sum(new for _, new in _resumed(turns))


def working_set(turns: Sequence[AgentTurn]) -> int:
    """What the rollouts hold at their largest: each one's last prompt, added up."""
    last: dict[int, int] = {}
    for turn in turns:
        last[turn.rollout] = max(last.get(turn.rollout, 0), turn.input_tokens)
    return sum(last.values())


def past_need(turns: Sequence[AgentTurn], block_tokens: int = BLOCK_SIZE) -> dict[str, int]:
    """What was prefilled past `unbounded_need`, by cause, so that a run says what to fix:
    `evicted`, resumed turns that prefilled more than a block past their new tokens (their
    rollout's own earlier tokens were let go while it waited on its tool; `evicted_turns`
    counts them); `partial_blocks`, resumed turns that prefilled at most a block more (an
    engine caches whole blocks only, so the tail of what it held that fills no block is
    computed again, as an unbounded vLLM cache would too); `shared_prefix`, first turns that
    did not find the prefix all rollouts share. The three add up to the excess. On vLLM's own
    path, an earlier answer that its template renders otherwise than it was decoded is a miss
    from there on, and counts as evicted too (proto-server's paths keep the model's tokens)."""
    shared, firsts = _shared_prefix(turns)
    first_turns = [t for t in turns if t.turn == 1]
    first_need = sum(t.input_tokens for t in first_turns) - shared * max(0, firsts - 1)
    first_prefilled = sum(t.input_tokens - t.cached_tokens for t in first_turns)
    evicted = partial = evicted_turns = 0
    for turn, new in _resumed(turns):
        over = turn.input_tokens - turn.cached_tokens - new
        if over > block_tokens:
            evicted += over
            evicted_turns += 1
        else:
            partial += over
    return {"evicted": evicted, "evicted_turns": evicted_turns, "partial_blocks": partial,
            "shared_prefix": first_prefilled - first_need}  # fmt: skip


def summarize(run: PathRun, modelled: bool) -> dict[str, Any]:
    """One path's figures."""
    turns = run.turns
    prompt = sum(t.input_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    need = unbounded_need(turns)
    ttfts = [t.ttft_s for t in turns]
    after_tool = [t.ttft_s for t in turns if t.turn > 1]
    by_turn: dict[int, list[float]] = {}
    for t in turns:
        share = t.cached_tokens / t.input_tokens if t.input_tokens else 0.0
        by_turn.setdefault(t.turn, []).append(share)
    return {
        "path": run.path,
        "time": "modelled engine time" if modelled else "measured",
        "failed": run.failed,
        "turns": len(turns),
        "makespan_s": run.makespan_s,
        "input_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "unbounded_need_tokens": need,
        "prefilled_vs_unbounded": (prompt - cached) / need if need else math.nan,
        "working_set_tokens": working_set(turns),
        "past_need_tokens": past_need(turns),
        "cached_share": cached / prompt if prompt else math.nan,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_after_tool_p50_s": percentile(after_tool, 0.5),
        "ttft_after_tool_p90_s": percentile(after_tool, 0.9),
        "cached_share_per_turn": {str(k): statistics.mean(v) for k, v in sorted(by_turn.items())},
        "engine": run.engine,
        "preemptions": run.engine.get("preemptions"),
        "demotions": run.demotions,
    }


def report(
    settings: AgentsSettings, agents: Sequence[Agent], runs: Sequence[PathRun], count: Count
) -> dict[str, Any]:
    modelled = settings.engine == "simulated"
    workload = {
        "rollouts": len(agents),
        "turns": settings.turns,
        "context_tokens": [count(a.context) for a in agents],
        "tool_output_tokens": [[count(o) for o in a.outputs] for a in agents],
        "waits_s": [list(a.waits_s) for a in agents],
    }
    paths = [summarize(run, modelled) for run in runs]
    return {
        "settings": attrs.asdict(settings, value_serializer=_plain),
        "workload": workload,
        "paths": paths,
        "turns": [attrs.asdict(t) for run in runs for t in run.turns],
        "spread_vs_one": spread_vs_one(paths),
        "against_vllm": against_vllm(paths, settings),
    }


#: Issue 19's goal for several engines: each turn's cached share within this of one engine's.
SPREAD_POINTS = 5.0


#: Issue 19's goals under pressure (a working set at least `PRESSURE` times the cache), each a
#: ratio to vLLM's own path in the same run: prefilled / unbounded need, makespan, TTFT p99.
PRESSURE = 1.5
GOALS = {"prefilled_vs_unbounded": 1.2, "makespan": 0.7, "ttft_p99": 0.5}


def against_vllm(
    paths: Sequence[dict[str, Any]], settings: AgentsSettings
) -> dict[str, Any] | None:
    """Each proto-server path on one engine against issue 19's goals under pressure: its
    prefill over the unbounded need, its makespan and TTFT p99 over vLLM's own path's in the
    same run; `pressure`, its working set (each rollout's last prompt) over the cache: the
    goals are judged only under pressure (`holds` None below it). None without vLLM's own
    path or a bounded cache."""
    vllm = next((p for p in paths if p["path"] == STATELESS and not p["failed"]), None)
    if vllm is None or settings.gpu_blocks is None:
        return None
    cache = settings.gpu_blocks * BLOCK_SIZE
    judged = {}
    for p in paths:
        peer = p["path"] in (CHAT, PROGRAMS) or p["path"].startswith(LAUNCHED + " on ")
        if p is vllm or p["failed"] or peer:
            continue
        pressure = p["working_set_tokens"] / cache
        ratios = {"prefilled_vs_unbounded": p["prefilled_vs_unbounded"],
                  "makespan": p["makespan_s"] / vllm["makespan_s"],
                  "ttft_p99": p["ttft_p99_s"] / vllm["ttft_p99_s"]}  # fmt: skip
        holds = {k: v <= GOALS[k] if pressure >= PRESSURE else None for k, v in ratios.items()}
        judged[p["path"]] = {"pressure": pressure, "ratios": ratios, "holds": holds}
    return judged


def spread_vs_one(paths: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The launched path on several engines against it on one: each turn's cached share, in
    points (100 x the share) above one engine's, from turn 2 (the first finds only the shared
    prefix on either); None without both paths."""
    one = next((p for p in paths if p["path"] == LAUNCHED), None)
    many = next((p for p in paths if p["path"].startswith(LAUNCHED + " on ")), None)
    if one is None or many is None or one["failed"] or many["failed"]:
        return None
    a, b = one["cached_share_per_turn"], many["cached_share_per_turn"]
    points = {turn: 100 * (b[turn] - a[turn]) for turn in a if turn != "1" and turn in b}
    worst = min(points.values(), default=0.0)
    return {"path": many["path"], "points_per_turn": points, "worst_points": worst,
            "holds": worst >= -SPREAD_POINTS}  # fmt: skip


def _plain(instance: Any, field: Any, value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def render(data: dict[str, Any]) -> str:
    s = data["settings"]
    engine = (
        "the simulated GPU (engine time modelled, front end measured)"
        if s["engine"] == "simulated"
        else "vLLM CPU, SmolLM2, block size 32, KV cache "
        + (f"{s['gpu_blocks']} blocks ({s['gpu_blocks'] * BLOCK_SIZE:,} tokens)"
           if s["gpu_blocks"] else "unbounded by the bench (VLLM_CPU_KVCACHE_SPACE=2 GiB)")
    )  # fmt: skip
    waits = [w for ws in data["workload"]["waits_s"] for w in ws]
    outs = [o for os_ in data["workload"]["tool_output_tokens"] for o in os_]
    lines = [
        f"proto-server bench agents: {s['rollouts']} rollouts x {s['turns']} turns at once on "
        f"{engine}; contexts of ~{s['context_tokens']} tokens, tool outputs median "
        f"{statistics.median(outs):.0f} tokens (max {max(outs)}), tool waits median "
        f"{statistics.median(waits):.2f} s (max {max(waits):.1f} s), seed {s['seed']}",
        "",
    ]
    header = ["path", "makespan s", "prompt", "prefilled", "unbounded need", "prefilled/need",
              "cached share", "TTFT p50 / p99 s", "after a tool p50 / p90 s",
              "preemptions"]  # fmt: skip
    rows = []
    for p in data["paths"]:
        pre = p["preemptions"]
        rows.append([
            p["path"] + (" (FAILED)" if p["failed"] else ""), f"{p['makespan_s']:.1f}",
            str(p["input_tokens"]), str(p["prefilled_tokens"]), str(p["unbounded_need_tokens"]),
            f"{p['prefilled_vs_unbounded']:.2f}x", f"{p['cached_share']:.0%}",
            f"{p['ttft_p50_s']:.2f} / {p['ttft_p99_s']:.2f}",
            f"{p['ttft_after_tool_p50_s']:.2f} / {p['ttft_after_tool_p90_s']:.2f}",
            "n/a" if pre is None else f"{pre:.0f}",
        ])  # fmt: skip
    lines += table(header, rows)
    lines += ["", "Prefilled past the unbounded need, by cause (tokens, and over the need):"]
    lines += table(
        ["path", "evicted while waiting", "places lapsed", "partial blocks", "shared prefix"],
        [[p["path"], *_causes(p)] for p in data["paths"]],
    )
    lines += ["", "Cached share per turn (mean over rollouts):"]
    turn_keys = sorted({k for p in data["paths"] for k in p["cached_share_per_turn"]}, key=int)
    lines += table(
        ["path", *(f"turn {k}" for k in turn_keys)],
        [[p["path"], *(f"{p['cached_share_per_turn'].get(k, math.nan):.0%}" for k in turn_keys)]
         for p in data["paths"]],
    )  # fmt: skip
    judged = data.get("against_vllm")
    if judged:
        lines += [
            "",
            "Issue 19's goals under pressure (working set at least "
            f"{PRESSURE:g}x the cache), against vLLM's own path in this run:",
        ]
        names = {"prefilled_vs_unbounded": "prefilled/need", "makespan": "makespan",
                 "ttft_p99": "TTFT p99"}  # fmt: skip
        rows = []
        for path, j in judged.items():
            verdicts = {True: "holds", False: "fails", None: "no pressure"}
            cells = [f"{j['ratios'][k]:.2f}x (goal {GOALS[k]:g}x: {verdicts[j['holds'][k]]})"
                     for k in names]  # fmt: skip
            rows.append([path, f"{j['pressure']:.1f}x", *cells])
        lines += table(["path", "working set / cache", *names.values()], rows)
    spread = data.get("spread_vs_one")
    if spread is not None:
        each = ", ".join(f"turn {t} {v:+.1f}" for t, v in spread["points_per_turn"].items())
        verdict = "holds" if spread["holds"] else "FAILS"
        lines += ["", f"{spread['path']} against one engine, cached share in points: {each}",
                  f"Goal (issue 19): each turn within {SPREAD_POINTS:g} points of one "
                  f"engine's (not below it by more): {verdict} (worst "
                  f"{spread['worst_points']:+.1f})"]  # fmt: skip
    for p in data["paths"]:
        if p["failed"]:
            lines.append(f"\n{p['path']} failed: {p['failed']}")
    return "\n".join(lines)


def _causes(path: dict[str, Any]) -> list[str]:
    """A path's `past_need_tokens` as table cells, with the admitting server's demotions
    (its places that lapsed while others waited: a rollout evicted while waiting was one, or
    was evicted by the admitted rollouts' growth)."""
    past, need = path["past_need_tokens"], path["unbounded_need_tokens"]

    def cell(tokens: int) -> str:
        return f"{tokens:,} ({tokens / need:.2f}x)" if need else f"{tokens:,}"

    turns, lapsed = past["evicted_turns"], path["demotions"]
    return [f"{cell(past['evicted'])}, {turns} turn{'s' * (turns != 1)}",
            "n/a" if lapsed is None else f"{lapsed:.0f}",
            cell(past["partial_blocks"]), cell(past["shared_prefix"])]  # fmt: skip


def write_files(data: dict[str, Any], directory: Path) -> list[Path] | str:
    """agents.json and the PNGs, or why there are no plots (matplotlib is the `bench` extra)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "agents.json").write_text(json.dumps(data, indent=2))
    plt = pyplot()
    if plt is None:
        return NO_PLOTS
    label = " (modelled engine time)" if data["settings"]["engine"] == "simulated" else ""
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    for p in data["paths"]:
        ttfts = sorted(t["ttft_s"] for t in data["turns"] if t["path"] == p["path"])
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        axes.step(ttfts, shares, where="post", label=p["path"])
    axes.set(title=f"TTFT over every turn, per path{label}", xlabel="s", ylabel="share of turns")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[0])
    plt.close(figure)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=80)
    for p in data["paths"]:
        per = p["cached_share_per_turn"]
        axes.plot([int(k) for k in per], list(per.values()), marker=".", label=p["path"])
    axes.set(title="Cached share of the prompt per turn (mean over rollouts)", xlabel="turn",
             ylabel="share", ylim=(0, 1))  # fmt: skip
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / PLOTS[1])
    plt.close(figure)
    return [directory / name for name in PLOTS]


def main(settings: AgentsSettings) -> int:
    """The command: the run, its table on stdout, its files; 1 when a path failed."""
    problems = settings.problems()
    needs_engine = settings.engine == "vllm" and not settings.engine_urls
    if needs_engine and not Path(engine_python(settings)).exists():
        problems.append(f"no vLLM environment at {engine_python(settings)}; pass --vllm-python "
                        "(or set PROTO_SERVER_VLLM_PYTHON), or --engine-url")  # fmt: skip
    if problems:
        for problem in problems:
            print(f"proto-server bench agents: {problem}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    data = trio.run(run_agents, settings, progress)
    print(render(data))
    plots = write_files(data, settings.out_dir)
    print(f"\nSaved {settings.out_dir / 'agents.json'}")
    print(plots if isinstance(plots, str) else "Plots: " + ", ".join(map(str, plots)))
    return 1 if any(p["failed"] for p in data["paths"]) else 0
