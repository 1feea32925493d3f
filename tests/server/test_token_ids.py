"""Token ids per output item (`include: ["output.token_ids"]`): NeMo Gym's fields,
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs`, on every model item
(reasoning, message, function call) in `response.output_item.done` and the Response, over both
WebSocket dialects, SSE and plain HTTP, from a warm rollout, one resumed from the store and one
rebuilt; none without the include; refused where the generator cannot say them. The simulated
GPU's ids are modelled (o200k_base's of its text); the local model's and vLLM's are checked
against the engine itself in tests/services.

NeMo Gym (0.7.0, which needs Python 3.13 and so is not installed here) reads the fields as
`TokenIDLogProbMixin` in `nemo_gym/openai_utils.py` declares them, all three or none, and a
trainer reading a rollout checks `assert_prefix_contiguity` (`nemo_gym/token_id_capture/
builder.py`): each item's prompt extends the prompt and ids of the item before it.
`nemo_gym_reads` below is those two checks, as that code makes them."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from proto_server.core.request import LOGPROBS, TOKEN_IDS, response_template
from proto_server.core.tokenizer import o200k_base
from proto_server.core.trace import Sampled
from proto_server.engine.chunks import (
    ReasoningDelta,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.logprobs import Trail
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.offload import INLINE_BYTES
from proto_server.server.store import SQLiteStore
from proto_server.server.transport.writer import echoed_bytes
from proto_server.wire.events import OutputItemDone, ResponseCompleted, ResponseCreate
from proto_server.wire.items import TOKEN_FIELDS, Message

from ..support.clients import connect, resumed_elsewhere, sse
from ..support.frames import answers, body, create, launched_create
from ..support.servers import StartServer
from .test_logprobs import Blind

THOUGHT = "The loop is off by one — naïvely so."
SAID = "Let me look."
ARGUMENTS = '{"cmd": "grep -n range"}'
ANSWER = "Fixed."
TOOL_THEN_ANSWER = {
    "segments": [
        {
            "reasoning": THOUGHT,
            "text": SAID,
            "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "grep -n range"}}],
        },
        {"text": ANSWER},
    ]
}
FIRST_SEGMENT = {"segments": TOOL_THEN_ANSWER["segments"][:1]}
ASK = {"include": [TOKEN_IDS]}


def ids(text: str) -> list[int]:
    return list(o200k_base().encode_ordinary(text))


def nemo_gym_reads(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items that carry token fields, checked as NeMo Gym's code checks them: all three
    fields or none (`_validate_atomic_token_metadata`), ids and logprobs of one length, and
    each item's prompt extending what came before it (`assert_prefix_contiguity`)."""
    carrying = []
    seen: list[int] = []
    for item in output:
        present = set(TOKEN_FIELDS) & item.keys()
        if not present:
            continue
        assert present == set(TOKEN_FIELDS), item
        assert all(isinstance(i, int) for i in item["prompt_token_ids"])
        assert all(isinstance(i, int) for i in item["generation_token_ids"])
        assert all(isinstance(p, float) for p in item["generation_log_probs"])
        assert len(item["generation_token_ids"]) == len(item["generation_log_probs"])
        prompt = item["prompt_token_ids"]
        assert prompt[: len(seen)] == seen, "not prefix-contiguous"
        seen = prompt + item["generation_token_ids"]
        carrying.append(item)
    return carrying


def modelled(item: dict[str, Any]) -> list[int]:
    """The simulated GPU's ids for `item`: o200k_base's of its text (a call: its name's, then
    its arguments')."""
    match item["type"]:
        case "reasoning" | "message":
            return ids(item["content"][0]["text"])
        case "function_call":
            return ids(item["name"]) + ids(item["arguments"])
    raise AssertionError(item)


