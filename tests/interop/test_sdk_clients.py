"""The real openai-python and openai-agents SDKs, unmodified, against the server.

Both are asyncio/threaded libraries; they run in a worker thread while the server runs in trio.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio
from openai import OpenAI

from ..support.clients import in_thread
from ..support.servers import StartServer

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
        "additionalProperties": False,
    },
    "strict": False,
}


def two_turn_tool_loop(http_url: str) -> tuple[Any, Any, list[str]]:
    """What a user writes with `client.responses.connect()`: create, run the tool, chain."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    seen: list[str] = []
    with client.responses.connect() as connection:
        connection.response.create(model="gpt-test", input="run echo", tools=[SHELL], store=False)
        calls = []
        for event in connection:
            seen.append(event.type)
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                calls.append(event.item)
            if event.type == "response.completed":
                first = event.response
                break
        outputs = [
            {"type": "function_call_output", "call_id": call.call_id, "output": "hello\n"}
            for call in calls
        ]
        connection.response.create(
            model="gpt-test",
            previous_response_id=first.id,
            input=outputs,
            tools=[SHELL],
            store=False,
        )
        for event in connection:
            seen.append(event.type)
            if event.type == "response.completed":
                second = event.response
                break
    return first, second, seen


async def test_openai_python_websocket_tool_loop(start_server: StartServer) -> None:
    running = await start_server()
    with trio.fail_after(60):
        first, second, seen = await in_thread(two_turn_tool_loop, running.address.http_url)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "shell"
    assert call.arguments == '{"command":["echo","hello from proto-server"]}'
    assert second.previous_response_id == first.id
    assert "hello" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert seen.count("response.created") == 2
    assert [t.source for t in running.server.responses.turns] == ["fresh", "cache"]


def stream_over_http(http_url: str) -> list[Any]:
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    stream = client.responses.create(model="gpt-test", input="say hi", stream=True)
    return list(stream)


async def test_openai_python_streams_over_http(start_server: StartServer) -> None:
    running = await start_server()
    with trio.fail_after(60):
        events = await in_thread(stream_over_http, running.address.http_url)
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "say hi" in text
    assert events[-1].response.output_text == text


def run_agent(http_url: str, chain: bool) -> tuple[str, list[str]]:
    from agents import Agent, function_tool, responses_websocket_session

    ran: list[str] = []

    @function_tool
    def echo_hi() -> str:
        """Print hi."""
        ran.append("echo_hi")
        return "hi"

    async def main() -> str:
        async with responses_websocket_session(api_key="sk-test", base_url=http_url) as session:
            agent = Agent(
                name="probe", instructions="You are a probe.", model="gpt-test", tools=[echo_hi]
            )
            result = await session.run(agent, "call echo_hi", auto_previous_response_id=chain)
            return str(result.final_output)

    return asyncio.run(main()), ran


@pytest.mark.parametrize("chain", [False, True], ids=["full-history", "auto-previous-response-id"])
async def test_openai_agents_websocket_session(start_server: StartServer, chain: bool) -> None:
    running = await start_server()
    with trio.fail_after(60):
        final, ran = await in_thread(run_agent, running.address.http_url, chain)
    assert ran == ["echo_hi"]
    assert "echo_hi" in final and "hi" in final
    sources = [t.source for t in running.server.responses.turns]
    # chaining is served from the connection's warm cache; full history starts fresh each call
    assert sources == (["fresh", "cache"] if chain else ["fresh", "fresh"])


def list_and_retrieve_models(http_url: str) -> tuple[list[Any], Any, int]:
    import openai

    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    listed = list(client.models.list())
    retrieved = client.models.retrieve(listed[0].id)
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as exc:
        return listed, retrieved, exc.status_code
    raise AssertionError("an unknown model was found")


async def test_openai_python_lists_the_served_model(start_server: StartServer) -> None:
    running = await start_server()
    with trio.fail_after(60):
        listed, retrieved, missing = await in_thread(
            list_and_retrieve_models, running.address.http_url
        )
    served = running.server.responses.config.default_model
    assert [model.id for model in listed] == [served]
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (served, "model", "proto-server")
    assert missing == 404
