"""Reasoning: what a model thinks becomes a `reasoning` output item, streamed and counted.

A segment that thinks opens a `reasoning` item before its text or calls:
`output_item.added`, `content_part.added` (a `reasoning_text` part),
`response.reasoning_text.delta`*, `.done`, `content_part.done`, `output_item.done`; its tokens are
`output_tokens_details.reasoning_tokens` (and part of `output_tokens`). With
`include: ["reasoning.encrypted_content"]` the done item carries the reasoning sealed by the
server; a client that keeps nothing sends the item back with only that seal and the model reads
the text again; a seal the server did not make is a 400 naming the field. The scripted model
thinks where its script says `reasoning`; the families' parsers produce the same chunk.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from proto_server.core.compaction import CompactionKey
from proto_server.core.conversation import Conversation
from proto_server.core.reasoning import (
    ENCRYPTED_CONTENT,
    ReasoningSealer,
    check_reasonings,
    replayed,
)
from proto_server.core.render import O200kRenderer
from proto_server.core.response import ResponseMachine
from proto_server.testing import StreamChecker, o200k_count
from proto_server.wire.converter import converter, unstructure
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import Item, Reasoning, ReasoningText
from proto_server.wire.response import Response

from ..support.clients import END, collapse, connect, sse, types
from ..support.frames import body, create
from ..support.servers import StartServer

THOUGHT = "The loop stops one short of the end; check range()."
THINKING = {
    "segments": [
        {
            "reasoning": THOUGHT,
            "text": "Let me look.",
            "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat loop.py"}}],
        },
        {"reasoning": "Confirmed.", "text": "Fixed: range(n + 1)."},
    ]
}
REASONING_ITEM = [
    "output_item.added",
    "content_part.added",
    "reasoning_text.delta*",
    "reasoning_text.done",
    "content_part.done",
    "output_item.done",
]


def outputs(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == kind
    ]


def thought_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")


async def test_reasoning_streams_as_an_item_before_the_text_and_is_counted(
    start_server: StartServer,
) -> None:
    """Over a prototype WebSocket, checked event by event by the stream checker (exact token
    counts included), through a suspension and its resumption."""
    running = await start_server(script=THINKING)
    checker = StreamChecker(dialect="prototype", count_tokens=o200k_count)
    async with connect(running.prototype_url) as client:
        frame = create()
        checker.sent(frame)
        await client.send(frame)
        first = await client.until("response.done", *END)
        for event in first:
            checker.received(event)
        calls = outputs(first, "function_call")
        append = {
            "type": "response.append",
            "response_id": first[0]["response"]["id"],
            "input": [
                {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok"}
            ],
        }
        checker.sent(append)
        await client.send(append)
        second = await client.until(*END)
        for event in second:
            checker.received(event)
    checker.finish()
    names = collapse(types(first))
    start = names.index("output_item.added")
    assert names[start : start + len(REASONING_ITEM)] == REASONING_ITEM
    assert names[start + len(REASONING_ITEM) :][:2] == ["output_item.added", "content_part.added"]
    (item,) = outputs(first, "reasoning")
    assert item["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert item["summary"] == [] and "encrypted_content" not in item
    assert thought_of(first) == THOUGHT
    final = second[-1]["response"]
    assert [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "reasoning", "message",
    ]  # fmt: skip
    usage = final["usage"]
    thought = o200k_count(THOUGHT) + o200k_count("Confirmed.")
    assert usage["output_tokens_details"]["reasoning_tokens"] == thought
    assert usage["output_tokens"] > thought


async def test_openai_python_reads_the_reasoning_events_and_item(
    start_server: StartServer,
) -> None:
    """The real SDK's typed stream and its final Response, over HTTP/SSE."""
    running = await start_server(script={"segments": [{"reasoning": THOUGHT, "text": "Done."}]})
    client = AsyncOpenAI(base_url=running.address.http_url, api_key="unused", max_retries=0)
    seen: list[str] = []
    async with client.responses.stream(model="test-model", input="fix it") as stream:
        async for event in stream:
            seen.append(type(event).__name__)
        response = await stream.get_final_response()
    await client.close()
    assert "ResponseReasoningTextDeltaEvent" in seen and "ResponseReasoningTextDoneEvent" in seen
    reasoning = response.output[0]
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content or []] == [THOUGHT]
    assert response.output_text == "Done."
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == o200k_count(THOUGHT)


