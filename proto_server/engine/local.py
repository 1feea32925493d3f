"""The local model: a transformers causal LM whose KV cache stays warm for a whole rollout.

One `LocalSession` per rollout holds the model's KV cache and the token ids it covers. Each
segment prefills only what the conversation gained since the cache was last extended: the
longest common prefix of the cache's tokens and the newly rendered prompt is kept, the rest is
prefilled. When the chat template renders the model's output exactly as the model wrote it
(plain text, a single call in its own syntax) that is everything up to the appended items;
where it differs, the differing tail is prefilled again, so the output always equals a cold
re-prefill of the whole history. Decoding is greedy (deterministic), token by token; a complete
tool call or an end-of-turn token ends the segment and the cache stays warm until `aclose`.
A call the request forces (`tool_choice` required or a named function), the arguments of a
`strict` tool, and a structured answer (`text.format`) are decoded under a grammar
(constraints.py, from the segment's plan in constraint_plan.py) that masks each step's logits.

The blocking torch work runs off the trio thread, one forward pass (a decode step or a prefill
chunk) per call, so a cancellation waits at most one step; a `CapacityLimiter` of one lets
sessions of different rollouts take turns on the one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine import families
from proto_server.engine.chunks import Chunk, Prefilled, SegmentEnd
from proto_server.engine.constraint_plan import (
    ForcedCall,
    StrictCalls,
    StructuredAnswer,
    Unconstrained,
    plan_constraint,
)
from proto_server.engine.constraints import Constraint, Guide
from proto_server.engine.families.base import ToolSyntax, at_limit
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.engine.logprobs import TokenPieces, Trail, tokenizer_bytes
from proto_server.engine.model_files import load_model
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES
from proto_server.engine.renderers import renderer_for
from proto_server.engine.schema_grammar import check_text_format
from proto_server.engine.thinking import split_thinking
from proto_server.engine.tokens import common_prefix
from proto_server.wire.errors import ProtocolError
from proto_server.wire.tools import function_tools

if TYPE_CHECKING:
    from transformers import DynamicCache

T = TypeVar("T")

#: Picks the next token from the logits of the last position, given the segment's tokens so far.
Chooser = Callable[[torch.Tensor, Sequence[int]], int]


def greedy(logits: torch.Tensor, generated: Sequence[int]) -> int:
    return int(logits.argmax())


def scored(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The logprob of `token` under `logits` (as the model chose from them: a grammar's mask
    applied, as vLLM's are), and the `top` likeliest tokens with theirs, likeliest first."""
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0])
    return float(logprobs[token]), list(zip(map(int, ids.tolist()), values.tolist(), strict=True))


class ContextOverflow(GenerationRefused):
    """The conversation no longer fits the model's context window: the Response fails with
    `context_length_exceeded`, as OpenAI's and vLLM's do, and the connection lives."""

    def __init__(self, message: str) -> None:
        super().__init__("context_length_exceeded", message)


def stop_token_ids(model: Any, tokenizer: Any, syntax: ToolSyntax) -> frozenset[int]:
    config = getattr(model, "generation_config", None)
    return syntax.stop_ids(tokenizer, getattr(config, "eos_token_id", None))


