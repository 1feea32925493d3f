"""One rollout on vLLM: each segment sends the whole prompt, streams what the engine decodes.

The session is where the protocol (protocol.py) and the grammar (grammar.py) meet the
rollout's conversation: it turns the segment's constraint (constraint_plan.py) into the
request's structured output, sends the request, turns the engine's stream into `Chunk`s
through the family's parser, and records what the engine should have found cached against
what it says it found.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import httpx
import orjson
import trio

from proto_server.core.conversation import Conversation
from proto_server.engine.chunks import Chunk, Prefilled, SegmentEnd, hand_over
from proto_server.engine.constraint_plan import (
    ForcedCall,
    StrictCalls,
    StructuredAnswer,
    plan_constraint,
)
from proto_server.engine.families import parser_for
from proto_server.engine.families.base import ToolSyntax, at_limit
from proto_server.engine.limits import ENGINE_UNAVAILABLE, GenerationLimits
from proto_server.engine.logprobs import TokenPieces, Trail
from proto_server.engine.model_renderer import ModelRenderer
from proto_server.engine.thinking import split_thinking
from proto_server.engine.tokens import common_prefix
from proto_server.engine.vllm.grammar import (
    answer_format,
    forced_call_format,
    forced_call_head,
    strict_call_format,
)
from proto_server.engine.vllm.protocol import (
    ENGINE_ERROR,
    ERROR_BODY_BYTES,
    STREAM_HEADERS,
    EngineError,
    EngineUsage,
    Piece,
    ServedModel,
    completion_request,
    error_for_exception,
    error_for_status,
    parse_sse,
    sse_lines,
)
from proto_server.wire.tools import function_tools

log = logging.getLogger("proto_server.engine.vllm")  # the server's structured log lines


class Engine(Protocol):
    """What a session reads of the generator that opened it (generator.py's `VllmGenerator`),
    named here so that the session needs nothing of the module that makes sessions."""

    url: str
    model: ServedModel
    tokenizer: Any
    syntax: ToolSyntax
    renderer: ModelRenderer
    max_tokens: int
    stop_ids: frozenset[int]
    #: What the engine writes for each stop id.
    stop_texts: dict[int, str]
    #: The model's tokens as logprobs list them.
    pieces: TokenPieces

    @property
    def name(self) -> str: ...

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client every session of the generator shares."""
        ...


class VllmSession:
    """One rollout on the engine: nothing is held there but what its prefix cache keeps."""

    def __init__(
        self, generator: Engine, conversation: Conversation, *, cache_salt: str | None
    ) -> None:
        self._generator = generator
        self._conversation = conversation
        self._cache_salt = cache_salt
        self._tools = function_tools(conversation.tools)
        #: The token ids the engine has seen last: the prompt it was sent and what it made.
        self.engine_ids: list[int] = []
        #: Per segment: (prompt tokens, what should be cached, what the engine said it had).
        self.segments: list[tuple[int, int, int | None]] = []

    async def prefill(self) -> Prefilled:
        """Bring the engine's cache up to the conversation (one token decoded and dropped)."""
        generator = self._generator
        prompt = list(self._conversation.tokens)
        body = completion_request(
            model=generator.name,
            prompt=prompt,
            max_tokens=1,
            limits=GenerationLimits(temperature=0.0),
            stop_token_ids=(),
            stream=False,
            cache_salt=self._cache_salt,
        )
        try:
            answer = await generator.client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, generator.url) from exc
        if answer.status_code != 200:
            raise error_for_status(answer.status_code, answer.content[:ERROR_BODY_BYTES])
        usage = answer.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self._record(prompt, prompt, int(cached))
        return Prefilled(prompt_tokens=len(prompt), cached_tokens=int(cached))

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        generator = self._generator
        prompt = self._conversation.turn_prompt(generator.renderer.generation_prompt)
        names = [tool.name for tool in self._tools]
        syntax = generator.syntax
        frame = syntax.frame
        head, structure = "", None
        match plan_constraint(limits, self._tools, guided=True):
            case ForcedCall(tools, max_calls):  # its block opens in the prompt
                head = forced_call_head(tools, frame)
                structure = forced_call_format(tools, max_calls, frame)
            case StructuredAnswer(form, tools, max_calls):
                structure = answer_format(form, tools, max_calls, frame)
                head = syntax.answer_prompt(limits, self._tools)  # the answer's header
            case StrictCalls(tools, max_calls):
                structure = strict_call_format(tools, max_calls, frame)
        if head:  # in the prompt, not decoded
            prompt += generator.tokenizer.encode(head, add_special_tokens=False)
        most = generator.max_tokens
        if limits.max_output_tokens is not None:
            most = min(most, limits.max_output_tokens)
        context = generator.model.max_model_len
        if context is not None and len(prompt) < context:
            most = min(most, context - len(prompt))  # longer: the engine refuses it, and says so
        renderer = generator.renderer
        parser = split_thinking(  # a model that thinks, unconstrained, writes `<think>` first
            parser_for(syntax, names, max_calls=limits.max_calls, forced=structure is not None),
            thinks=renderer.thinks and structure is None,
            opened=renderer.opens_thinking,
            tags=renderer.think_tags,
        )
        prompt_ids = tuple(prompt) if limits.token_ids else None
        if most <= 0:
            await send.send(Prefilled(len(prompt), 0, prompt_ids))
            await send.send(SegmentEnd(incomplete="max_output_tokens"))
            return
        body = completion_request(
            model=generator.name,
            prompt=prompt,
            max_tokens=most,
            limits=limits,
            stop_token_ids=generator.stop_ids,
            stop=syntax.stop(limits.max_calls) if names and limits.max_calls != 0 else (),
            structure=structure,
            cache_salt=self._cache_salt,
        )
        trail = Trail(ids=limits.token_ids)
        generated: list[int] = []
        finish: str | None = None
        usage: EngineUsage | None = None
        chunks: list[Chunk] = parser.feed(head, 0) if head else []
        prefilled = False
        try:
            async with generator.client.stream(
                "POST", "/completions", content=orjson.dumps(body), headers=STREAM_HEADERS
            ) as answer:
                if answer.status_code != 200:
                    raw = b""
                    async for part in answer.aiter_bytes():
                        raw += part
                        if len(raw) >= ERROR_BODY_BYTES:
                            break
                    raise error_for_status(answer.status_code, raw)
                async for line in sse_lines(answer.aiter_raw()):
                    event = parse_sse(line)
                    if isinstance(event, EngineUsage):
                        usage = event
                    elif isinstance(event, Piece):
                        if not prefilled:  # the engine has the prompt: the first piece came
                            prefilled = True
                            await hand_over(send, Prefilled(len(prompt), 0, prompt_ids))
                        generated.extend(event.token_ids)
                        finish = event.finish_reason or finish
                        text = event.text
                        if event.token_ids and event.token_ids[-1] in generator.stop_ids:
                            text = text.removesuffix(generator.stop_texts[event.token_ids[-1]])
                        if limits.engine_logprobs is not None:
                            self._sampled(trail, event, limits.top_logprobs)
                        fed = trail.attach(parser.feed(text, len(event.token_ids)))
                        for chunk in [*chunks, *fed]:
                            await hand_over(send, chunk)
                        chunks = []
        except httpx.HTTPError as exc:
            error = error_for_exception(exc, generator.url)
            error.unsent = not prefilled  # nothing handed over: another replica may take it
            raise error from exc
        if finish is None or finish == "abort" or not prefilled:
            raise EngineError(
                ENGINE_UNAVAILABLE if finish is None else ENGINE_ERROR,
                f"the engine's stream ended before the segment did (finish reason {finish!r})",
                unsent=not prefilled,
            )
        held, leftover = parser.finish()
        if finish == "length" and generated and generated[-1] in generator.stop_ids:
            finish = "stop"  # the turn's end was the last token the limit allowed
        if finish == "length":
            held = at_limit(held, parser)
        for chunk in trail.attach(held):
            await send.send(chunk)
        cached = usage.cached_tokens if usage is not None else None
        self._record(prompt, [*prompt, *generated], cached)
        await send.send(
            SegmentEnd(
                tokens=leftover,
                # calls end the turn: what came after them, to the limit, is not said; a
                # call the limit cut short is no call made
                incomplete="max_output_tokens"
                if finish == "length" and (parser.cut or not parser.called)
                else None,
                cached_tokens=cached,
                sampled=trail.rest(),
            )
        )

    def _sampled(self, trail: Trail, piece: Piece, top: int | None) -> None:
        """`piece`'s tokens into `trail`: each one's id and logprob, and, where `top` asks,
        its API entry with its `top` likeliest (none for a stop token: it has no text);
        refused if the engine did not say them (it was asked)."""
        if len(piece.logprobs) != len(piece.token_ids):
            raise EngineError(
                ENGINE_ERROR,
                f"the engine said {len(piece.logprobs)} logprobs for {len(piece.token_ids)} "
                "tokens; it was asked for every token's",
            )
        pieces = self._generator.pieces
        last = len(piece.token_ids) - 1
        ended = last >= 0 and piece.token_ids[last] in self._generator.stop_ids
        for at, (token, (logprob, likeliest)) in enumerate(
            zip(piece.token_ids, piece.logprobs, strict=True)
        ):
            # the end of the turn, the segment's last token: no text, no API entry
            said = top is not None and not (ended and at == last)
            entry = pieces.logprob(token, logprob, likeliest[:top]) if said else None
            trail.add(token, logprob, entry)

    def _record(self, prompt: list[int], seen: list[int], cached: int | None) -> None:
        expected = common_prefix(self.engine_ids, prompt)
        self.segments.append((len(prompt), expected, cached))
        log.debug(
            "vllm.segment",
            extra={"prompt_tokens": len(prompt), "expected_cached": expected, "cached": cached},
        )
        self.engine_ids = seen

    async def aclose(self) -> None:
        """Nothing to free: the engine's prefix cache evicts what no one uses."""