async def test_a_sealed_reasoning_item_comes_back_and_is_read_again(
    start_server: StartServer,
) -> None:
    """`store: false` with `include`: the seal alone brings the text back, so the next prompt
    is what it is when the client sends the text itself; an altered seal is refused."""
    script = {"segments": [{"reasoning": THOUGHT, "text": "Done."}, {"text": "That too."}]}
    running = await start_server(script=script)
    url = f"{running.address.http_url}/responses"
    async with httpx.AsyncClient() as http:
        events = await sse(http, url, body(tools=[], store=False, include=[ENCRYPTED_CONTENT]))
        (item,) = outputs(events, "reasoning")
        assert isinstance(item["encrypted_content"], str)
        assert THOUGHT not in item["encrypted_content"].split(".")[1]

        async def prompt_of(reasoning: dict[str, Any]) -> int:
            later = [
                {"type": "message", "role": "user", "content": "fix it"},
                reasoning,
                {"type": "message", "role": "assistant", "content": "Done."},
                {"type": "message", "role": "user", "content": "and the other one"},
            ]
            answer = await http.post(url, json=body(tools=[], store=False, input=later))
            assert answer.status_code == 200, answer.text
            return int(answer.json()["usage"]["input_tokens"])

        sealed_only = {k: v for k, v in item.items() if k != "content"}
        with_text = {k: v for k, v in item.items() if k != "encrypted_content"}
        without_text = {**with_text, "content": []}
        assert await prompt_of(sealed_only) == await prompt_of(with_text)
        assert await prompt_of(sealed_only) > await prompt_of(without_text)

        forged = {**sealed_only, "encrypted_content": item["encrypted_content"][:-2] + "AA"}
        refused = await http.post(url, json=body(tools=[], input=["x", forged][1:]))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == (
            "invalid_encrypted_content",
            "input[0].encrypted_content",
        )
    async with connect(running.address.ws_url) as client:
        await client.send(create(tools=[], input=[forged]))
        (answer,) = await client.until(*END)
        assert answer["type"] == "error" and answer["error"] == error


# -- the parts, without a socket -------------------------------------------------------------------


def machine(**kwargs: Any) -> ResponseMachine:
    response = Response(id="resp_1", created_at=0, status="in_progress", model="m")
    return ResponseMachine(response=response, conversation=Conversation(O200kRenderer()), **kwargs)


def test_text_after_reasoning_closes_it_and_a_cut_leaves_it_incomplete() -> None:
    m = machine(seal=ReasoningSealer(CompactionKey(b"k" * 16)))
    m.start()
    m.begin_segment(prompt_tokens=5, cached_tokens=0)
    m.reasoning_delta("a", tokens=1)
    events = m.text_delta("b", tokens=1)
    assert [e.type for e in events][:3] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    done = events[2].item  # type: ignore[union-attr]
    assert isinstance(done, Reasoning) and done.text == "a" and done.encrypted_content
    m.reasoning_delta("c", tokens=2)  # a second thought after the text: a second item
    m.make_incomplete("max_output_tokens")
    kinds = [item.type for item in m.output]
    statuses = [getattr(item, "status", None) for item in m.output]
    assert kinds == ["reasoning", "message", "reasoning"]
    assert statuses == ["completed", "completed", "incomplete"]
    assert m.usage().output_tokens_details.reasoning_tokens == 3
    assert m.usage().output_tokens == 4


def test_a_reasoning_item_round_trips_the_converter_without_nulls() -> None:
    item = Reasoning(id="rs_1", content=(ReasoningText(text="t"),), status="completed")
    raw = unstructure(item)
    assert raw == {
        "type": "reasoning", "id": "rs_1", "summary": [],
        "content": [{"type": "reasoning_text", "text": "t"}], "status": "completed",
    }  # fmt: skip
    assert converter.structure(raw, Item) == item  # type: ignore[arg-type]


def test_a_seal_verifies_only_for_reasoning_and_only_with_its_key() -> None:
    key = CompactionKey(b"k" * 16)
    sealed = ReasoningSealer(key)(THOUGHT)
    item = Reasoning(id="rs_1", encrypted_content=sealed)
    check_reasonings([item], key)
    (back,) = replayed((item,), key)
    assert isinstance(back, Reasoning) and back.text == THOUGHT
    for wrong in (CompactionKey(b"j" * 16), key):
        bad = item if wrong is not key else Reasoning(encrypted_content=key.seal(THOUGHT))
        with pytest.raises(ProtocolError) as refused:
            check_reasonings([bad], wrong)
        assert refused.value.detail.code == "invalid_encrypted_content"
