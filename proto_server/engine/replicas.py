"""Several replicas of one model: a rollout stays where its prefix is cached, and moves when
its replica goes down.

`--engine-url` given more than once makes one `ReplicatedGenerator` over a generator per
engine. Where each segment goes is `core/routing.Router`'s decision (affinity while the
replica is up, else the least loaded); this module does what it says: opens the rollout's
session on that replica, and when the replica turns out to be gone (`engine_unavailable`)
takes it out, and sends the segment again, whole, to another one if nothing of it had been
handed over yet. A segment cut in the middle fails its Response as with one engine (what the
client already got cannot be taken back); the rollout's next segment goes elsewhere. A
rollout moved off a replica it was warm on is prefilled again and its turn says so
(`Rerouted`, the turn's source "failover").

`supervise` probes every replica every `probe_interval_s` (the engine's own readiness: it lists
the served model) and gives a replica that answers again new work at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.render import Renderer
from proto_server.core.routing import NoReplicaUp, Router
from proto_server.core.text_format import TextFormat
from proto_server.engine.base import (
    GeneratorSession,
    GrammarGenerator,
    ListedGenerator,
    PausableGenerator,
    ProbedGenerator,
    TokenGenerator,
    says_logprobs,
)
from proto_server.engine.chunks import Chunk, Prefilled, Rerouted, hand_over
from proto_server.engine.limits import ENGINE_UNAVAILABLE, GenerationLimits, GeneratorError

log = logging.getLogger("proto_server.engine.replicas")
#: How often `supervise` asks every replica whether it answers (`--engine-probe-interval`).
PROBE_INTERVAL_S = 2.0


@attrs.frozen
class Replica:
    """One engine replica: what it is called in logs, metrics and `/readyz` (its URL), and the
    generator that talks to it."""

    name: str
    generator: TokenGenerator


@attrs.frozen
class ReplicaState:
    """A replica as the server last saw it: up or not (and why not), the rollouts placed on
    it and the tokens they hold."""

    name: str
    up: bool
    rollouts: int
    tokens: int
    problem: str | None = None


class ReplicaObserver(Protocol):
    """Who counts what the replicas do (the server's metrics)."""

    def replica_changed(self, state: ReplicaState) -> None: ...

    def rollout_moved(self, lost: str, engine: str) -> None: ...


class ReplicatedGenerator:
    """One model over `replicas` (the same model on each; checked at start-up by whoever
    builds it). `capacities`: each replica's KV cache in tokens, so that load is a share of it;
    `down`: the replicas that did not answer at start-up."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        capacities: Sequence[int] | None = None,
        down: Sequence[int] = (),
        probe_interval_s: float = PROBE_INTERVAL_S,
        observer: ReplicaObserver | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a replicated generator needs at least one replica")
        self.replicas = tuple(replicas)
        self.router = Router(len(replicas), capacities=capacities)
        self.probe_interval_s = probe_interval_s
        self._observer = observer
        self._problems: list[str | None] = [None] * len(replicas)
        for index in range(len(replicas)):
            if index in down:
                self._mark_down(index, "it did not answer at start-up")
            else:
                self.report(index)

    # -- what the server asks of any generator ---------------------------------------------------

    @property
    def renderer(self) -> Renderer | None:
        return self.replicas[0].generator.renderer

    @property
    def forces_tool_calls(self) -> bool:
        return all(replica.generator.forces_tool_calls for replica in self.replicas)

    @property
    def says_logprobs(self) -> bool:
        return all(says_logprobs(replica.generator) for replica in self.replicas)

    def check_text_format(self, form: TextFormat) -> None:
        """A schema is checked as any replica would check it (the same model on each)."""
        for replica in self.replicas:
            if isinstance(replica.generator, GrammarGenerator):
                replica.generator.check_text_format(form)

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> ReplicatedSession:
        return ReplicatedSession(self, conversation, cache_salt=cache_salt, affinity=affinity)

    async def engine_models(self) -> list[dict[str, Any]] | None:
        """The models the first replica that answers lists (each serves the same model)."""
        for replica in self.replicas:
            if isinstance(replica.generator, ListedGenerator):
                models = await replica.generator.engine_models()
                if models is not None:
                    return models
        return None

    def up_share(self) -> float:
        return self.router.up_share()

    async def readiness(self) -> str | None:
        """None while at least one replica answers (asked now); else why none does."""
        await self.probe()
        if any(self.router.is_up(i) for i in range(len(self.replicas))):
            return None
        return "no engine replica answers: " + "; ".join(
            f"{replica.name}: {problem}"
            for replica, problem in zip(self.replicas, self._problems, strict=True)
        )

    def states(self) -> list[ReplicaState]:
        return [self._state(index) for index in range(len(self.replicas))]

    async def pause_engine(self, mode: str) -> None:
        """Every replica paused at once (one that is down too: it must not serve old weights
        when it comes back); the first refusal is raised once all have answered."""
        await self._every(lambda engine: engine.pause_engine(mode))

    async def resume_engine(self) -> None:
        await self._every(lambda engine: engine.resume_engine())

    async def _every(self, call: Callable[[PausableGenerator], Awaitable[None]]) -> None:
        failed: list[GeneratorError] = []

        async def one(engine: PausableGenerator) -> None:
            try:
                await call(engine)
            except GeneratorError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                if isinstance(replica.generator, PausableGenerator):
                    nursery.start_soon(one, replica.generator)
        if failed:
            raise failed[0]

    async def aclose(self) -> None:
        for replica in self.replicas:
            close = getattr(replica.generator, "aclose", None)
            if close is not None:
                await close()

    # -- probing ---------------------------------------------------------------------------------

    async def supervise(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Probe every replica every `probe_interval_s`, until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.probe_interval_s)
            await self.probe()

    async def probe(self) -> None:
        """Ask every replica at once whether it answers; mark each up or down by its answer."""

        async def ask(index: int, generator: ProbedGenerator) -> None:
            problem = await generator.readiness()
            if problem is None:
                self._mark_up(index)
            else:
                self._mark_down(index, problem)

        async with trio.open_nursery() as nursery:
            for index, replica in enumerate(self.replicas):
                if isinstance(replica.generator, ProbedGenerator):
                    nursery.start_soon(ask, index, replica.generator)

    # -- what sessions and probes tell it --------------------------------------------------------

    def lost(self, index: int, problem: str) -> None:
        """A segment found replica `index` gone."""
        self._mark_down(index, problem)

    def moved(self, lost: int, engine: int) -> None:
        log.warning(
            "engine.failover",
            extra={"lost": self.replicas[lost].name, "engine": self.replicas[engine].name},
        )
        if self._observer is not None:
            self._observer.rollout_moved(self.replicas[lost].name, self.replicas[engine].name)

    def _mark_down(self, index: int, problem: str) -> None:
        was_up = self.router.is_up(index)
        self.router.down(index)
        self._problems[index] = problem
        if was_up:
            log.warning("engine.down", extra={"engine": self.replicas[index].name, "why": problem})
        self.report(index)

    def _mark_up(self, index: int) -> None:
        if self.router.is_up(index):
            return
        self.router.up(index)
        self._problems[index] = None
        log.warning("engine.up", extra={"engine": self.replicas[index].name})
        self.report(index)

    def report(self, index: int) -> None:
        """Tell the observer how replica `index` stands now."""
        if self._observer is not None:
            self._observer.replica_changed(self._state(index))

    def _state(self, index: int) -> ReplicaState:
        router = self.router
        return ReplicaState(
            self.replicas[index].name,
            router.is_up(index),
            router.rollouts[index],
            router.tokens[index],
            self._problems[index],
        )


def affinity_key(cache_salt: str | None, rollout_id: str) -> int:
    """What the router remembers a tenant's rollout id by: 8 bytes of its digest, whatever
    the id's length (the router keeps 65,536 of them; two that collide share a replica)."""
    # keyed by the tenant's salt (43 characters; at most 64 bytes is a BLAKE2b key)
    key = (cache_salt or "").encode()[:64]
    digest = hashlib.blake2b(rollout_id.encode(), digest_size=8, key=key)
    return int.from_bytes(digest.digest(), "big")


class ReplicatedSession:
    """A rollout's session on whichever replica the router says, opened again on another when
    it moves (the new one's cache holds nothing of it)."""

    def __init__(
        self,
        generator: ReplicatedGenerator,
        conversation: Conversation,
        *,
        cache_salt: str | None,
        affinity: str | None = None,
    ) -> None:
        self._generator = generator
        self._conversation = conversation
        self._cache_salt = cache_salt
        #: The client's rollout id, per tenant: its sessions follow one another's replica.
        self._affinity = None if affinity is None else affinity_key(cache_salt, affinity)
        self._session: GeneratorSession | None = None
        self._replica: int | None = None
        #: The replica that holds this rollout's prefix: a segment there completed.
        self._warm_on: int | None = None

    @property
    def replica(self) -> int | None:
        """Where its last segment went (None before the first)."""
        return self._replica

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        """One segment on the rollout's replica; on another if that one is gone before anything
        was handed over (each replica tried once at most)."""
        for _ in self._generator.replicas:
            session, index, lost = await self._place()
            if lost is not None:  # before its Prefilled: the turn is a failover
                await hand_over(send, Rerouted(self._name(index), self._name(lost)))
            try:
                await session.generate(send, limits)
            except GeneratorError as exc:
                if exc.code != ENGINE_UNAVAILABLE:
                    raise
                self._generator.lost(index, str(exc))
                if not exc.unsent:
                    raise  # the client has part of it: this Response fails, the next moves
                continue
            self._warm_on = index
            return
        raise GeneratorError(
            ENGINE_UNAVAILABLE, "every engine replica failed this segment; see /readyz"
        )

    async def prefill(self) -> Prefilled:
        for _ in self._generator.replicas:
            session, index, _ = await self._place()
            try:
                prefilled = await session.prefill()
            except GeneratorError as exc:
                if exc.code != ENGINE_UNAVAILABLE:
                    raise
                self._generator.lost(index, str(exc))
                continue
            self._warm_on = index
            return prefilled
        raise GeneratorError(
            ENGINE_UNAVAILABLE, "every engine replica failed this prefill; see /readyz"
        )

    async def aclose(self) -> None:
        self._generator.router.release(self)
        if self._replica is not None:
            self._generator.report(self._replica)
        session, self._session = self._session, None
        if session is not None:
            await session.aclose()

    def _name(self, index: int) -> str:
        return self._generator.replicas[index].name

    async def _place(self) -> tuple[GeneratorSession, int, int | None]:
        """The session on the replica the router places this segment on (opened there if the
        rollout is new to it), and the replica whose cached prefix it lost, if it did."""
        generator = self._generator
        try:
            placement = generator.router.place(
                self, self._conversation.token_count, affinity=self._affinity
            )
        except NoReplicaUp as exc:
            raise GeneratorError(ENGINE_UNAVAILABLE, f"{exc}; see /readyz") from exc
        index, lost = placement.replica, None
        if placement.moved_from is not None and placement.moved_from == self._warm_on:
            lost, self._warm_on = self._warm_on, None
            generator.moved(lost, index)
        if self._session is None or index != self._replica or placement.moved_from is not None:
            previous, self._session = self._session, None
            if previous is not None:
                await previous.aclose()
            self._session = generator.replicas[index].generator.open_session(
                self._conversation, cache_salt=self._cache_salt
            )
            if self._replica is not None and self._replica != index:
                generator.report(self._replica)
            self._replica = index
        generator.report(index)
        return self._session, index, lost
