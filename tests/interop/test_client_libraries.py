"""Agent libraries, unmodified, against the server: each one's plain answer, streamed answer,
tool loop and structured output, as its docs show them.

Python: pydantic-ai (`OpenAIResponsesModel`, `NativeOutput`) and Microsoft Agent Framework
(`agent_framework.openai.OpenAIChatClient`, its Responses client; `response_format`), the
`interop` extra. JavaScript: LangChain JS (`ChatOpenAI` with `useResponsesApi`,
`withStructuredOutput`) and the OpenAI Agents SDK (`@openai/agents`, `outputType`), from
tests/clients/package.json, run by `tests/clients/libraries.mjs`. Each run reports what the
library returned and every request body it sent; the tests compare that with what the server
served. openai-python, openai-agents (Python), LangChain Python and the Vercel AI SDK have their
own modules (test_sdk_clients, test_structured_output, test_vercel_ai).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import orjson
import pydantic
import pytest
import trio

from ..support.clients import in_thread
from ..support.requirements import INTEROP_EXTRA, require
from ..support.servers import StartServer

CLIENTS = Path(__file__).resolve().parents[1] / "clients"

PROMPT = "say hi"
TASK = "the tests fail; fix the bug"
FILE = "File a ticket for the flaky test."
#: the default model fills a `cmd` argument with this (engine/default_model.py)
COMMAND = "echo hello from proto-server"

Mode = Literal["plain", "stream", "tools", "structured"]
#: what a run reports: text, id (the response the text came from), deltas, ran, output, sent
Result = dict[str, Any]


class Ticket(pydantic.BaseModel):
    title: str
    priority: Literal["low", "high"]
    points: int


class Recorder:
    """An openai `AsyncOpenAI` whose HTTP client keeps every request body it sends."""

    def __init__(self, base_url: str) -> None:
        self.sent: list[Any] = []

        async def keep(request: Any) -> None:  # openai's own httpx (httpx2) request
            if request.content:
                self.sent.append(orjson.loads(request.content))

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [keep]})
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, http_client=http
        )


def run_command(ran: list[str]) -> Callable[[str], str]:
    def exec_command(cmd: str) -> str:
        """Run a shell command."""
        ran.append(cmd)
        return f"ran {cmd}"

    return exec_command


# -- the Python libraries: asyncio, so each run is an asyncio.run on a worker thread ------------


async def pydantic_ai_run(mode: Mode, base_url: str) -> Result:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    recorder = Recorder(base_url)
    model = OpenAIResponsesModel("any", provider=OpenAIProvider(openai_client=recorder.client))
    result: Result = {}
    if mode == "plain":
        plain = await Agent(model).run(PROMPT)
        result = {"text": plain.output, "id": plain.response.provider_response_id}
    elif mode == "stream":
        async with Agent(model).run_stream(PROMPT) as stream:
            deltas = [delta async for delta in stream.stream_text(delta=True, debounce_by=None)]
        text = "".join(deltas)
        result = {"deltas": deltas, "text": text, "id": stream.response.provider_response_id}
    elif mode == "tools":
        ran: list[str] = []
        loop = await Agent(model, tools=[run_command(ran)]).run(TASK)
        result = {"ran": ran, "text": loop.output, "id": loop.response.provider_response_id}
    else:
        structured = await Agent(model, output_type=NativeOutput(Ticket)).run(FILE)
        result = {"output": structured.output}
    return {**result, "sent": recorder.sent}


async def agent_framework_run(mode: Mode, base_url: str) -> Result:
    from agent_framework import Agent, tool
    from agent_framework.openai import OpenAIChatClient

    recorder = Recorder(base_url)
    client = OpenAIChatClient(model="any", async_client=recorder.client)
    result: Result = {}
    if mode == "plain":
        answer = await Agent(client=client).run(PROMPT)
        result = {"text": answer.text, "id": answer.response_id}
    elif mode == "stream":
        stream = Agent(client=client).run(PROMPT, stream=True)
        # its text updates append a delta, except output_text.done's, which replaces the whole
        deltas = [
            content.text
            async for update in stream
            for content in update.contents
            if content.type == "text" and content.merge_mode == "append" and content.text
        ]
        final = await stream.get_final_response()
        result = {"deltas": deltas, "text": final.text, "id": final.response_id}
    elif mode == "tools":
        ran: list[str] = []
        agent = Agent(client=client, tools=[tool(run_command(ran))])
        answer = await agent.run(TASK)
        result = {"ran": ran, "text": answer.text, "id": answer.response_id}
    else:
        answer = await Agent(client=client).run(FILE, options={"response_format": Ticket})
        result = {"output": answer.value}
    return {**result, "sent": recorder.sent}


def in_asyncio(
    module: str, run: Callable[[Mode, str], Coroutine[Any, Any, Result]]
) -> Callable[[Mode, str], Awaitable[Result]]:
    async def drive(mode: Mode, base_url: str) -> Result:
        require(module, INTEROP_EXTRA)
        return await in_thread(lambda: asyncio.run(run(mode, base_url)))

    return drive


# -- the JavaScript libraries: tests/clients/libraries.mjs --------------------------------------


def in_node(library: str) -> Callable[[Mode, str], Awaitable[Result]]:
    async def drive(mode: Mode, base_url: str) -> Result:
        done = await trio.run_process(
            ["node", str(CLIENTS / "libraries.mjs"), library, mode, base_url],
            cwd=CLIENTS, capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        result: Result = orjson.loads(done.stdout.splitlines()[-1])
        return result

    return drive


LIBRARIES = {
    "pydantic-ai": in_asyncio("pydantic_ai", pydantic_ai_run),
    "agent-framework": in_asyncio("agent_framework", agent_framework_run),
    "langchain-js": in_node("langchain"),
    "openai-agents-js": in_node("agents"),
}
#: The JavaScript libraries run in Node.js from tests/clients (the `npm` marker).
IN_NODE = {"langchain-js", "openai-agents-js"}
each_library = pytest.mark.parametrize(
    "library",
    [pytest.param(name, marks=pytest.mark.npm) if name in IN_NODE else name for name in LIBRARIES],
)


async def drive(library: str, mode: Mode, base_url: str) -> Result:
    with trio.fail_after(60):
        return await LIBRARIES[library](mode, base_url)


async def served_text(base_url: str, response_id: str) -> str:
    """The text of the stored response the library says its answer came from."""
    async with httpx.AsyncClient() as http:
        response = (await http.get(f"{base_url}/responses/{response_id}")).json()
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    return "".join(part["text"] for part in message["content"])


@each_library
async def test_a_plain_answer_is_what_the_server_served(
    library: str, start_server: StartServer
) -> None:
    running = await start_server()
    result = await drive(library, "plain", running.address.http_url)
    (request,) = result["sent"]
    assert not request.get("stream")
    assert result["text"] == await served_text(running.address.http_url, result["id"])
    assert f"“{PROMPT}”" in result["text"]  # the default model quotes what it was asked


@each_library
async def test_a_streamed_answer_arrives_in_deltas_that_add_up_to_it(
    library: str, start_server: StartServer
) -> None:
    running = await start_server()
    result = await drive(library, "stream", running.address.http_url)
    (request,) = result["sent"]
    assert request["stream"] is True
    assert len(result["deltas"]) > 1
    assert "".join(result["deltas"]) == result["text"]
    assert result["text"] == await served_text(running.address.http_url, result["id"])


@each_library
async def test_the_tool_loop_runs_the_call_and_answers_from_its_output(
    library: str, start_server: StartServer
) -> None:
    """The library runs the call the server made, with its arguments, and sends the output
    back under the call's id; the answer reads that output."""
    running = await start_server()
    result = await drive(library, "tools", running.address.http_url)
    assert result["ran"] == [COMMAND]
    first, *_, last = result["sent"]
    assert [tool["name"] for tool in first["tools"]] == ["exec_command"]
    (output,) = [item for item in last["input"] if item.get("type") == "function_call_output"]
    assert output["output"] == f"ran {COMMAND}"
    async with httpx.AsyncClient() as http:
        base = running.address.http_url
        given = (await http.get(f"{base}/responses/{result['id']}/input_items")).json()
    calls = [item for item in given["data"] if item["type"] == "function_call"]
    assert [call["call_id"] for call in calls] == [output["call_id"]]
    assert f"ran {COMMAND}" in result["text"]
    assert result["text"] == await served_text(running.address.http_url, result["id"])


@each_library
async def test_structured_output_is_an_instance_of_the_schema_it_sent(
    library: str, start_server: StartServer
) -> None:
    running = await start_server()
    result = await drive(library, "structured", running.address.http_url)
    (request,) = result["sent"]
    form = request["text"]["format"]
    assert form["type"] == "json_schema"
    output = result["output"]
    if isinstance(output, pydantic.BaseModel):  # the Python libraries parse into the model
        assert isinstance(output, Ticket)
        output = output.model_dump(mode="json")
    jsonschema.validate(output, form["schema"])
    assert output["priority"] in ("low", "high")