def done_items(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added and not any(set(TOKEN_FIELDS) & item.keys() for item in added)
    return [e["item"] for e in events if e["type"] == "response.output_item.done"]


def assert_one_segment(items: list[dict[str, Any]], usage: dict[str, Any]) -> None:
    """A segment's items: each its modelled ids, with the modelled logprobs; the first one's
    prompt is the whole prompt the segment was sent (as many tokens as usage says), each next
    one's that and the ids before it."""
    carrying = nemo_gym_reads(items)
    assert [item["type"] for item in carrying] == [item["type"] for item in items]
    for item in carrying:
        assert item["generation_token_ids"] == modelled(item)
        assert item["generation_log_probs"] == [
            math.log(0.5 + 0.49 * ((t * 2654435761) % 1000) / 1000)
            for t in item["generation_token_ids"]
        ]
    prompt = carrying[0]["prompt_token_ids"]
    assert len(prompt) == usage["input_tokens"] > 0
    for before, item in itertools.pairwise(carrying):
        assert (
            item["prompt_token_ids"] == before["prompt_token_ids"] + before["generation_token_ids"]
        )


async def test_token_ids_on_every_transport_are_the_same(start_server: StartServer) -> None:
    """Reasoning, message and call, each with its own ids, in `output_item.done` and the
    Response (stored ones too), the same over both dialects, SSE and HTTP."""
    running = await start_server(FIRST_SEGMENT)
    url = f"{running.address.http_url}/responses"
    said: dict[str, list[dict[str, Any]]] = {}
    with trio.fail_after(30):
        async with connect(running.prototype_url) as prototype:
            await prototype.send(create(**ASK))
            events = await prototype.until("response.done")
            said["prototype"] = done_items(events)
            assert events[-1]["response"]["output"] == said["prototype"]
        async with connect(running.address.ws_url) as launched:
            await launched.send(launched_create(**ASK))
            events = await launched.until("response.completed")
            said["launched"] = done_items(events)
            assert events[-1]["response"]["output"] == said["launched"]
            usage = events[-1]["response"]["usage"]
        async with httpx.AsyncClient(timeout=10) as http:
            events = await sse(http, url, body(**ASK))
            said["sse"] = done_items(events)
            answer = await http.post(url, json=body(**ASK))
            assert answer.status_code == 200, answer.text
            said["http"] = answer.json()["output"]
            stored = await http.get(f"{url}/{answer.json()['id']}")
            assert stored.json()["output"] == said["http"]
    tokens = {
        name: [{k: item[k] for k in TOKEN_FIELDS} for item in items] for name, items in said.items()
    }
    assert all(t == tokens["prototype"] for t in tokens.values()), tokens
    assert [item["type"] for item in said["http"]] == ["reasoning", "message", "function_call"]
    assert_one_segment(said["http"], usage)


async def test_with_logprobs_too_the_items_logprobs_are_the_texts(
    start_server: StartServer,
) -> None:
    """Both includes: a message's `generation_log_probs` are its text's logprobs."""
    running = await start_server({"segments": [{"text": THOUGHT}]})
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(
                f"{running.address.http_url}/responses",
                json=body(include=[TOKEN_IDS, LOGPROBS], top_logprobs=2),
            )
    (message,) = answer.json()["output"]
    logprobs = message["content"][0]["logprobs"]
    assert [entry["logprob"] for entry in logprobs] == message["generation_log_probs"]
    assert b"".join(bytes(e["bytes"]) for e in logprobs) == THOUGHT.encode()


async def test_without_the_include_no_item_carries_token_fields(start_server: StartServer) -> None:
    running = await start_server(TOOL_THEN_ANSWER)
    with trio.fail_after(10):
        async with connect(running.prototype_url) as client:
            for include in (None, [LOGPROBS], ["reasoning.encrypted_content"]):
                await client.send(create(**({"include": include} if include else {})))
                events = await client.until("response.done")
                await client.send({"type": "response.append", "input": answers(events)})
                events += await client.until("response.completed")
                for event in events:
                    for item in [
                        event.get("item") or {},
                        *event.get("response", {}).get("output", ()),
                    ]:
                        assert not set(TOKEN_FIELDS) & item.keys(), item


async def test_a_rollout_resumed_from_the_store_keeps_its_items_ids(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Its connection gone, the suspended Response is rebuilt cold on another: the items of
    the first segment keep their ids, the answer after the calls has its own, and its prompt
    is the whole conversation the second segment was sent."""
    running = await start_server(TOOL_THEN_ANSWER, store=SQLiteStore(tmp_path / "s.sqlite3"))
    with trio.fail_after(20):
        first, rest = await resumed_elsewhere(running, create(**ASK))
    assert [t.source for t in running.server.responses.turns] == ["store"]
    output = rest[-1]["response"]["output"]
    assert output[:3] == first[-1]["response"]["output"] == done_items(first)
    (answer,) = done_items(rest)
    assert output[3] == answer and answer["generation_token_ids"] == ids(ANSWER)
    # each segment contiguous; across them only as far as the model's turn is rendered as it
    # was sampled, which the simulated GPU's modelled ids are not
    before = nemo_gym_reads(output[:3])
    nemo_gym_reads([answer])
    prompts = before[0]["prompt_token_ids"], answer["prompt_token_ids"]
    assert prompts[1][: len(prompts[0])] == prompts[0]
    assert sum(map(len, prompts)) == rest[-1]["response"]["usage"]["input_tokens"]


async def test_a_launched_rollout_rebuilt_from_the_store_has_ids_on_its_items(
    start_server: StartServer, tmp_path: Path
) -> None:
    """`previous_response_id` on a new connection: the next Response is rebuilt from the
    store, and its items carry ids too, their prompt the rebuilt history."""
    running = await start_server(TOOL_THEN_ANSWER, store=SQLiteStore(tmp_path / "s.sqlite3"))
    with trio.fail_after(20):
        async with connect(running.address.ws_url) as client:
            await client.send(launched_create(store=True, **ASK))
            first = await client.until("response.completed")
        rid = first[-1]["response"]["id"]
        async with connect(running.address.ws_url) as client:
            frame = launched_create(
                store=True, previous_response_id=rid, input=answers(first), **ASK
            )
            await client.send(frame)
            rest = await client.until("response.completed")
    assert running.server.responses.turns[-1].source in ("store", "rebuilt")
    (answer,) = done_items(rest)
    assert rest[-1]["response"]["output"] == [answer]
    assert answer["generation_token_ids"] == ids(ANSWER)
    assert len(answer["prompt_token_ids"]) == rest[-1]["response"]["usage"]["input_tokens"]
    assert len(answer["prompt_token_ids"]) > len(done_items(first)[0]["prompt_token_ids"])


async def test_a_generator_that_cannot_say_ids_refuses_them(nursery: trio.Nursery) -> None:
    server = ProtoServer(Blind(), ServerConfig(port=0))  # type: ignore[arg-type]
    address = await nursery.start(server.serve)
    with trio.fail_after(10):
        async with connect(f"{address.ws_url}?dialect=prototype") as client:
            await client.send(create(**ASK))
            error = await client.receive()
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{address.http_url}/responses", json=body(**ASK))
    assert (error["error"]["code"], error["error"]["param"]) == ("unsupported_token_ids", "include")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "unsupported_token_ids"


# -- the generators' side -----------------------------------------------------------------------


def test_the_trail_gives_each_chunk_the_ids_it_carries_and_the_end_the_rest() -> None:
    """Every id goes to exactly one chunk, in order, or to the segment's end."""
    trail = Trail(ids=True)
    for token in range(10):
        trail.add(token, -token / 10)
    chunks = trail.attach(
        [
            ReasoningDelta("a", 2),
            TextDelta("b", 1),
            ToolCallBegin("f", 3),
            ToolCallArgumentsDelta("{}", 2),
            ToolCallEnd(),
        ]
    )
    got = [chunk.sampled.ids for chunk in chunks if getattr(chunk, "sampled", None)]
    assert got == [(0, 1), (2,), (3, 4, 5), (6, 7)]
    assert trail.rest() == Sampled((8, 9), (-0.8, -0.9))
    assert not Trail().attach([TextDelta("x", 1)])[0].sampled  # not asked: none
    assert SegmentEnd().sampled is None


def test_an_item_carrying_a_long_prompt_is_encoded_off_the_event_loop() -> None:
    # with token ids every item holds its whole prompt's: 100,000 ids are a 700 KB frame,
    # which the writer must count as such, not as one small item
    prompt = tuple(range(100_000))
    item = Message(role="assistant", content="ok", id="msg_1", prompt_token_ids=prompt,
                   generation_token_ids=(1,), generation_log_probs=(-0.5,))  # fmt: skip
    done = OutputItemDone(output_index=0, item=item)
    assert echoed_bytes(done) > INLINE_BYTES
    assert echoed_bytes(attrs.evolve(done, item=attrs.evolve(item, prompt_token_ids=(1,)))) < (
        INLINE_BYTES
    )
    template = response_template(
        ResponseCreate(input="hi"), response_id="r", created_at=0, default_model="m"
    )
    completed = ResponseCompleted(response=attrs.evolve(template, output=(item,)))
    assert echoed_bytes(completed) > INLINE_BYTES
