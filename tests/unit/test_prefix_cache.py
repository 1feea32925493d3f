"""The simulated GPU's prefix cache: block hashing, LRU, and what a cold session is charged."""

from __future__ import annotations

from array import array

import pytest
import trio

from proto_server.core.conversation import Conversation
from proto_server.engine.chunks import Prefilled
from proto_server.engine.prefix_cache import BlockHashes, PrefixCache
from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message

from ..support.generators import conversation, run_segment

PREFILL = 10_000.0
SCRIPT = parse_script(
    {
        "segments": [
            {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat log"}}]},
            {"text": "done"},
        ]
    }
)


def tokens(*values: int) -> array[int]:
    return array("I", values)


def test_block_names_chain_over_the_whole_prefix() -> None:
    a = BlockHashes(2).update(tokens(1, 2, 3, 4, 5))
    assert len(a) == 2  # the partial last block is not named
    assert BlockHashes(2).update(tokens(1, 2, 3, 4)) == a
    b = BlockHashes(2).update(tokens(9, 2, 3, 4))
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix: no match


def test_hashes_extend_incrementally_as_the_sequence_grows() -> None:
    grown = array("I", [1, 2, 3])
    hashes = BlockHashes(2)
    assert len(hashes.update(grown)) == 1
    grown.extend([4, 5, 6])
    assert hashes.update(grown) == BlockHashes(2).update(tokens(1, 2, 3, 4, 5, 6))


def test_lookup_stops_at_the_first_miss_and_eviction_is_least_recently_used() -> None:
    cache = PrefixCache(block_tokens=2, capacity_tokens=6)  # three blocks
    names = BlockHashes(2).update(tokens(1, 2, 3, 4, 5, 6, 7, 8))
    cache.insert(names[:3])
    assert cache.cached_blocks(names) == 3
    assert cache.cached_blocks(names, start=1) == 3
    cache.cached_blocks(names[:1])  # block 0 used recently; block 1 is now the oldest
    cache.insert(names[3:])  # a fourth block evicts block 1
    assert len(cache) == 3
    assert cache.cached_blocks(names) == 1
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=0)


class Recorder:
    """A `GpuMeter` that keeps what it is told."""

    def __init__(self) -> None:
        self.prefills: list[tuple[int, float]] = []
        self.decode_s = 0.0
        self.bookkeeping_s = 0.0

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.prefills.append((tokens, seconds))

    def decoded(self, tokens: int, seconds: float, at: float) -> None:
        self.decode_s += seconds

    def bookkeeping(self, seconds: float) -> None:
        self.bookkeeping_s += seconds


def long_conversation() -> Conversation:
    conv = conversation()
    conv.extend([Message(role="user", content="context " * 600)])
    return conv


async def test_a_cold_session_pays_prefill_only_past_what_another_session_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = PrefixCache(block_tokens=16)
    meter = Recorder()
    generator = SimulatedGenerator(
        SCRIPT, TimingModel(prefill_tokens_per_s=PREFILL), prefix_cache=cache, meter=meter
    )
    first = long_conversation()
    await run_segment(generator.open_session(first))
    assert meter.prefills[0][0] == first.token_count  # nothing was cached yet

    # a stateless client resends the same history, plus the tool output: a new session
    second = long_conversation()
    second.extend([FunctionCallOutput(call_id="call_1", output="line\n" * 300)])
    start = trio.current_time()
    timeline = await run_segment(generator.open_session(second))
    at, prefilled = timeline[0]
    shared = first.token_count // 16 * 16  # whole blocks only
    assert prefilled == Prefilled(prompt_tokens=second.token_count, cached_tokens=shared)
    assert at - start == pytest.approx((second.token_count - shared) / PREFILL)
    assert meter.prefills[1] == (second.token_count - shared, pytest.approx(at - start))
    assert meter.decode_s > 0 and meter.bookkeeping_s > 0


async def test_what_the_model_said_is_cached_when_its_session_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = PrefixCache(block_tokens=4)
    generator = SimulatedGenerator(SCRIPT, prefix_cache=cache)
    conv = long_conversation()
    session = generator.open_session(conv)
    await run_segment(session)
    before = len(cache)
    # the Response machine adds the call the model made; closing the session offers it
    conv.extend(
        [FunctionCall(call_id="call_1", name="exec_command", arguments='{"cmd":"cat log"}')]
    )
    await session.aclose()
    assert len(cache) == conv.token_count // 4 > before


async def test_without_a_prefix_cache_every_cold_session_prefills_everything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    generator = SimulatedGenerator(SCRIPT, TimingModel(prefill_tokens_per_s=PREFILL))
    for _ in range(2):
        conv = long_conversation()
        _, prefilled = (await run_segment(generator.open_session(conv)))[0]
        assert prefilled == Prefilled(prompt_tokens=conv.token_count, cached_tokens=0)


def test_blocks_in_use_are_never_let_go_and_come_back_freshest() -> None:
    cache = PrefixCache(block_tokens=2, capacity_tokens=6)  # three blocks
    names = BlockHashes(2).update(tokens(*range(1, 13)))  # six blocks
    cache.insert(names[:2])
    running = cache.pin(names[:1])  # a sequence runs on block 0
    cache.insert(names[2:5])  # three more: the free ones go, block 0 stays
    assert cache.cached_blocks(names) == 1 and len(cache) == 3
    cache.unpin(running)  # stopped: block 0 is free again, and the freshest
    cache.insert(names[5:])  # block 5 lets block 3 go, the oldest free one, not block 0
    assert cache.cached_blocks(names[:1]) == 1
    assert cache.evicted == 3  # blocks 1, 2 and 3


def conversation_of(word: str) -> Conversation:
    conv = conversation()
    conv.extend([Message(role="user", content=f"{word} " * 400)])
    return conv


async def test_a_rollout_waiting_on_a_tool_loses_its_warm_state_to_others_and_prefills_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's cache holds about one rollout: while the first waits on its tool, a second
    runs and takes the cache, so the first's resumed segment prefills from the start; with
    room for both, it prefills only what was appended."""

    async def resumed_prefill(capacity_tokens: int) -> Prefilled:
        cache = PrefixCache(block_tokens=16, capacity_tokens=capacity_tokens)
        generator = SimulatedGenerator(SCRIPT, prefix_cache=cache)
        waiting = conversation_of("alpha")
        session = generator.open_session(waiting)
        await run_segment(session)  # it calls a tool, and waits
        waiting.extend(
            [
                FunctionCall(call_id="call_1", name="exec_command", arguments="{}"),
                FunctionCallOutput(call_id="call_1", output="ok"),
            ]
        )
        other = generator.open_session(conversation_of("omega"))
        await run_segment(other)  # another rollout runs meanwhile
        await other.aclose()
        _, prefilled = (await run_segment(session))[0]
        assert isinstance(prefilled, Prefilled)
        return prefilled

    roomy = await resumed_prefill(capacity_tokens=100_000)
    tight = await resumed_prefill(capacity_tokens=512)
    assert roomy.prompt_tokens == tight.prompt_tokens
    assert roomy.cached_tokens > roomy.prompt_tokens - 64  # only what was appended
    alpha, omega = conversation_of("alpha").tokens, conversation_of("omega").tokens
    common = next(i for i, (a, b) in enumerate(zip(alpha, omega, strict=False)) if a != b)
    # let go while it waited: prefilled again, but for the instructions both rollouts share
    assert tight.cached_tokens == common // 16 * 16 < 100
