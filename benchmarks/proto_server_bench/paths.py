"""The paths an agent loop takes to one engine, as clients: proto-server's three, vLLM's two
(its chat completions, and a program-scheduling proxy's, are `chat.py`'s).

proto-server's prototype WebSocket (one Response, suspended on each call and appended to), its
launched WebSocket (turns chained by `previous_response_id`) and its stateless HTTP (the whole
history each turn) go through this project's own client (`proto_server.client`), so a bench
measures what a user of that client gets. vLLM's own `/v1/responses`, with the whole history
(`store: false`) or chained by `previous_response_id`, is plain SSE over httpx: its events are
vLLM's, not this project's wire types. Each path is one `Send`: `await send(new items,
tool_choice)` runs a turn and says what it answered, timed on the client. `bench vllm`
(vllm.py) and `bench agents` (agents.py) both run them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx
import trio
from trio_websocket import ConnectionClosed, HandshakeError

from proto_server.client import Connection, Dialect, Rollout, RolloutState, connect
from proto_server.client.http import StreamEnded
from proto_server.client.rollout import wire_json

INSTRUCTIONS = "You are a coding agent. Run the tests, read their output and say what to fix."


ASK = "Find the failing test in this repository."


#: The commands the tool takes: its one argument is an enum, so a forced call is a few tokens.
COMMANDS = ("pytest -x", "ls", "git diff")


#: `strict`, so that both front ends hold a call's arguments to the schema: vLLM's tool parser
#: (`--enable-auto-tool-choice --tool-call-parser hermes`) pins a forced call's name, and its
#: arguments only for a strict tool; proto-server holds every forced call's arguments.
TOOL = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "enum": list(COMMANDS)}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}


#: What vLLM's endpoint may decode for a forced call: its hermes calls are written with
#: indentation (`{\n    "cmd": ...`), 50-65 tokens here; the answer turn gets `--answer-tokens`.
CALL_TOKENS = 128


PROTOTYPE, LAUNCHED, HTTP = (
    "proto-server ws prototype",
    "proto-server ws launched",
    "proto-server http",
)


STATELESS, CHAINED = "vLLM /v1/responses", "vLLM /v1/responses chained"


PATHS = (PROTOTYPE, LAUNCHED, HTTP, STATELESS, CHAINED)


OURS, THEIRS = PATHS[:3], PATHS[3:]


TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


#: The first of these is the first output the client sees (on a forced call turn proto-server's
#: is the call's item, opened at its arguments' `{`).
OUTPUT = {
    "response.output_item.added",
    "response.output_text.delta",
    "response.function_call_arguments.delta",
}


Items = list[dict[str, Any]]


@attrs.frozen
class Said:
    """What one turn answered, as the client saw it."""

    id: str
    output: Items
    usage: tuple[int, int, int]
    ttft_s: float
    turn_s: float
    client_bytes: int


def _usage(response: dict[str, Any]) -> tuple[int, int, int]:
    usage = response.get("usage") or {}
    details = usage.get("input_tokens_details") or {}
    return (
        int(usage.get("input_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        int(usage.get("output_tokens", 0)),
    )


def calls(output: Items) -> Items:
    return [item for item in output if item.get("type") == "function_call"]


def valid_call(call: dict[str, Any]) -> bool:
    """The call names the tool, and its arguments are what the tool's schema allows."""
    try:
        arguments = json.loads(call.get("arguments") or "")
    except ValueError:
        return False
    return (
        call.get("name") == TOOL["name"]
        and isinstance(arguments, dict)
        and set(arguments) == {"cmd"}
        and arguments["cmd"] in COMMANDS
    )


def follow_up(output: Items, text: str) -> Items:
    """The next turn's new items: the tool's output for the model's call, else as a message."""
    made = calls(output)
    if made:
        return [
            {"type": "function_call_output", "call_id": call["call_id"], "output": text}
            for call in made
        ]
    return [{"role": "user", "content": f"Tool output:\n{text}"}]


def as_input(output: Items) -> Items:
    """A turn's output items as the next request's input (the fields every endpoint takes)."""
    items: Items = []
    for item in output:
        if item.get("type") == "function_call":
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
        elif item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []))
            items.append({"role": "assistant", "content": text})
    return items


