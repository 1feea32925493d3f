"""Warm against cold prefill on a real model, turn by turn (measured wall-clock time).

An agent loop is simulated on the local generator: each turn the model answers (greedy, a few
tokens), then a tool output of a fixed size is appended. The warm path is the rollout's own
session, which keeps its KV cache and prefills only what the turn added. The cold path is what a
stateless turn costs: a fresh session that prefills the whole history. Both then decode the
same answer, which the table checks.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import trio

from proto_server.compose import load_local
from proto_server.core.conversation import Conversation
from proto_server.core.ranges import at_least
from proto_server.core.settings import setting
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.local import LocalGenerator, LocalSession
from proto_server.launch import LocalModel
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Item, Message, OutputText
from proto_server.wire.tools import FunctionTool

INSTRUCTIONS = "You are a coding agent. Read the tool outputs and fix the failing test."
TOOLS = (
    FunctionTool(
        name="exec_command",
        description="Run a shell command and return its output.",
        parameters={
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    ),
)


@attrs.frozen
class Turn:
    turn: int
    prompt_tokens: int
    warm_prefilled: int
    warm_seconds: float
    cold_prefilled: int
    cold_seconds: float
    same_output: bool

    @property
    def speedup(self) -> float:
        return self.cold_seconds / self.warm_seconds


@attrs.frozen
class Segment:
    prefill: Prefilled
    prefill_seconds: float
    chunks: tuple[Chunk, ...]


async def timed_segment(session: LocalSession) -> Segment:
    """One segment; the prefill time is from the call until the prompt is in the cache."""
    send, receive = trio.open_memory_channel[Chunk](10_000)
    chunks: list[Chunk] = []
    started = time.perf_counter()
    prefilled_at = started
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_generate, session, send)
        async with receive:
            async for chunk in receive:
                if isinstance(chunk, Prefilled):
                    prefilled_at = time.perf_counter()
                chunks.append(chunk)
    prefill = chunks[0]
    assert isinstance(prefill, Prefilled)
    return Segment(prefill, prefilled_at - started, tuple(chunks[1:]))


async def _generate(session: LocalSession, send: trio.MemorySendChannel[Chunk]) -> None:
    async with send:
        await session.generate(send, GenerationLimits())


def said(chunks: Sequence[Chunk]) -> list[Item]:
    """What the model's answer adds to the conversation: its text, then its calls."""
    items: list[Item] = []
    text = ""
    call = ["", ""]
    for chunk in chunks:
        match chunk:
            case TextDelta(text=delta):
                text += delta
            case ToolCallBegin(name=name):
                call = [name, ""]
            case ToolCallArgumentsDelta(delta=delta):
                call[1] += delta
            case ToolCallEnd():
                items.append(
                    FunctionCall(call_id=f"call_{len(items)}", name=call[0], arguments=call[1])
                )
    if text:
        items.insert(0, Message(role="assistant", content=(OutputText(text=text),)))
    return items


def tool_output(generator: LocalGenerator, tokens: int, turn: int) -> str:
    """A plausible tool output (a source listing) of about `tokens` of the model's tokens."""
    lines: list[str] = []
    line = 0
    while len(generator.tokenizer.encode("".join(lines), add_special_tokens=False)) < tokens:
        line += 1
        lines.append(
            f"{line:4d}  def handler_{turn}_{line}(request):"
            f" return respond(request, status={200 + line % 5})\n"
        )
    return "".join(lines)


async def measure(
    generator: LocalGenerator,
    *,
    turns: int = 8,
    tool_output_tokens: int = 500,
    repeat: int = 1,
    progress: Callable[[int, Turn], None] | None = None,
) -> list[Turn]:
    """Run the loop `repeat` times and keep each turn's fastest warm and cold prefill (the
    least disturbed by whatever else the machine runs); the generator's `max_tokens` is the
    length of each answer."""
    runs = []
    for run in range(repeat):
        runs.append(await _rollout(generator, turns, tool_output_tokens, run, progress))
    return [
        attrs.evolve(
            same[0],
            warm_seconds=min(t.warm_seconds for t in same),
            cold_seconds=min(t.cold_seconds for t in same),
            same_output=all(t.same_output for t in same),
        )
        for same in zip(*runs, strict=True)
    ]