class LocalGenerator:
    """A loaded model shared by every rollout; each rollout gets a session with its own cache."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "local",
        max_tokens: int = 512,
        prefill_chunk: int = 512,
        threads: int | None = None,
        device: str | None = None,
        choose: Chooser = greedy,
        render_cache_bytes: int = RENDER_CACHE_BYTES,
        tool_syntax: str = families.AUTO,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens = max_tokens
        self.prefill_chunk = prefill_chunk
        self.choose = choose
        #: The model family's call syntax (`--tool-syntax`; families/).
        self.syntax = families.choose(tokenizer, tool_syntax)
        self.renderer = renderer_for(self.syntax, tokenizer, cache_bytes=render_cache_bytes)
        self.stop_ids = stop_token_ids(model, tokenizer, self.syntax)
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.guide = Guide(tokenizer, vocab_size=vocab_size, stop_ids=self.stop_ids)
        self.limiter = trio.CapacityLimiter(1)
        #: Sessions holding a KV cache right now (tests check that every exit path frees it).
        self.live_caches = 0
        self._pieces: TokenPieces | None = None

    #: Each sampled token's logprob is computed from its step's logits when asked.
    says_logprobs = True

    @property
    def pieces(self) -> TokenPieces:
        """Its tokens as logprobs list them (made on first use)."""
        if self._pieces is None:
            self._pieces = TokenPieces(tokenizer_bytes(self.tokenizer))
        return self._pieces

    @property
    def forces_tool_calls(self) -> bool:
        """A forced call is decoded under a grammar of the model's call syntax (constraints.py),
        which needs a fast tokenizer."""
        return self.guide.available

    def check_text_format(self, form: TextFormat) -> None:
        """A structured answer is decoded under a grammar of its schema, which needs a fast
        tokenizer and a schema llguidance compiles."""
        if not self.guide.available:
            raise ProtocolError(
                "unsupported_text_format",
                f"`text.format` {form.kind!r} needs a grammar, and {self.name}'s tokenizer is "
                'not a fast (Rust) one; send `text.format` {"type": "text"}, or serve a model '
                "with a tokenizer.json.",
                param="text.format",
            )
        check_text_format(form)

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    @classmethod
    def load(
        cls, spec: str | None, *, cache_dir: Path | None = None, **options: Any
    ) -> LocalGenerator:
        """Load `spec` (a model directory or GGUF file; None: SmolLM2) and serve it."""
        loaded = load_model(spec, cache_dir=cache_dir)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, **options)

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> LocalSession:
        """`cache_salt` changes nothing: a session's KV cache is its own, shared with none;
        nor does `affinity` (one model, in this process)."""
        return LocalSession(self, conversation)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking model work on a worker thread, one piece at a time across all sessions."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)


class _Detokenizer:
    """Token ids to text as it becomes printable: a split UTF-8 character waits for its end."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def add(self, token: int) -> str:
        self._ids.append(token)
        text: str = self._tokenizer.decode(
            self._ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if text.endswith("\ufffd"):
            return ""
        piece, self._text = text[len(self._text) :], text
        return piece


class LocalSession:
    def __init__(self, generator: LocalGenerator, conversation: Conversation) -> None:
        self._generator = generator
        self._conversation = conversation
        self._tools = function_tools(conversation.tools)
        self._tool_names = [tool.name for tool in self._tools]
        self._cache: DynamicCache | None = None
        self._ids: list[int] = []  # the tokens whose keys and values the cache holds

    @property
    def cached_tokens(self) -> int:
        return len(self._ids)

    @property
    def holds_cache(self) -> bool:
        return self._cache is not None

    async def prefill(self) -> Prefilled:
        """Bring the cache up to the conversation without decoding (a `generate: false` turn)."""
        prompt = list(self._conversation.tokens)
        keep, _ = await self._extend(prompt)
        return Prefilled(prompt_tokens=len(prompt), cached_tokens=keep)

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        """Decode at most `limits.max_output_tokens` (and `--max-tokens`); `tool_choice: none`
        or no calls left: the parser is offered no tools, so whatever the model writes is text.
        A call the request forces is decoded under a grammar from the first token."""
        generator = self._generator
        constraint = await self._constraint(limits)
        prompt = self._conversation.turn_prompt(generator.renderer.generation_prompt)
        head = generator.syntax.answer_prompt(limits, self._tools)  # in the prompt, not decoded
        if head:
            prompt += generator.tokenizer.encode(head, add_special_tokens=False)
        keep, logits = await self._extend(prompt)
        await send.send(Prefilled(len(prompt), keep, tuple(prompt) if limits.token_ids else None))
        await self._decode(logits, send, limits, constraint, head)

    async def _constraint(self, limits: GenerationLimits) -> Constraint | None:
        """The segment's plan (constraint_plan.py) as an llguidance grammar; None: no grammar."""
        guide = self._generator.guide
        frame = self._generator.syntax.frame
        match plan_constraint(limits, self._tools, guided=guide.available):
            case ForcedCall(tools, max_calls):
                build = partial(guide.constrain, tools, max_calls=max_calls, frame=frame)
            case StructuredAnswer(form, tools, max_calls):
                build = partial(
                    guide.constrain, tools, max_calls=max_calls, answer=form, frame=frame
                )
            case StrictCalls(tools, max_calls):
                build = partial(guide.constrain, tools, max_calls=max_calls, lazy=True, frame=frame)
            case Unconstrained():
                return None
        return await self._generator.run(build)

    async def _extend(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        """Keep the cache's longest prefix of `prompt`, prefill the rest (at least one token,
        for the logits of the last); return how many tokens were kept, and those logits."""
        generator = self._generator
        if generator.context and len(prompt) >= generator.context:
            raise ContextOverflow(
                f"the conversation is {len(prompt)} tokens and {generator.name} reads at most "
                f"{generator.context}; start a new Response with a shorter history"
            )
        keep = self._rewind(min(common_prefix(self._ids, prompt), max(len(prompt) - 1, 0)))
        logits = torch.empty(0)
        for start in range(keep, len(prompt), generator.prefill_chunk):
            logits = await generator.run(
                self._forward, prompt[start : start + generator.prefill_chunk]
            )
        return keep, logits

    async def _decode(
        self,
        logits: torch.Tensor,
        send: trio.MemorySendChannel[Chunk],
        limits: GenerationLimits,
        constraint: Constraint | None,
        head: str,
    ) -> None:
        generator = self._generator
        # under a grammar every block is a valid call: it streams as it decodes; without one
        # a model that thinks writes its `<think>` block first
        renderer = generator.renderer
        parser = split_thinking(
            families.parser_for(
                generator.syntax,
                self._tool_names,
                max_calls=limits.max_calls,
                forced=constraint is not None,
            ),
            thinks=renderer.thinks and constraint is None,
            opened=renderer.opens_thinking,
            tags=renderer.think_tags,
        )
        text = _Detokenizer(generator.tokenizer)
        top = limits.top_logprobs
        trail = Trail(ids=limits.token_ids)
        generated: list[int] = []
        stop_tokens = 0
        incomplete = None
        most = generator.max_tokens
        if limits.max_output_tokens is not None:
            most = min(most, limits.max_output_tokens)
        for chunk in parser.feed(head, 0) if head else ():  # the header the prompt ends with
            await send.send(chunk)
        if constraint is not None and most > 0:
            logits = await generator.run(constraint.mask, logits)
        while True:
            if len(generated) >= most:
                incomplete = "max_output_tokens"
                break
            token = generator.choose(logits, generated)
            if constraint is not None:
                constraint.consume(token)
            generated.append(token)
            ended = token in generator.stop_ids  # the end of the turn: no text, no API entry
            if limits.engine_logprobs is not None:
                logprob, likeliest = await generator.run(
                    scored, logits, token, 0 if ended else limits.engine_logprobs
                )
                said = top is not None and not ended
                entry = generator.pieces.logprob(token, logprob, likeliest) if said else None
                trail.add(token, logprob, entry)
            if ended:
                stop_tokens = 1
                break
            for chunk in trail.attach(parser.feed(text.add(token))):
                await send.send(chunk)
            if parser.called:
                break
            logits = await generator.run(self._step, token, constraint)
        chunks, leftover = parser.finish()
        if incomplete is not None:
            chunks = at_limit(chunks, parser)
            if parser.called and not parser.cut:  # whole arguments, the frame left open
                incomplete = None
        for chunk in trail.attach(chunks):
            await send.send(chunk)
        await send.send(
            SegmentEnd(tokens=leftover + stop_tokens, incomplete=incomplete, sampled=trail.rest())
        )

    def _rewind(self, keep: int) -> int:
        """Drop the cache past its first `keep` tokens; return how many it still holds."""
        if self._cache is None:
            from transformers import DynamicCache

            self._cache = DynamicCache()
            self._generator.live_caches += 1
        extra = len(self._ids) - keep
        if extra > 0:
            try:
                self._cache.crop(-extra)
            except RuntimeError:  # a sliding-window cache cannot rewind: start it over
                from transformers import DynamicCache

                self._cache = DynamicCache()
                keep = 0
            del self._ids[keep:]
        return keep

    def _step(self, token: int, constraint: Constraint | None) -> torch.Tensor:
        """One decode step (a worker thread): the next logits, masked by the grammar if any."""
        logits = self._forward([token])
        return logits if constraint is None else constraint.mask(logits)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` through the model on top of the cache (a worker thread); last logits."""
        generator = self._generator
        with torch.inference_mode():
            out = generator.model(
                input_ids=torch.tensor([ids], device=generator.device),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._ids.extend(ids)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    async def aclose(self) -> None:
        """Release the KV cache (completion, cancellation, disconnect, failure, eviction)."""
        if self._cache is not None:
            self._cache = None
            self._ids = []
            self._generator.live_caches -= 1
