"""The vLLM `TokenGenerator`: one served model, one bounded HTTP client every rollout shares.

It owns what outlives a rollout: the model family's syntax and renderer (from the served
model's own tokenizer), the stop ids, the client, and the engine's readiness for `/readyz`;
each rollout opens a `VllmSession` (session.py) on it.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine.families import AUTO, choose
from proto_server.engine.logprobs import TokenPieces, tokenizer_bytes
from proto_server.engine.model_files import LoadedTokenizer
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES
from proto_server.engine.renderers import renderer_for
from proto_server.engine.vllm.protocol import (
    ENGINE_ERROR,
    ERROR_BODY_BYTES,
    PROBE_TIMEOUT_S,
    EngineError,
    EngineSetupError,
    ServedModel,
    error_for_exception,
    error_for_status,
    parse_models,
)
from proto_server.engine.vllm.session import VllmSession


class VllmGenerator:
    """A model served by vLLM; every rollout's session shares one bounded HTTP client."""

    #: A forced call is constrained by the engine's structured outputs.
    forces_tool_calls = True
    #: The engine says each sampled token's logprob and the likeliest others (`logprobs`).
    says_logprobs = True

    def __init__(
        self,
        url: str,
        model: ServedModel,
        tokenizer: LoadedTokenizer,
        *,
        max_tokens: int = 512,
        connections: int = 64,
        timeout_s: float = 60.0,
        render_cache_bytes: int = RENDER_CACHE_BYTES,
        tool_syntax: str = AUTO,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer.tokenizer
        #: The model family's call syntax (`--tool-syntax`; families/).
        self.syntax = choose(self.tokenizer, tool_syntax)
        self.renderer = renderer_for(self.syntax, self.tokenizer, cache_bytes=render_cache_bytes)
        self.stop_ids = self.syntax.stop_ids(self.tokenizer, tokenizer.eos_token_id)
        #: What the engine writes for each: the end of the model's turn is no text of its own.
        self.stop_texts = {i: self.tokenizer.decode([i]) for i in self.stop_ids}
        self.pieces = TokenPieces(tokenizer_bytes(self.tokenizer))
        self.max_tokens = max_tokens
        self.connections = connections
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client, made on first use inside the running event loop."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                limits=httpx.Limits(
                    max_connections=self.connections, max_keepalive_connections=self.connections
                ),
                timeout=httpx.Timeout(self.timeout_s, connect=PROBE_TIMEOUT_S),
            )
        return self._client

    def check_text_format(self, form: TextFormat) -> None:
        """Refuse a schema llguidance cannot compile, which vLLM (whose backends are llguidance
        and xgrammar) cannot either. Without llguidance installed the engine is the judge: its
        refusal fails the Response."""
        try:
            from proto_server.engine.schema_grammar import check_text_format
        except ImportError:
            return
        check_text_format(form)

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> VllmSession:
        """One engine: `affinity` has nothing to choose between (`ReplicatedGenerator` does)."""
        return VllmSession(self, conversation, cache_salt=cache_salt)

    async def readiness(self) -> str | None:
        """None when the engine lists the served model within a short timeout; else why not."""
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                answer = await self.client.get("/models", timeout=PROBE_TIMEOUT_S)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            return f"the engine at {self.url} does not answer ({exc.__class__.__name__})"
        if answer.status_code != 200:
            return f"the engine at {self.url} answered {answer.status_code}"
        try:
            served = [model.name for model in parse_models(answer.json())]
        except (ValueError, EngineSetupError):
            return f"the engine at {self.url} does not list its models"
        if self.model.name not in served:  # restarted with another model
            return f"the engine at {self.url} serves {served}, not {self.model.name!r}"
        return None

    async def engine_models(self) -> list[dict[str, Any]] | None:
        """The engine's `/v1/models` entries, as it lists them (within a short timeout)."""
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                answer = await self.client.get("/models", timeout=PROBE_TIMEOUT_S)
            body = answer.json()
        except (httpx.HTTPError, trio.TooSlowError, ValueError):
            return None
        data = body.get("data") if answer.status_code == 200 and isinstance(body, dict) else None
        if not isinstance(data, list):
            return None
        return [entry for entry in data if isinstance(entry, dict) and "id" in entry]

    async def pause_engine(self, mode: str) -> None:
        """vLLM's `POST /pause?mode=...` (served at the engine's root, not under `/v1`, when
        it runs with VLLM_SERVER_DEV_MODE=1); `wait` returns once its requests have ended."""
        await self._admin("/pause", {"mode": mode})

    async def resume_engine(self) -> None:
        await self._admin("/resume", {})

    async def _admin(self, path: str, params: dict[str, str]) -> None:
        """One of vLLM's RL endpoints; EngineError saying what to run if it refuses."""
        url = self.url.removesuffix("/v1") + path
        try:
            answer = await self.client.post(url, params=params)
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, url) from exc
        if answer.status_code == 404:
            raise EngineError(
                ENGINE_ERROR,
                f"the engine at {self.url} serves no {path}: start vLLM with "
                "VLLM_SERVER_DEV_MODE=1 for its pause and resume endpoints",
            )
        if answer.status_code != 200:
            raise error_for_status(answer.status_code, answer.content[:ERROR_BODY_BYTES])

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
