"""What a generator session produces, in order, for one segment.

A segment is `Prefilled`, then any mix of reasoning, text and complete tool calls, then
`SegmentEnd`;
before `Prefilled`, a `Rerouted` when the rollout's engine replica went down and another
prefills it again. The sampling loop turns each chunk into calls on the Response state machine.
"""

from __future__ import annotations

import attrs
import trio

from proto_server.core.trace import Sampled
from proto_server.wire.items import Logprob


@attrs.frozen
class Rerouted:
    """The engine replica that held the rollout's prefix (`lost`) went down: this segment is
    prefilled again, whole, on `engine`. The turn's source says so ("failover")."""

    engine: str
    lost: str


@attrs.frozen
class Prefilled:
    """The prompt is in the model's state; `cached_tokens` of it were already warm."""

    prompt_tokens: int
    cached_tokens: int
    #: The ids of the whole prompt the engine was sent (cached part included), when the
    #: segment's limits ask for them (`GenerationLimits.token_ids`).
    prompt_ids: tuple[int, ...] | None = None


@attrs.frozen
class TextDelta:
    text: str
    tokens: int = 1
    #: The logprobs of the tokens it carries, when the segment's limits ask for them
    #: (`GenerationLimits.top_logprobs`); attached by `logprobs.Trail`.
    logprobs: tuple[Logprob, ...] = ()
    sampled: Sampled | None = None


@attrs.frozen
class ReasoningDelta:
    """What the model thinks before it answers (a `<think>` block, harmony's analysis
    channel): a `reasoning` item's text, counted as reasoning tokens."""

    text: str
    tokens: int = 1
    sampled: Sampled | None = None


@attrs.frozen
class ToolCallBegin:
    name: str
    tokens: int = 0
    sampled: Sampled | None = None


@attrs.frozen
class ToolCallArgumentsDelta:
    delta: str
    tokens: int = 1
    sampled: Sampled | None = None


@attrs.frozen
class ToolCallEnd:
    pass


@attrs.frozen
class SegmentEnd:
    """The model stopped. `tokens` it decoded that no other chunk carried (its stop token);
    `incomplete` names why the Response cannot go on (e.g. `max_output_tokens`);
    `cached_tokens`, if set, replaces `Prefilled`'s count: an engine reports it at the end;
    `sampled`: the ids of its `tokens`, where the limits ask for them."""

    tokens: int = 0
    incomplete: str | None = None
    cached_tokens: int | None = None
    sampled: Sampled | None = None


Chunk = (
    Rerouted
    | Prefilled
    | ReasoningDelta
    | TextDelta
    | ToolCallBegin
    | ToolCallArgumentsDelta
    | ToolCallEnd
    | SegmentEnd
)


async def hand_over(send: trio.MemorySendChannel[Chunk], chunk: Chunk) -> None:
    """Put `chunk` in the sampling loop's channel, waiting only when it is full: a generator
    that is ahead hands over all it has in one scheduling round, and the sampling loop takes
    them all in its next (`send.send` would yield to the scheduler once a chunk)."""
    try:
        send.send_nowait(chunk)
    except trio.WouldBlock:
        await send.send(chunk)
