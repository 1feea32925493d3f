"""The simulated GPU: says what a `Planner` decides, paced by a timing model (modelled time).

Prefill costs the *uncached* prompt tokens at `prefill_tokens_per_s`; then each token is decoded
at `decode_tokens_per_s`, or at `burst_tokens_per_s` for the burst share of each 100 tokens. A
session keeps its "KV cache" warm across suspensions: a resumed segment prefills only what the
conversation gained since the model last spoke.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator

import attrs
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.tokenizer import o200k_base
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.script import Planner

BURST_WINDOW = 100


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class TimingModel:
    prefill_tokens_per_s: float = attrs.field(default=20_000.0, validator=_positive)
    decode_tokens_per_s: float = attrs.field(default=1_000.0, validator=_positive)
    burst_tokens_per_s: float | None = None
    burst_share: float = attrs.field(
        default=0.5,
        validator=attrs.validators.and_(attrs.validators.ge(0.0), attrs.validators.le(1.0)),
    )

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


class _Pacer:
    """Releases tokens on the decode schedule; never drifts, never sleeps when behind."""

    def __init__(self, timing: TimingModel) -> None:
        self._timing = timing
        self._deadline = trio.current_time()
        self._index = 0

    async def tokens(self, count: int) -> None:
        for _ in range(count):
            self._deadline += self._timing.decode_seconds(self._index)
            self._index += 1
        await trio.sleep_until(self._deadline)


def _pieces(text: str) -> Iterator[tuple[str, int]]:
    """`text` as it decodes token by token: (delta, tokens); a split character waits."""
    encoding = o200k_base()
    decoder = codecs.getincrementaldecoder("utf-8")()
    waiting = 0
    for token in encoding.encode_ordinary(text):
        waiting += 1
        piece = decoder.decode(encoding.decode_single_token_bytes(token))
        if piece:
            yield piece, waiting
            waiting = 0


class SimulatedSession:
    def __init__(self, conversation: Conversation, planner: Planner, timing: TimingModel) -> None:
        self._conversation = conversation
        self._planner = planner
        self._timing = timing
        self._prefilled_upto = 0
        self._has_spoken = False
        self.closed = False

    def _cached(self) -> int:
        """Tokens of the conversation already in the (simulated) KV cache."""
        conversation = self._conversation
        spoken = conversation.model_output_end if self._has_spoken else 0
        return min(max(self._prefilled_upto, spoken), conversation.token_count)

    async def prefill(self) -> Prefilled:
        prompt = self._conversation.token_count
        cached = self._cached()
        await trio.sleep(self._timing.prefill_seconds(prompt - cached))
        self._prefilled_upto = prompt
        return Prefilled(prompt_tokens=prompt, cached_tokens=cached)

    async def generate(self, send: trio.MemorySendChannel[Chunk]) -> None:
        segment = self._planner.plan(self._conversation)
        await send.send(await self.prefill())
        self._has_spoken = True
        pacer = _Pacer(self._timing)
        for piece, tokens in _pieces(segment.text):
            await pacer.tokens(tokens)
            await send.send(TextDelta(piece, tokens))
        for call in segment.tool_calls:
            name_tokens = len(o200k_base().encode_ordinary(call.name))
            await pacer.tokens(name_tokens)
            await send.send(ToolCallBegin(call.name, name_tokens))
            for piece, tokens in _pieces(call.arguments):
                await pacer.tokens(tokens)
                await send.send(ToolCallArgumentsDelta(piece, tokens))
            await send.send(ToolCallEnd())
        await send.send(SegmentEnd())

    async def aclose(self) -> None:
        self.closed = True


@attrs.frozen
class SimulatedGenerator:
    planner: Planner
    timing: TimingModel = TimingModel()

    def open_session(self, conversation: Conversation) -> SimulatedSession:
        return SimulatedSession(conversation, self.planner, self.timing)
