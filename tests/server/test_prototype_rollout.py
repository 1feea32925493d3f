"""The prototype dialect over a real socket: one Response for a whole agent rollout."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proto_server.core.render import O200kRenderer, prefix_text
from proto_server.core.tokenizer import o200k_base
from proto_server.wire.converter import converter
from proto_server.wire.items import FunctionCallOutput, Item, Message
from proto_server.wire.tools import FunctionTool

from ..support.clients import collapse, connect, types
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS, USER, answers, create
from ..support.servers import StartServer

TEXT_ITEM = ["output_item.added", "content_part.added"]
TEXT_ITEM_END = ["output_text.done", "content_part.done", "output_item.done"]
CALL_END = ["function_call_arguments.done", "output_item.done"]


async def test_a_whole_rollout_is_one_response(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.prototype_url) as client:
        await client.send(create())
        first = await client.segment()
        await client.send({"type": "response.append", "input": answers(first)})
        second = await client.segment()
        await client.send({"type": "response.append", "input": answers(second)})
        third = await client.segment()

    assert collapse(types(first)) == [
        "created", "in_progress",
        *TEXT_ITEM, "output_text.delta*", *TEXT_ITEM_END,
        "output_item.added", "function_call_arguments.delta*", *CALL_END,
        "done",
    ]  # fmt: skip
    assert collapse(types(second)) == [
        "in_progress",
        "output_item.added", "function_call_arguments.delta*", *CALL_END,
        "output_item.added", "function_call_arguments.delta*", *CALL_END,
        "done",
    ]  # fmt: skip
    assert collapse(types(third)) == [
        "in_progress", *TEXT_ITEM, "output_text.delta*", *TEXT_ITEM_END, "completed",
    ]  # fmt: skip

    events = first + second + third
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response_ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(response_ids) == 1
    # output indices continue across segments: 0,1 | 2,3 | 4
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert first[-1]["response"]["status"] == "in_progress"
    final = third[-1]["response"]
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == [
        "message", "function_call", "function_call", "function_call", "message"
    ]  # fmt: skip
    assert final["output"][-1]["content"][0]["text"] == "Fixed: the loop was off by one."
    assert [i["arguments"] for i in final["output"] if i["type"] == "function_call"] == [
        '{"cmd":"ls"}',
        '{"cmd":"cat a.py"}',
        '{"cmd":"cat b.py"}',
    ]
    # deltas add up to their done texts
    text = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta")
    assert text == "Let me look."

    # usage: real o200k_base counts of what streamed and of every prompt the model read
    encoding = o200k_base()

    def count(text: str) -> int:
        return len(encoding.encode_ordinary(text))

    output_tokens = sum(
        count(part["text"]) for i in final["output"] if i["type"] == "message"
        for part in i["content"]
    ) + sum(
        count(i["name"]) + count(i["arguments"]) for i in final["output"]
        if i["type"] == "function_call"
    )  # fmt: skip
    usage = final["usage"]
    assert usage["output_tokens"] == output_tokens

    renderer = O200kRenderer()
    tools = (converter.structure(EXEC_COMMAND, FunctionTool),)
    prefix = count(prefix_text("You fix bugs.", tools))

    def tokens(items: list[Item]) -> int:
        return sum(len(renderer.render_item(item)) for item in items)

    def structured(raw: list[dict[str, Any]]) -> list[Item]:
        return [converter.structure(i, Item) for i in raw]  # type: ignore[arg-type]

    out = structured(final["output"])
    appended_1 = structured(answers(first))
    appended_2 = structured(answers(second))
    user = [Message(role="user", content=USER["content"])]
    prompt_1 = prefix + tokens(user)
    seg1_end = prompt_1 + tokens(out[:2])
    prompt_2 = seg1_end + tokens(appended_1)
    seg2_end = prompt_2 + tokens(out[2:4])
    prompt_3 = seg2_end + tokens(appended_2)
    assert all(isinstance(i, FunctionCallOutput) for i in appended_1 + appended_2)
    assert usage["input_tokens"] == prompt_1 + prompt_2 + prompt_3
    # segments 2 and 3 re-read nothing: their cached tokens are everything up to the model's
    # last words, and only the appended tool outputs were prefilled
    assert usage["input_tokens_details"]["cached_tokens"] == seg1_end + seg2_end
    assert usage["total_tokens"] == usage["input_tokens"] + output_tokens

    assert running.server.open_rollouts == 0


async def test_the_next_response_on_the_connection_starts_fresh(start_server: StartServer) -> None:
    """After `response.completed`, a new `response.create` opens a new Response."""
    running = await start_server()
    async with connect(running.prototype_url) as client:
        await client.send(create(tools=[]))
        first = await client.segment()
        await client.send(create(tools=[]))
        second = await client.segment()
    assert first[-1]["type"] == second[-1]["type"] == "response.completed"
    assert first[0]["response"]["id"] != second[0]["response"]["id"]
    assert second[0]["sequence_number"] == first[-1]["sequence_number"] + 1


@pytest.mark.parametrize(
    "header",
    [
        {"OpenAI-Beta": "responses_websockets=2026-02-04"},
        {"X-Proto-Dialect": "prototype"},
    ],
)
async def test_the_prototype_dialect_is_chosen_by_header(
    start_server: StartServer, header: dict[str, str]
) -> None:
    running = await start_server(THREE_SEGMENTS)
    async with connect(running.address.ws_url, **header) as client:
        await client.send(create())
        events = await client.segment()
    assert events[-1]["type"] == "response.done"


async def test_a_request_body_with_unknown_fields_and_tools_is_served(
    start_server: StartServer,
) -> None:
    running = await start_server()
    async with connect(running.prototype_url) as client:
        await client.send(
            create(
                tools=[
                    EXEC_COMMAND,
                    {"type": "web_search"},
                    {
                        "type": "custom",
                        "name": "apply_patch",
                        "format": {
                            "type": "grammar",
                            "syntax": "lark",
                            "definition": "start: /.+/",
                        },
                    },
                ],
                reasoning={"effort": "medium"},
                include=["reasoning.encrypted_content"],
                prompt_cache_key="abc",
                stream=True,
            )
        )
        events = await client.segment()
    tools = events[0]["response"]["tools"]
    assert tools[1] == {"type": "web_search"}
    assert tools[2]["format"]["definition"] == "start: /.+/"
    assert events[-1]["type"] == "response.done"


def test_tool_outputs_render_in_the_conversation() -> None:
    """The appended outputs count as prompt tokens: the renderer sees their text."""
    renderer = O200kRenderer()
    short = FunctionCallOutput(call_id="call_1", output="ok")
    long = FunctionCallOutput(call_id="call_1", output="ok " * 100)
    assert len(renderer.render_item(long)) > len(renderer.render_item(short)) + 90
    assert orjson.dumps(converter.unstructure(short))
