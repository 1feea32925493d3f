"""The simulated GPU: says what a `Planner` decides, paced by a timing model (modelled time).

Prefill costs the *uncached* prompt tokens at `prefill_tokens_per_s`; then each token is decoded
at `decode_tokens_per_s`, or at `burst_tokens_per_s` for the burst share of each 100 tokens. A
session keeps its "KV cache" warm across suspensions: a resumed segment prefills only what the
conversation gained since the model last spoke. With a `PrefixCache`, a cold session is also
spared the prefill of any prefix some session of the same generator has already seen.

A `GpuMeter`, when given, is told every modelled second, so reports can keep modelled GPU time
apart from measured server time.
"""

from __future__ import annotations

import codecs
import functools
import math
import time
from collections.abc import Iterator
from typing import Protocol

import attrs
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.ranges import between, positive
from proto_server.core.render import Renderer
from proto_server.core.settings import setting
from proto_server.core.tokenizer import o200k_base
from proto_server.core.trace import Sampled
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    ReasoningDelta,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
    hand_over,
)
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.logprobs import TokenPieces
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.script import Planner, Segment
from proto_server.wire.items import Logprob

BURST_WINDOW = 100


@attrs.frozen(kw_only=True)
class TimingModel:
    prefill_tokens_per_s: float = setting(
        20_000.0,
        positive,
        flag="--prefill-rate",
        metavar="TOKENS_PER_S",
        help="modelled prefill speed for uncached prompt tokens",
    )
    decode_tokens_per_s: float = setting(
        1_000.0,
        positive,
        flag="--decode-rate",
        metavar="TOKENS_PER_S",
        help="modelled decode speed of the simulated GPU",
    )
    burst_tokens_per_s: float | None = setting(
        None,
        positive,
        flag="--burst-rate",
        metavar="TOKENS_PER_S",
        help="modelled decode speed during bursts (e.g. 4000); off by default",
    )
    burst_share: float = setting(
        0.5,
        between(0, 1),
        metavar="FRACTION",
        help="share of tokens decoded at the burst rate",
    )

    @property
    def step_seconds(self) -> float:
        """One engine step: each running sequence decodes one token in it, at the fastest rate."""
        return 1.0 / max(self.decode_tokens_per_s, self.burst_tokens_per_s or 0.0)

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def decode_seconds(self, token_index: int) -> float:
        """How long the model spends on the `token_index`-th token of a segment."""
        burst = self.burst_tokens_per_s
        if burst is not None and token_index % BURST_WINDOW < self.burst_share * BURST_WINDOW:
            return 1.0 / burst
        return 1.0 / self.decode_tokens_per_s

    def segment_seconds(self, *, uncached_tokens: int, output_tokens: int) -> float:
        """The modelled GPU time of one segment: prefill what is not cached, then decode."""
        decode = sum(self.decode_seconds(index) for index in range(output_tokens))
        return self.prefill_seconds(uncached_tokens) + decode


class GpuMeter(Protocol):
    """Told what the simulated GPU modelled (and what its bookkeeping cost), as it happens."""

    def prefilled(self, tokens: int, seconds: float) -> None:
        """`tokens` uncached prompt tokens were prefilled, modelled to take `seconds`."""

    def decoded(self, tokens: int, seconds: float, at: float) -> None:
        """`tokens`, modelled to take `seconds` to decode, were released at trio time `at`."""

    def bookkeeping(self, seconds: float) -> None:
        """Measured seconds of CPU the simulation spent on its prefix cache: not server work."""


class _Pacer:
    """Releases tokens on the decode schedule; never drifts, never sleeps when behind.

    As an engine's step gives one token to every running sequence at once, a token is released
    at the end of the step it completes in: steps are `TimingModel.step_seconds` long on one
    grid (trio time 0 on), so every stream of a generator wakes on the same steps, together."""

    def __init__(self, timing: TimingModel) -> None:
        self._timing = timing
        self._step = timing.step_seconds
        self.deadline = trio.current_time()
        self._index = 0

    async def tokens(self, count: int) -> float:
        """Wait until `count` more tokens are decoded; return their modelled seconds."""
        seconds = 0.0
        for _ in range(count):
            seconds += self._timing.decode_seconds(self._index)
            self._index += 1
        self.deadline += seconds
        # the end of the step the last of them completes in (a hair of slack for rounding)
        release = math.ceil(self.deadline / self._step - 1e-6) * self._step
        if release > trio.current_time():  # behind schedule: no need to wait at all
            await trio.sleep_until(release)
        return seconds


