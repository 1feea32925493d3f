"""proto-server in front of vLLM against vLLM's own `/v1/responses`, turn by turn, measured.

The same agent loop runs twice on the same engine: each turn the model answers in a few tokens
(greedy), then a tool's output (as a user message of a fixed size) is added. Through vLLM's
own Responses endpoint every turn is stateless, `store: false`, the whole history sent again:
the engine re-renders and re-tokenizes it, and its prefix cache spares the prefill of what it
has seen. Through proto-server (`--generator vllm`, launched dialect over one WebSocket) each
turn is a `response.create` chained by `previous_response_id`, served from the connection's
warm rollout: only the new message is rendered and tokenized, and the engine is sent token ids.
Times are wall-clock on the client, from sending the turn to its first text delta (TTFT) and to
its terminal event; token counts are what each reports in `usage`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio
from trio_websocket import open_websocket_url

from proto_server.engine.vllm import VllmGenerator
from proto_server.server.app import ProtoServer
from proto_server.server.config import ServerConfig

INSTRUCTIONS = "You are a coding agent. Read the tool outputs and say what to fix, briefly."
#: Each turn asks for a short answer: a chained turn continues only a completed Response.
ASK_SHORT = "\n\nAnswer in one short sentence."
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@attrs.frozen
class TurnTiming:
    path: str
    turn: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    total_s: float


def tool_output(turn: int, tokens: int, tokenizer: Any) -> str:
    """A deterministic, turn-specific tool output of about `tokens` of the model's tokens."""
    lines: list[str] = []
    line = 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(f"tests/test_{turn}_{line}.py::test_case_{line} PASSED [{line % 100}%]")
        line += 1
    return "Tool output:\n" + "\n".join(lines)


def _usage(response: dict[str, Any]) -> tuple[int, int, int]:
    usage = response.get("usage") or {}
    details = usage.get("input_tokens_details") or {}
    return (
        int(usage.get("input_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        int(usage.get("output_tokens", 0)),
    )


async def engine_loop(
    url: str, model: str, inputs: Sequence[str], answer_tokens: int
) -> list[TurnTiming]:
    """The loop through vLLM's own `/v1/responses`: the whole history every turn (SSE)."""
    history: list[dict[str, Any]] = []
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        for turn, text in enumerate(inputs, 1):
            history.append({"role": "user", "content": text})
            body = {
                "model": model,
                "instructions": INSTRUCTIONS,
                "input": history,
                "max_output_tokens": answer_tokens,
                "temperature": 0,
                "store": False,
                "stream": True,
            }
            started = time.perf_counter()
            first = None
            final: dict[str, Any] = {}
            async with http.stream("POST", "/responses", json=body) as answer:
                if answer.status_code != 200:
                    raise RuntimeError(f"vLLM /v1/responses answered {answer.status_code}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    if event.get("type") == "response.output_text.delta" and first is None:
                        first = time.perf_counter()
                    if event.get("type") in TERMINAL:
                        final = event["response"]
            ended = time.perf_counter()
            said = "".join(
                part.get("text", "")
                for item in final.get("output", [])
                if item.get("type") == "message"
                for part in item.get("content", [])
            )
            history.append({"role": "assistant", "content": said})
            results.append(
                TurnTiming(
                    "vllm /v1/responses",
                    turn,
                    *_usage(final),
                    (first or ended) - started,
                    ended - started,
                )
            )
    return results


async def proto_loop(
    ws_url: str, model: str, inputs: Sequence[str], answer_tokens: int
) -> list[TurnTiming]:
    """The loop through proto-server: one WebSocket, each turn chained to the last."""
    results = []
    previous = None
    async with open_websocket_url(ws_url, max_message_size=16 * 1024 * 1024) as ws:
        for turn, text in enumerate(inputs, 1):
            create: dict[str, Any] = {
                "type": "response.create",
                "model": model,
                "instructions": INSTRUCTIONS,
                "input": text,
                "max_output_tokens": answer_tokens,
                "temperature": 0,
                "store": False,
            }
            if previous is not None:
                create["previous_response_id"] = previous
            started = time.perf_counter()
            await ws.send_message(json.dumps(create))
            first = None
            while True:
                event = json.loads(await ws.get_message())
                if event["type"] == "response.output_text.delta" and first is None:
                    first = time.perf_counter()
                if event["type"] in TERMINAL or event["type"] == "error":
                    break
            ended = time.perf_counter()
            if event["type"] == "error":
                raise RuntimeError(f"proto-server refused turn {turn}: {event['error']}")
            status = event["response"]["status"]
            if status != "completed" and turn < len(inputs):
                raise RuntimeError(
                    f"turn {turn} ended {status}; a chained turn needs a completed one: allow "
                    "more --answer-tokens"
                )
            previous = event["response"]["id"]
            results.append(
                TurnTiming(
                    "proto-server ws",
                    turn,
                    *_usage(event["response"]),
                    (first or ended) - started,
                    ended - started,
                )
            )
    return results


async def measure(
    generator: VllmGenerator,
    *,
    turns: int,
    tool_output_tokens: int,
    answer_tokens: int,
    nonce: str = "",
) -> list[TurnTiming]:
    """Both loops on the same turns, proto-server's first; each turn's input is new to the
    engine's cache (`nonce` makes a run's inputs its own)."""
    inputs = [f"{nonce}Find the failing test in this repository.{ASK_SHORT}"] + [
        f"{nonce}{tool_output(turn, tool_output_tokens, generator.tokenizer)}{ASK_SHORT}"
        for turn in range(2, turns + 1)
    ]
    server = ProtoServer(generator, ServerConfig(port=0, default_model=generator.name))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        proto = await proto_loop(address.ws_url, generator.name, inputs, answer_tokens)
        nursery.cancel_scope.cancel()
    # the engine's own endpoint on a cache that has not seen these exact prompts' tails
    engine = await engine_loop(
        generator.url, generator.name, [f"~{text}" for text in inputs], answer_tokens
    )
    return [*proto, *engine]


def table(results: Sequence[TurnTiming]) -> str:
    """A Markdown table: per turn, each path's prompt, cached tokens, TTFT and total time."""
    by_path: dict[str, dict[int, TurnTiming]] = {}
    for result in results:
        by_path.setdefault(result.path, {})[result.turn] = result
    proto, engine = by_path.get("proto-server ws", {}), by_path.get("vllm /v1/responses", {})
    lines = [
        "| turn | proto-server: prompt / cached / out | TTFT ms | total ms "
        "| vLLM /v1/responses: prompt / cached / out | TTFT ms | total ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cells(t: TurnTiming | None) -> str:
        if t is None:
            return "| |"
        return (
            f"{t.input_tokens} / {t.cached_tokens} / {t.output_tokens} | {t.ttft_s * 1e3:.0f} "
            f"| {t.total_s * 1e3:.0f}"
        )

    for turn in sorted(proto):
        lines.append(f"| {turn} | {cells(proto[turn])} | {cells(engine.get(turn))} |")
    later = [t for t in sorted(proto) if t > 1 and t in engine]
    if later:
        ratio = statistics.median(engine[t].ttft_s / proto[t].ttft_s for t in later)
        lines.append(f"\nmedian TTFT ratio (vLLM / proto-server) over turns 2+: {ratio:.2f}x")
    return "\n".join(lines)
