"""`bench agents`: one path's run, every rollout started as its shape says through one of the
paths (proto-server's WebSocket dialects, vLLM's own /v1/responses, chat completions), and the
engines' counters around it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import attrs
import httpx
import trio

from proto_server_bench.agents import ADMITTED, COUNTERS, SERVER_COUNTERS, Agent, Progress
from proto_server_bench.chat import CHAT, PROGRAMS, open_chat
from proto_server_bench.paths import (
    ASK,
    INSTRUCTIONS,
    LAUNCHED,
    PATH_FAILURES,
    Items,
    Said,
    follow_up,
    open_path,
)

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
    #: Rollouts that ran to their last turn.
    finished: int = 0


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
        """The client's path (`paths.py`' name) that `path` runs."""
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
    """Every rollout through `path`, each from its `at_s` on and after its agent's earlier
    ones (`shapes.draw`); a failure ends the path (and says why), not the run. `engines`: whose
    counters it reads (summed), none on the simulated GPU."""
    instructions = f"[{nonce} {path}] {INSTRUCTIONS}"  # nothing of another path's is cached
    turns: list[AgentTurn] = []
    before = await summed_counters(engines) if engines else {}
    demoted = await demotions(target, path)
    started, begun = time.perf_counter(), trio.current_time()
    done = 0

    async def one(agent: Agent) -> None:
        nonlocal done
        await _rollout(path, target, agent, instructions, started, turns.append)
        done += 1
        mine = [t for t in turns if t.rollout == agent.index]
        cached = sum(t.cached_tokens for t in mine) / max(1, sum(t.input_tokens for t in mine))
        progress(f"{path}: rollout {agent.index} done ({done}/{len(agents)}) at "
                 f"{time.perf_counter() - started:.1f} s, cached share {cached:.0%}")  # fmt: skip

    async def agent_of(mine: Sequence[Agent]) -> None:
        for agent in mine:  # one after another, none before its time
            await trio.sleep_until(begun + agent.at_s)
            await one(agent)

    by_agent: dict[int, list[Agent]] = {}
    for agent in agents:
        by_agent.setdefault(agent.agent, []).append(agent)
    failed = None
    try:
        async with trio.open_nursery() as nursery:
            for mine in by_agent.values():
                nursery.start_soon(agent_of, mine)
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
    return PathRun(path, tuple(ordered), makespan, counted, failed, demoted, done)
