"""The chat-completions paths of `bench agents`: vLLM's `/v1/chat/completions` alone, and the
same through a proxy that schedules programs in front of it (ThunderAgent's API).

The client drives chat completions as an agent library does: it keeps the messages and resends
them whole each turn, with the model's tool calls and the tools' outputs. Through a proxy each
rollout is a program: a `program_id` of its own in every body (where the OpenAI SDK's
`extra_body` puts it) and, at its end, `POST /programs/release` at the proxy's root, as
ThunderAgent's own agent examples end one (a program never released stays counted against the
cache). Each path is a `paths.Send`, so `bench agents` runs it as it runs the others.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from proto_server_bench.paths import CALL_TOKENS, TOOL, Items, Said, Send

#: vLLM's chat completions alone, and the same through a proxy that schedules by `program_id`
#: (`bench agents` only: bench vllm measures one rollout's front-end cost, not scheduling).
CHAT, PROGRAMS = "vLLM /v1/chat/completions", "ThunderAgent /v1/chat/completions"


@asynccontextmanager
async def open_chat(
    path: str, proxy_url: str, engine_url: str, model: str, instructions: str, answer_tokens: int
) -> AsyncIterator[Send]:
    """The client of one chat-completions path (`open_path`'s arguments; `proxy_url`: the
    proxy's base, ending in /v1, for `PROGRAMS`)."""
    base = proxy_url if path == PROGRAMS else engine_url
    ask = partial(_chat_request, model, answer_tokens)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        if path == CHAT:
            yield _chat(http, ask, instructions, {})
            return
        program = {"program_id": f"rollout-{secrets.token_hex(8)}"}
        try:
            yield _chat(http, ask, instructions, program)
        finally:  # as ThunderAgent's own agent examples end a program, failed or not
            with trio.move_on_after(30, shield=True):
                await _release(http, base, program)


#: The tool as chat completions take it.
CHAT_TOOL = {
    "type": "function",
    "function": {key: TOOL[key] for key in ("name", "description", "strict", "parameters")},
}


#: A streamed call's fields, assembled from its deltas.
CALL_FIELDS = ("id", "name", "arguments")


def _chat_request(model: str, cap: int, tool_choice: str) -> dict[str, Any]:
    """What each chat-completions turn asks for: `_request`'s, room for a call on a forced
    turn (`_capped`), the usage at the stream's end."""
    return {
        "model": model,
        "tools": [CHAT_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": CALL_TOKENS if tool_choice == "required" else cap,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def as_messages(items: Items) -> Items:
    """A turn's new items as chat messages: the tools' outputs as `tool` messages."""
    return [
        {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
        if item.get("type") == "function_call_output"
        else item
        for item in items
    ]


def _chat(
    http: httpx.AsyncClient,
    ask: Callable[[str], dict[str, Any]],
    instructions: str,
    extra: dict[str, Any],
) -> Send:
    """Chat completions with the whole history every turn (the client keeps the messages: the
    model's calls and the tools' outputs), `extra` in every body (a proxy's `program_id`)."""
    messages: Items = [{"role": "system", "content": instructions}]

    async def send(new: Items, tool_choice: str) -> Said:
        messages.extend(as_messages(new))
        said, said_as_message = await _chat_stream(http, {"messages": messages,
                                                          **ask(tool_choice), **extra})  # fmt: skip
        messages.append(said_as_message)
        return said

    return send


async def _chat_stream(
    http: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[Said, dict[str, Any]]:
    """One streamed `POST .../chat/completions`, timed: what it said as Responses items (for
    `follow_up`) and as the assistant message the next turn resends. Its first output is the
    first chunk with a choice (vLLM sends the role's with the first token)."""
    raw = json.dumps(body).encode()
    started = time.perf_counter()
    first = None
    ident, text, usage = "", [], None
    made: dict[int, dict[str, str]] = {}
    headers = {"content-type": "application/json"}
    async with http.stream("POST", "/chat/completions", content=raw, headers=headers) as answer:
        if answer.status_code != 200:
            said = (await answer.aread())[:300].decode(errors="replace")
            raise RuntimeError(f"{answer.url} answered {answer.status_code}: {said}")
        async for line in answer.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"{answer.url} failed: {chunk['error']}")
            ident = chunk.get("id") or ident
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                first = first or time.perf_counter()
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    into = made.setdefault(call.get("index", 0), dict.fromkeys(CALL_FIELDS, ""))
                    function = call.get("function") or {}
                    into["id"] = call.get("id") or into["id"]
                    into["name"] = function.get("name") or into["name"]
                    into["arguments"] += function.get("arguments") or ""
    ended = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{answer.url}'s stream ended without its usage")
    details = usage.get("prompt_tokens_details") or {}
    counts = (int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
              int(usage.get("completion_tokens", 0)))  # fmt: skip
    content = "".join(text)
    calls_made = [made[index] for index in sorted(made)]
    output: Items = [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": content}]}
    ] if content else []  # fmt: skip
    output += [{"type": "function_call", "call_id": c["id"], "name": c["name"],
                "arguments": c["arguments"]} for c in calls_made]  # fmt: skip
    # content None beside calls, as the OpenAI SDK's agents send it
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls_made:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls_made
        ]  # fmt: skip
    ttft, took = (first or ended) - started, ended - started
    return Said(ident, output, counts, ttft, took, len(raw)), message


async def _release(http: httpx.AsyncClient, base: str, program: dict[str, Any]) -> None:
    """Ends a program on its proxy (at the proxy's root, not under /v1), so that what it held
    is counted free."""
    root = base.rstrip("/").removesuffix("/v1")
    released = await http.post(f"{root}/programs/release", json=program)
    released.raise_for_status()
