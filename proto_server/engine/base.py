"""The interface every generator backend implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import trio

from proto_server.core.conversation import Conversation
from proto_server.core.render import Renderer
from proto_server.core.text_format import TextFormat
from proto_server.engine.chunks import Chunk, Prefilled
from proto_server.engine.limits import GenerationLimits


class GeneratorSession(Protocol):
    """One rollout's warm model state.

    `generate` prefills whatever the conversation gained since the last segment, decodes one
    segment into `send` within `limits` (what the request allows), and returns; the state stays
    warm until `aclose`. A request it cannot serve raises `GenerationRefused`.
    """

    async def generate(
        self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits
    ) -> None: ...

    async def prefill(self) -> Prefilled:
        """Bring the model state up to the conversation without decoding (a warm-up)."""
        ...

    async def aclose(self) -> None: ...


class TokenGenerator(Protocol):
    @property
    def renderer(self) -> Renderer | None:
        """How prompts become this model's tokens; None: the server's default (o200k_base)."""

    @property
    def forces_tool_calls(self) -> bool:
        """Whether its sessions can make a call when the request demands one (`tool_choice`
        required or a named function); if not, such a request is refused when it arrives."""

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> GeneratorSession:
        """A session on `conversation`. Sessions of different `cache_salt`s (one per tenant)
        share no cached prefix: a shared cache would tell one tenant what another sent (by
        `cached_tokens`, and by time to first token). None: shared with every unsalted one.
        `affinity`: the client's rollout id; sessions of one tenant that share it go where the
        last one went, when there is a choice (several replicas)."""
        ...


@runtime_checkable
class ProbedGenerator(Protocol):
    """A generator that depends on something outside the process (an engine), which may be
    down while the server is up: `/readyz` asks it."""

    async def readiness(self) -> str | None:
        """None when it can serve now; otherwise why not."""
        ...


@runtime_checkable
class SupervisedGenerator(Protocol):
    """A generator with a task of its own (probing its engine replicas): the server starts it
    before it listens and cancels it once it has stopped."""

    async def supervise(self, *, task_status: trio.TaskStatus[None]) -> None: ...


@runtime_checkable
class SharedGenerator(Protocol):
    """A generator over engine replicas, some of which may be down: admission counts only the
    KV capacity of those that answer, as often as the replicas are probed."""

    probe_interval_s: float

    def up_share(self) -> float:
        """The share of the whole capacity that is up now (0 to 1)."""
        ...


@runtime_checkable
class GrammarGenerator(Protocol):
    """A generator that decodes a structured answer (`text.format`) under a grammar, which
    cannot take every schema: the server asks it when the request arrives, before any event."""

    def check_text_format(self, form: TextFormat) -> None:
        """Raise `ProtocolError` (400, `param` the path in the schema) for a schema its grammar
        cannot take."""
        ...


@runtime_checkable
class LogprobGenerator(Protocol):
    """A generator that can say each sampled token's logprob and the likeliest tokens at its
    position (`GenerationLimits.top_logprobs`); a request for logprobs from any other is
    refused when it arrives."""

    @property
    def says_logprobs(self) -> bool: ...


def says_logprobs(generator: object) -> bool:
    return isinstance(generator, LogprobGenerator) and generator.says_logprobs


@runtime_checkable
class ListedGenerator(Protocol):
    """A generator whose engine lists models of its own (vLLM's `/v1/models`): `GET /v1/models`
    lists those, as the engine describes them."""

    async def engine_models(self) -> list[dict[str, Any]] | None:
        """The engine's model objects as it lists them now; None if it does not answer."""
        ...


@runtime_checkable
class PausableGenerator(Protocol):
    """A generator whose engine can be paused for a weight update (vLLM's `/pause` and
    `/resume`, on every replica; the simulated GPU's freeze): `mode` is `wait` (called once
    no segment of this server runs: the engine holds what others send it) or `keep` (what
    runs is frozen where it is, and goes on after `resume_engine`)."""

    async def pause_engine(self, mode: str) -> None:
        """Pause; raises `GeneratorError` if the engine refuses or does not answer."""
        ...

    async def resume_engine(self) -> None: ...
