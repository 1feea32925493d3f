"""The simulated GPU's timing model, on trio's MockClock (virtual seconds, no real waiting)."""

from __future__ import annotations

import math

import pytest
import trio

from proto_server.core.tokenizer import o200k_base
from proto_server.engine.chunks import Prefilled, TextDelta, ToolCallEnd
from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.wire.items import FunctionCall, FunctionCallOutput

from ..support.generators import conversation, run_segment

PREFILL = 10_000.0
DECODE = 1_000.0


def thousand_token_text() -> str:
    text = " ok" * 1000
    assert len(o200k_base().encode_ordinary(text)) == 1000  # the premise of these tests
    return text


async def test_a_thousand_tokens_at_a_thousand_per_second_take_one_second_after_prefill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = parse_script({"segments": [{"text": thousand_token_text()}]})
    conv = conversation()
    session = SimulatedGenerator(script, TimingModel(prefill_tokens_per_s=PREFILL)).open_session(
        conv
    )
    start = trio.current_time()
    timeline = await run_segment(session)

    prefill = conv.token_count / PREFILL
    first_at, first = timeline[0]
    assert first == Prefilled(prompt_tokens=conv.token_count, cached_tokens=0)
    assert first_at - start == pytest.approx(prefill)
    texts = [(t, c) for t, c in timeline if isinstance(c, TextDelta)]
    assert sum(c.tokens for _, c in texts) == 1000
    # a token is released at the end of the engine step it completes in
    assert texts[0][0] == pytest.approx(step_end(start + prefill + 1 / DECODE))
    assert texts[-1][0] == pytest.approx(step_end(start + prefill + 1.0))


def step_end(at: float) -> float:
    """The end of the `1 / DECODE`-long step that time `at` falls in (steps from time 0 on)."""
    return math.ceil(at * DECODE - 1e-6) / DECODE


async def test_streams_that_began_apart_release_their_tokens_on_the_same_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As an engine's step gives every running sequence its next token at once, two streams
    started a third of a step apart wake together: one wake-up a step, not one a stream."""
    script = parse_script({"segments": [{"text": " ok" * 50}]})
    generator = SimulatedGenerator(script, TimingModel(prefill_tokens_per_s=1e9))
    timelines: list[list[float]] = []

    async def stream(after: float) -> None:
        await trio.sleep(after)
        timeline = await run_segment(generator.open_session(conversation()))
        timelines.append([at for at, chunk in timeline if isinstance(chunk, TextDelta)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, 0.0)
        nursery.start_soon(stream, 1 / DECODE / 3)
    first, second = timelines
    assert len(first) == len(second) == 50
    assert all(at == pytest.approx(step_end(at)) for at in first + second)  # on the grid
    assert set(first) & set(second)  # the steps they share, they share to the instant


async def test_a_resumed_segment_prefills_only_what_was_appended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = parse_script(
        {
            "segments": [
                {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat log"}}]},
                {"text": "ok"},
            ]
        }
    )
    conv = conversation()
    session = SimulatedGenerator(script, TimingModel(prefill_tokens_per_s=PREFILL)).open_session(
        conv
    )
    first = await run_segment(session)
    assert any(isinstance(c, ToolCallEnd) for _, c in first)
    # what the Response machine does with that segment, then what the client appends
    conv.extend(
        [FunctionCall(call_id="call_1", name="exec_command", arguments='{"cmd":"cat log"}')]
    )
    warm = conv.token_count
    appended = conv.extend([FunctionCallOutput(call_id="call_1", output="line\n" * 2000)])
    assert appended > 2000

    start = trio.current_time()
    second = await run_segment(session)
    at, prefilled = second[0]
    assert prefilled == Prefilled(prompt_tokens=warm + appended, cached_tokens=warm)
    assert at - start == pytest.approx(appended / PREFILL)


async def test_bursts_decode_their_share_of_tokens_faster(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = parse_script({"segments": [{"text": thousand_token_text()}]})
    timing = TimingModel(prefill_tokens_per_s=1e12, burst_tokens_per_s=4000.0, burst_share=0.5)
    session = SimulatedGenerator(script, timing).open_session(conversation())
    start = trio.current_time()
    timeline = await run_segment(session)
    # 500 tokens at 1,000/s and 500 at 4,000/s
    assert timeline[-1][0] - start == pytest.approx(0.5 + 0.125, abs=1e-6)


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        TimingModel(decode_tokens_per_s=0)