@functools.lru_cache(maxsize=32)
def _pieces(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`text` as it decodes token by token: (delta, its token ids); a split character waits.

    Remembered for the last texts said: a script says the same texts again and again, and
    decoding them is the simulated GPU's work, which would otherwise be counted, token by
    token, as the server process's (about 1 us a token)."""
    encoding = o200k_base()
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = []
    waiting: list[int] = []
    for token in encoding.encode_ordinary(text):
        waiting.append(token)
        piece = decoder.decode(encoding.decode_single_token_bytes(token))
        if piece:
            pieces.append((piece, tuple(waiting)))
            waiting = []
    return tuple(pieces)


def _o200k_bytes(token: int) -> bytes:
    return o200k_base().decode_single_token_bytes(token)


#: The simulated model's tokens as the API lists them (its tokenizer is o200k_base).
_TOKEN_PIECES = TokenPieces(_o200k_bytes)


def modelled_logprob(token: int, top: int) -> Logprob:
    """A modelled logprob of `token`, which the simulated model (greedy) sampled as its
    likeliest: a probability from 0.5 to 0.99 fixed by the token's id, and below it `top - 1`
    other tokens sharing what is left, each half the one before. No real distribution: a
    stand-in of the right shape, the same for the same token every time."""
    chosen = _chosen(token)
    others = [(1000 * k + token % 1000, (1 - chosen) / 2**k) for k in range(1, top)]
    ranked = [(token, math.log(chosen)), *((other, math.log(p)) for other, p in others)]
    return _TOKEN_PIECES.logprob(token, math.log(chosen), ranked[:top])


def _chosen(token: int) -> float:
    """The modelled probability of `token` where the simulated model samples it."""
    return 0.5 + 0.49 * ((token * 2654435761) % 1000) / 1000


def modelled_sampled(ids: tuple[int, ...]) -> Sampled:
    """`ids` with their modelled logprobs (`modelled_logprob`'s)."""
    return Sampled(ids, tuple(math.log(_chosen(token)) for token in ids))


def _chunks(segment: Segment, limits: GenerationLimits) -> Iterator[tuple[Chunk, int]]:
    """What the model decodes to say `segment`, chunk by chunk, with the tokens each costs;
    its text with modelled logprobs when `top_logprobs` asks for them, and each chunk with its
    modelled ids (o200k_base's of its text; a call's syntax is modelled as its name's tokens,
    and no end of turn is) where `token_ids` asks for them."""
    top, traced = limits.top_logprobs, limits.token_ids
    for piece, ids in _pieces(segment.reasoning):
        yield ReasoningDelta(piece, len(ids), modelled_sampled(ids) if traced else None), len(ids)
    for piece, ids in _pieces(segment.text):
        logprobs = () if top is None else tuple(modelled_logprob(token, top) for token in ids)
        sampled = modelled_sampled(ids) if traced else None
        yield TextDelta(piece, len(ids), logprobs, sampled), len(ids)
    for call in segment.tool_calls:
        name_ids = tuple(o200k_base().encode_ordinary(call.name))
        yield (
            ToolCallBegin(call.name, len(name_ids), modelled_sampled(name_ids) if traced else None),
            len(name_ids),
        )
        for piece, ids in _pieces(call.arguments):
            sampled = modelled_sampled(ids) if traced else None
            yield ToolCallArgumentsDelta(piece, len(ids), sampled), len(ids)
        yield ToolCallEnd(), 0


class Freeze:
    """The simulated GPU paused with `keep` (a weight update): no session says a token more
    until it thaws, as vLLM's scheduler holds its running requests."""

    def __init__(self) -> None:
        self._thawed: trio.Event | None = None  # made in the run that freezes it

    @property
    def frozen(self) -> bool:
        return self._thawed is not None

    def freeze(self) -> None:
        if self._thawed is None:
            self._thawed = trio.Event()

    def thaw(self) -> None:
        if self._thawed is not None:
            self._thawed.set()
            self._thawed = None

    async def wait(self) -> bool:
        """Until thawed; True if it had to wait."""
        thawed = self._thawed
        if thawed is None:
            return False
        await thawed.wait()
        return True


class SimulatedSession:
    def __init__(
        self,
        conversation: Conversation,
        planner: Planner,
        timing: TimingModel,
        *,
        prefix_cache: PrefixCache | None = None,
        meter: GpuMeter | None = None,
        cache_salt: str | None = None,
        freeze: Freeze | None = None,
    ) -> None:
        self._freeze = freeze
        self._conversation = conversation
        self._planner = planner
        self._timing = timing
        self._prefix_cache = prefix_cache
        self._hashes = prefix_cache.hashes(cache_salt) if prefix_cache is not None else None
        self._shared = 0  # blocks of this session already in the prefix cache
        self._meter = meter
        self._prefilled_upto = 0
        self._has_spoken = False
        self.closed = False

    def _cached(self) -> int:
        """Tokens of the conversation already in the (simulated) KV cache."""
        conversation = self._conversation
        spoken = conversation.model_output_end if self._has_spoken else 0
        return min(max(self._prefilled_upto, spoken), conversation.token_count)

    def _consult_cache(self, warm: int) -> int:
        """Tokens of the prompt's prefix already held, by this session (`warm`) or by the prefix
        cache; then this session's new full blocks go into the cache.

        With a prefix cache, this session's own state lives in it too: it is warm only while
        its blocks are still cached (every one looked up, so each is fresh in the LRU), and
        from the first one let go (while it waited on a tool) it is prefilled again."""
        cache, hashes = self._prefix_cache, self._hashes
        if cache is None or hashes is None:
            return warm
        started = time.perf_counter()
        names = hashes.update(self._conversation.tokens)
        found = cache.cached_blocks(names)
        self._offer(cache, names, started, found)
        if found >= warm // cache.block_tokens:  # none of its own let go: its partial tail too
            return max(warm, found * cache.block_tokens)
        return found * cache.block_tokens

    def _offer(
        self, cache: PrefixCache, names: list[int], started: float, cached: int | None = None
    ) -> None:
        """Cache this session's blocks past `cached` (default: past those it offered before)."""
        cache.insert(names, self._shared if cached is None else cached)
        self._shared = len(names)
        if self._meter is not None:
            self._meter.bookkeeping(time.perf_counter() - started)

    async def prefill(self) -> Prefilled:
        # a step of its own: the cache's bookkeeping for a prompt of millions of tokens takes
        # tens of milliseconds, and so may the planner's before it
        await trio.lowlevel.checkpoint()
        prompt = self._conversation.token_count
        cached = min(self._consult_cache(self._cached()), prompt)
        seconds = self._timing.prefill_seconds(prompt - cached)
        if self._meter is not None:
            self._meter.prefilled(prompt - cached, seconds)
        await trio.sleep(seconds)
        self._prefilled_upto = prompt
        return Prefilled(prompt_tokens=prompt, cached_tokens=cached)

    async def _decode(self, pacer: _Pacer, tokens: int) -> None:
        seconds = await pacer.tokens(tokens)
        if self._meter is not None:
            self._meter.decoded(tokens, seconds, trio.current_time())

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        """Say the planned segment; cut short, `incomplete`, where it would decode more than
        `limits.max_output_tokens` (a chunk that would cross the limit is not said)."""
        segment = self._planner.plan(self._conversation, limits)
        prefilled = await self.prefill()
        # running: its blocks are in use, and no other sequence's insert lets them go
        cache, hashes = self._prefix_cache, self._hashes
        running = cache.pin(list(hashes.hashes)) if cache is not None and hashes is not None else []
        try:
            if limits.token_ids:
                prompt_ids = tuple(self._conversation.tokens)
                prefilled = attrs.evolve(prefilled, prompt_ids=prompt_ids)
            await send.send(prefilled)
            self._has_spoken = True
            pacer = _Pacer(self._timing)
            budget = math.inf if limits.max_output_tokens is None else limits.max_output_tokens
            for chunk, tokens in _chunks(segment, limits):
                if tokens > budget:
                    await send.send(SegmentEnd(incomplete="max_output_tokens"))
                    return
                budget -= tokens
                if self._freeze is not None and await self._freeze.wait():
                    pacer = _Pacer(self._timing)  # the time frozen was not decoding
                if tokens:
                    await self._decode(pacer, tokens)
                await hand_over(send, chunk)
            await send.send(SegmentEnd())
        finally:
            if cache is not None:
                cache.unpin(running)

    async def aclose(self) -> None:
        cache, hashes = self._prefix_cache, self._hashes
        if not self.closed and cache is not None and hashes is not None:
            # what the model said is cached too, for whoever continues this conversation
            started = time.perf_counter()
            self._offer(cache, hashes.update(self._conversation.tokens), started)
        self.closed = True


@attrs.frozen
class SimulatedGenerator:
    planner: Planner
    timing: TimingModel = TimingModel()
    #: Shared by every session of this generator, like one GPU's KV cache; None: no sharing.
    prefix_cache: PrefixCache | None = None
    meter: GpuMeter | None = None
    renderer: Renderer | None = None
    #: Paused with `keep`: every session stops before its next token (`pause_engine`).
    freeze: Freeze = attrs.field(factory=Freeze, eq=False, repr=False)

    @property
    def forces_tool_calls(self) -> bool:
        """A script or the default model says whatever the request demands (or says why not)."""
        return True

    #: Its text comes with modelled logprobs when they are asked for (`modelled_logprob`).
    says_logprobs = True

    def open_session(
        self,
        conversation: Conversation,
        *,
        cache_salt: str | None = None,
        affinity: str | None = None,
    ) -> SimulatedSession:
        """One GPU: `affinity` has nothing to choose between."""
        return SimulatedSession(
            conversation,
            self.planner,
            self.timing,
            prefix_cache=self.prefix_cache,
            meter=self.meter,
            cache_salt=cache_salt,
            freeze=self.freeze,
        )

    async def pause_engine(self, mode: str) -> None:
        """`keep` freezes every session before its next token; `wait` has nothing to hold
        (the server lets no segment start)."""
        if mode == "keep":
            self.freeze.freeze()

    async def resume_engine(self) -> None:
        self.freeze.thaw()