async def _rollout(
    generator: LocalGenerator,
    turns: int,
    tool_output_tokens: int,
    run: int,
    progress: Callable[[int, Turn], None] | None,
) -> list[Turn]:
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    ask = "The test suite fails. Here is the module under test:\n\n"
    conversation.extend([Message(role="user", content=ask + tool_output(generator, 200, 0))])
    warm = generator.open_session(conversation)
    results = []
    try:
        for turn in range(1, turns + 1):
            answer = await timed_segment(warm)
            cold = generator.open_session(conversation)
            try:
                cold_answer = await timed_segment(cold)
            finally:
                await cold.aclose()
            result = Turn(
                turn=turn,
                prompt_tokens=answer.prefill.prompt_tokens,
                warm_prefilled=answer.prefill.prompt_tokens - answer.prefill.cached_tokens,
                warm_seconds=answer.prefill_seconds,
                cold_prefilled=cold_answer.prefill.prompt_tokens,
                cold_seconds=cold_answer.prefill_seconds,
                same_output=answer.chunks == cold_answer.chunks,
            )
            results.append(result)
            if progress is not None:
                progress(run, result)
            output = tool_output(generator, tool_output_tokens, turn)
            conversation.extend(
                [*said(answer.chunks), FunctionCallOutput(call_id=f"call_{turn}", output=output)]
            )
    finally:
        await warm.aclose()
    return results


def table(results: Sequence[Turn]) -> str:
    """A Markdown table, one row per turn, then the medians over the turns that resumed."""
    lines = [
        "| turn | prompt tokens | warm: prefilled | warm: ms | cold: prefilled | cold: ms "
        "| speedup | same output |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.turn} | {r.prompt_tokens} | {r.warm_prefilled} | {r.warm_seconds * 1e3:.0f} "
            f"| {r.cold_prefilled} | {r.cold_seconds * 1e3:.0f} | {r.speedup:.1f}x "
            f"| {'yes' if r.same_output else 'NO'} |"
        )
    resumed = results[1:]
    if resumed:
        warm = statistics.median(r.warm_seconds for r in resumed)
        cold = statistics.median(r.cold_seconds for r in resumed)
        speedup = statistics.median(r.speedup for r in resumed)
        lines.append(
            f"| median of turns 2-{results[-1].turn} | | "
            f"{statistics.median(r.warm_prefilled for r in resumed):.0f} | {warm * 1e3:.0f} | "
            f"{statistics.median(r.cold_prefilled for r in resumed):.0f} | {cold * 1e3:.0f} | "
            f"{speedup:.1f}x | |"
        )
    return "\n".join(lines)


@attrs.frozen(kw_only=True)
class LocalBenchSettings:
    """What `bench local` runs, beside the model (`LocalModel`, as serve's flags load it)."""

    turns: int = setting(8, at_least(1), help="turns of the agent loop")
    tool_output_tokens: int = setting(
        500, at_least(1), metavar="N",
        help="size of the tool output appended each turn, in the model's tokens",
    )  # fmt: skip
    answer_tokens: int = setting(
        8, at_least(1), metavar="N",
        help="tokens the model decodes each turn (warm and cold must say the same)",
    )  # fmt: skip
    repeat: int = setting(
        1, at_least(1), metavar="N",
        help="run the loop N times and keep each turn's fastest times (busy machines)",
    )  # fmt: skip


def run(args: LocalBenchSettings, wanted: LocalModel) -> int:
    """`proto-server bench local`: the local model serve would load, warm against cold."""
    generator = load_local(wanted, max_tokens=args.answer_tokens)
    print(
        f"{generator.name} on {generator.device}, {generator.threads} thread(s); "
        f"{args.turns} turns, {args.tool_output_tokens}-token tool outputs, "
        f"{args.answer_tokens}-token answers; prefill wall-clock time, measured"
        + (f", fastest of {args.repeat} runs" if args.repeat > 1 else ""),
        flush=True,
    )

    def progress(run: int, turn: Turn) -> None:
        print(
            f"run {run + 1}/{args.repeat}, turn {turn.turn}/{args.turns}: "
            f"warm {turn.warm_seconds * 1e3:.0f} ms, cold {turn.cold_seconds * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )

    results = trio.run(
        partial(
            measure,
            generator,
            turns=args.turns,
            tool_output_tokens=args.tool_output_tokens,
            repeat=args.repeat,
            progress=progress,
        )
    )
    print(table(results))
    return 0