async def _sse(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Said:
    """One streamed `POST .../responses`, timed."""
    raw = json.dumps(body).encode()
    started = time.perf_counter()
    first = None
    final: dict[str, Any] | None = None
    headers = {"content-type": "application/json"}
    async with http.stream("POST", url, content=raw, headers=headers) as answer:
        if answer.status_code != 200:
            text = (await answer.aread())[:300].decode(errors="replace")
            raise RuntimeError(f"{url} answered {answer.status_code}: {text}")
        async for line in answer.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("type") in OUTPUT and first is None:
                first = time.perf_counter()
            if event.get("type") in TERMINAL:
                final = event["response"]
    ended = time.perf_counter()
    if final is None:
        raise RuntimeError(f"{url}'s stream ended without a terminal event")
    if final.get("status") == "failed":
        raise RuntimeError(f"{url} failed: {final.get('error')}")
    ttft, took = (first or ended) - started, ended - started
    return Said(final["id"], final["output"], _usage(final), ttft, took, len(raw))


Send = Callable[[Items, str], Awaitable[Said]]


def _capped(cap: int, tool_choice: str) -> dict[str, Any]:
    """vLLM's `max_output_tokens` for a turn: room for a call on a forced turn, `cap` after."""
    return {"max_output_tokens": CALL_TOKENS if tool_choice == "required" else cap}


def _request(model: str, instructions: str, tool_choice: str) -> dict[str, Any]:
    """What every path's turn asks for (greedy, the one tool, at most one call)."""
    return {
        "model": model,
        "instructions": instructions,
        "tools": [TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "temperature": 0,
    }


@asynccontextmanager
async def open_path(
    path: str, proto_url: str, engine_url: str, model: str, instructions: str, answer_tokens: int
) -> AsyncIterator[Send]:
    """The client of one path: `await send(new items, tool_choice)` runs one turn."""
    ask = partial(_request, model, instructions)
    if path in OURS:
        async with connect(proto_url, dialect=DIALECTS[path]) as connection:
            yield _through_client(connection, ask)
        return
    async with httpx.AsyncClient(base_url=engine_url, timeout=600) as http:
        # vLLM's endpoint is told the answer's length; proto-server's is started with it
        yield (_chained if path == CHAINED else _stateless)(http, ask, answer_tokens)


#: The client dialect of each of proto-server's paths.
DIALECTS: dict[str, Dialect] = {PROTOTYPE: "prototype", LAUNCHED: "launched", HTTP: "http"}


def _through_client(connection: Connection, ask: Callable[[str], dict[str, Any]]) -> Send:
    """A proto-server path through this project's client (`client/`): its dialect decides what
    a turn puts on the wire (one Response suspended on each call and appended to, a chain by
    `previous_response_id`, or the whole history)."""
    rollouts: list[Rollout] = []

    async def send(new: Items, tool_choice: str) -> Said:
        if not rollouts:
            # store: false like every path; true would also write each suspension
            rollouts.append(await connection.create(new, store=False, **ask(tool_choice)))
        elif rollouts[0].state is RolloutState.SUSPENDED:
            answers = {item["call_id"]: item["output"] for item in new}
            await rollouts[0].append(answers, tool_choice=tool_choice)
        else:  # proto-server holds a forced call to its tool: this is not the model's doing
            raise RuntimeError(
                f"proto-server's turn ended {rollouts[0].state.value}, not in a call"
            )
        rollout = rollouts[0]
        before = len(rollout.output)
        segment = await rollout.step()
        if segment.end == "error" or rollout.state is RolloutState.FAILED:
            raise RuntimeError(f"proto-server refused the turn: {rollout.tracker.error}")
        assert segment.ended_at is not None and segment.response_id is not None
        first = next((r.at for r in segment.events if r.event.type in OUTPUT), segment.ended_at)
        return Said(
            segment.response_id,
            [wire_json(item) for item in rollout.output[before:]],
            (segment.input_tokens, segment.cached_tokens, segment.output_tokens),
            first - segment.sent_at,
            segment.ended_at - segment.sent_at,
            segment.sent_bytes,
        )

    return send


def _stateless(http: httpx.AsyncClient, ask: Callable[[str], dict[str, Any]], cap: int) -> Send:
    """vLLM's endpoint with the whole history every turn, `store: false`."""
    history: Items = []

    async def send(new: Items, tool_choice: str) -> Said:
        history.extend(new)
        body = {"input": history, "store": False, "stream": True, **ask(tool_choice)}
        body.update(_capped(cap, tool_choice))
        said = await _sse(http, "/responses", body)
        history.extend(as_input(said.output))
        return said

    return send


def _chained(http: httpx.AsyncClient, ask: Callable[[str], dict[str, Any]], cap: int) -> Send:
    """vLLM's endpoint chained by `previous_response_id`: its store keeps the history."""
    previous: list[str] = []

    async def send(new: Items, tool_choice: str) -> Said:
        body = {"input": new, "store": True, "stream": True, **ask(tool_choice)}
        body.update(_capped(cap, tool_choice))
        if previous:
            body["previous_response_id"] = previous[-1]
        said = await _sse(http, "/responses", body)
        previous.append(said.id)
        return said

    return send


#: What ends one path's run (and only its own): it is reported, and the other paths go on.
PATH_FAILURES = (
    RuntimeError, OSError, httpx.HTTPError, HandshakeError, ConnectionClosed, StreamEnded,
    trio.BrokenResourceError,
)  # fmt: skip


async def start_proto_server(
    engine_url: str, answer_tokens: int, extra: Sequence[str] = ()
) -> tuple[trio.Process, str]:
    """proto-server as a process of its own in front of the engine (`extra`: more of its flags),
    and its HTTP base URL."""
    vllm = ["--generator", "vllm", "--engine-url", engine_url, "--max-tokens", str(answer_tokens)]
    return await start_serve([*vllm, *extra])


async def start_serve(arguments: Sequence[str]) -> tuple[trio.Process, str]:
    """`proto-server serve ARGUMENTS` as a process of its own (an in-memory store, a loopback
    port of its own), and its HTTP base URL once it listens."""
    command = [
        sys.executable, "-m", "proto_server", "serve", "--port", "0", "--host", "127.0.0.1",
        "--store", ":memory:", "--log-level", "error", *arguments,
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    line = b""
    with trio.fail_after(120):
        while not line.endswith(b"\n"):
            part = await process.stdout.receive_some(1)
            if not part:
                raise RuntimeError(f"proto-server exited ({await process.wait()}) before listening")
            line += part
    text = line.decode()
    if "listening on " not in text:
        raise RuntimeError(f"proto-server said {text!r}")
    return process, text.split("listening on ")[1].split(" ")[0]
