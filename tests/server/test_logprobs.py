"""Logprobs as OpenAI returns them (`include: ["message.output_text.logprobs"]`, `top_logprobs`):
on both WebSocket dialects, over SSE and plain HTTP, and through the openai SDK; in the deltas,
the `done` event, the content part and the Response; none without the include; refused where
the generator cannot say them, and `top_logprobs` out of range. The simulated GPU models them
(`modelled_logprob`); the local model's and vLLM's are checked against the model itself in
tests/services."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from openai import OpenAI

from proto_server.core.request import LOGPROBS, check_create
from proto_server.engine.chunks import SegmentEnd, TextDelta, ToolCallArgumentsDelta, ToolCallBegin
from proto_server.engine.logprobs import TokenPieces, Trail
from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, modelled_logprob
from proto_server.engine.vllm.protocol import Piece, parse_sse
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.store import SQLiteStore
from proto_server.wire.converter import decode_client_event
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import Logprob

from ..support.clients import connect, in_thread, resumed_elsewhere, sse
from ..support.frames import EXEC_COMMAND, answers, body, create, launched_create
from ..support.servers import FAST, StartServer

#: Non-ASCII on purpose: a token may hold part of a character, and `bytes` says which.
ANSWER = "Fixed: the loop was off by one — naïve."
SCRIPT = {"segments": [{"text": ANSWER}]}
TOOL_THEN_ANSWER = {
    "segments": [
        {"text": "Let me look.", "tool_calls": [{"name": "exec_command", "arguments": {"a": 1}}]},
        {"text": ANSWER},
    ]
}
TOP = 3
ASK = {"include": [LOGPROBS], "top_logprobs": TOP}


def assert_logprobs(text: str, logprobs: list[dict[str, Any]], top: int = TOP) -> None:
    """`logprobs` are the simulated model's for exactly the tokens of `text`."""
    assert b"".join(bytes(entry["bytes"]) for entry in logprobs) == text.encode()
    assert logprobs, text
    for entry in logprobs:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", "replace")
        assert len(entry["top_logprobs"]) == top
        ranked = [other["logprob"] for other in entry["top_logprobs"]]
        assert ranked == sorted(ranked, reverse=True)
        assert sum(math.exp(value) for value in ranked) <= 1 + 1e-9
        if top:  # greedy: the sampled token is the likeliest
            assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
    assert len({entry["logprob"] for entry in logprobs}) > 1  # not one value for every token


def message_logprobs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every place a message's logprobs are said, each checked against the deltas'."""
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    streamed = [entry for delta in deltas for entry in delta["logprobs"]]
    for delta in deltas:  # each delta carries the logprobs of its own tokens
        assert (
            b"".join(bytes(entry["bytes"]) for entry in delta["logprobs"])
            == delta["delta"].encode()
        )
    (part,) = [e["part"] for e in events if e["type"] == "response.content_part.done"]
    (item,) = [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "message"
    ]
    (added,) = [e["part"] for e in events if e["type"] == "response.content_part.added"]
    assert added["logprobs"] == []
    assert done["logprobs"] == streamed == part["logprobs"] == item["content"][0]["logprobs"]
    assert_logprobs(done["text"], streamed)
    return streamed


def final_message(response: dict[str, Any]) -> dict[str, Any]:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    (part,) = message["content"]
    return dict(part)


async def test_logprobs_on_every_transport_are_the_models_own(start_server: StartServer) -> None:
    running = await start_server(SCRIPT)
    url = f"{running.address.http_url}/responses"
    said: dict[str, list[dict[str, Any]]] = {}
    with trio.fail_after(30):
        async with connect(running.prototype_url) as prototype:
            await prototype.send(create(**ASK))
            events = await prototype.until("response.completed")
            said["prototype"] = message_logprobs(events)
            assert final_message(events[-1]["response"])["logprobs"] == said["prototype"]
        async with connect(running.address.ws_url) as launched:
            await launched.send(launched_create(**ASK))
            events = await launched.until("response.completed")
            said["launched"] = message_logprobs(events)
            assert events[-1]["response"]["top_logprobs"] == TOP
        async with httpx.AsyncClient(timeout=10) as http:
            events = await sse(http, url, body(**ASK))
            said["sse"] = message_logprobs(events)
            answer = await http.post(url, json=body(**ASK))
            assert answer.status_code == 200, answer.text
            said["http"] = final_message(answer.json())["logprobs"]
            stored = await http.get(f"{url}/{answer.json()['id']}")
            assert final_message(stored.json())["logprobs"] == said["http"]
    first = said["prototype"]
    assert all(logprobs == first for logprobs in said.values()), said
    # the simulated GPU's modelled values, for the tokens it said
    assert [entry["logprob"] for entry in first] == [
        modelled_logprob(token, TOP).logprob for token in tokens_of(ANSWER)
    ]


def tokens_of(text: str) -> list[int]:
    from proto_server.core.tokenizer import o200k_base

    return list(o200k_base().encode_ordinary(text))


@pytest.mark.parametrize("top", [0, 1, 20])
async def test_top_logprobs_says_how_many_of_the_likeliest_each_lists(
    start_server: StartServer, top: int
) -> None:
    running = await start_server(SCRIPT)
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(
                f"{running.address.http_url}/responses",
                json=body(include=[LOGPROBS], top_logprobs=top),
            )
    logprobs = final_message(answer.json())["logprobs"]
    assert_logprobs(ANSWER, logprobs, top)


async def test_without_the_include_no_logprobs_are_sent(start_server: StartServer) -> None:
    """Today's bytes: deltas and `done` carry `logprobs: []`, parts none, whatever
    `top_logprobs` says (it is echoed: OpenAI returns logprobs only with the include)."""
    running = await start_server(SCRIPT)
    with trio.fail_after(10):
        async with connect(running.address.ws_url) as launched:
            for fields in ({}, {"top_logprobs": 5}, {"include": ["reasoning.encrypted_content"]}):
                await launched.send(launched_create(**fields))
                events = await launched.until("response.completed")
                for event in events:
                    if event["type"] in (
                        "response.output_text.delta",
                        "response.output_text.done",
                    ):
                        assert event["logprobs"] == []
                    part = event.get("part") or {}
                    assert "logprobs" not in part
                assert "logprobs" not in final_message(events[-1]["response"])
                assert events[-1]["response"]["top_logprobs"] == fields.get("top_logprobs", 0)


async def test_a_rollout_with_tool_calls_says_logprobs_in_every_segment(
    start_server: StartServer,
) -> None:
    """Prototype dialect: the message before the calls and the answer after them; the calls'
    arguments have none (the API lists logprobs of output text only)."""
    running = await start_server(TOOL_THEN_ANSWER)
    with trio.fail_after(10):
        async with connect(running.prototype_url) as client:
            await client.send(create(**ASK))
            first = await client.until("response.done")
            assert_logprobs("Let me look.", message_logprobs(first))
            await client.send({"type": "response.append", "input": answers(first)})
            rest = await client.until("response.completed")
    assert_logprobs(ANSWER, message_logprobs(rest))
    texts = [final_message({"output": [item]}) for item in rest[-1]["response"]["output"][:1]]
    assert_logprobs("Let me look.", texts[0]["logprobs"])


class Blind:
    """A generator that says no logprobs (it lacks `says_logprobs`)."""

    def __init__(self) -> None:
        self._inner = SimulatedGenerator(parse_script(SCRIPT), FAST)
        self.renderer = None
        self.forces_tool_calls = True

    def open_session(
        self, conversation: Any, *, cache_salt: str | None = None, affinity: str | None = None
    ) -> Any:
        return self._inner.open_session(conversation, cache_salt=cache_salt)


async def test_a_generator_that_cannot_say_logprobs_refuses_them_on_every_transport(
    nursery: trio.Nursery,
) -> None:
    server = ProtoServer(Blind(), ServerConfig(port=0))  # type: ignore[arg-type]
    address = await nursery.start(server.serve)
    with trio.fail_after(10):
        for url, frame in (
            (f"{address.ws_url}?dialect=prototype", create(**ASK)),
            (address.ws_url, launched_create(**ASK)),
        ):
            async with connect(url) as client:
                await client.send(frame)
                error = await client.receive()
                assert error["type"] == "error"
                assert (error["error"]["code"], error["error"]["param"]) == (
                    "unsupported_logprobs",
                    "include",
                )
                assert "remove it from `include`" in error["error"]["message"]
                await client.send(frame | {"include": []})  # the connection lives on
                assert (await client.until("response.completed"))[-1]["response"]["output"]
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{address.http_url}/responses", json=body(**ASK))
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "unsupported_logprobs"


@pytest.mark.parametrize("top", [-1, 21, 1000])
def test_top_logprobs_out_of_range_is_refused_as_openai_does(top: int) -> None:
    frame = orjson.dumps({"type": "response.create", "top_logprobs": top})
    with pytest.raises(ProtocolError) as refused:
        check_create(decode_client_event(frame))  # type: ignore[arg-type]
    detail = refused.value.detail
    assert (detail.code, detail.param) == ("invalid_field", "top_logprobs")
    assert "from 0 to 20" in detail.message


async def test_top_logprobs_out_of_range_is_refused_over_http(start_server: StartServer) -> None:
    running = await start_server(SCRIPT)
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(
                f"{running.address.http_url}/responses", json=body(**ASK | {"top_logprobs": 21})
            )
    assert answer.status_code == 400
    assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == (
        "invalid_field",
        "top_logprobs",
    )


# -- the generators' side -----------------------------------------------------------------------


def entry(token: int) -> Logprob:
    return TokenPieces(lambda t: bytes([t])).logprob(token, -token / 100, [])


def test_the_trail_gives_each_text_delta_the_logprobs_of_its_own_tokens() -> None:
    """Tokens a call or the segment's end carries take theirs with them: the text after them
    gets its own."""
    trail = Trail()
    for t in range(65, 75):
        trail.add(t, -t / 100, entry(t))
    chunks = trail.attach(
        [
            TextDelta("AB", 2),
            ToolCallBegin("f", 1),
            ToolCallArgumentsDelta("{}", 3),
            TextDelta("GHI", 3),
            SegmentEnd(tokens=1),
        ]
    )
    texts = [chunk for chunk in chunks if isinstance(chunk, TextDelta)]
    assert [[e.token for e in chunk.logprobs] for chunk in texts] == [["A", "B"], ["G", "H", "I"]]
    assert trail.attach([TextDelta("x", 1)]) == [TextDelta("x", 1)]  # none left: none given


def test_the_engines_streamed_logprobs_are_read_by_token_id() -> None:
    line = orjson.dumps(
        {
            "choices": [
                {
                    "text": "Hi",
                    "token_ids": [5, 9],
                    "finish_reason": None,
                    "logprobs": {
                        "tokens": ["token_id:5", "token_id:9"],
                        "token_logprobs": [-0.5, -2.0],
                        # the sampled token first, then the likeliest
                        "top_logprobs": [
                            {"token_id:5": -0.5, "token_id:7": -1.5},
                            {"token_id:9": -2.0, "token_id:3": -0.25, "token_id:4": -1.0},
                        ],
                        "text_offset": [0, 1],
                    },
                }
            ]
        }
    )
    piece = parse_sse(b"data: " + line)
    assert piece == Piece(
        "Hi",
        (5, 9),
        None,
        ((-0.5, ((5, -0.5), (7, -1.5))), (-2.0, ((3, -0.25), (4, -1.0), (9, -2.0)))),
    )


# -- a real client --------------------------------------------------------------------------


def sdk_logprobs(http_url: str) -> tuple[Any, list[Any]]:
    """openai-python over HTTP, then over its WebSocket mode."""
    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    over_http = client.responses.create(
        model="gpt-test",
        input="fix it",
        tools=[EXEC_COMMAND],  # type: ignore[list-item]
        include=["message.output_text.logprobs"],
        top_logprobs=TOP,
    )
    events = []
    with client.responses.connect() as connection:
        connection.response.create(
            model="gpt-test",
            input="fix it",
            store=False,
            include=["message.output_text.logprobs"],
            top_logprobs=TOP,
        )
        for event in connection:
            events.append(event)
            if event.type in ("response.completed", "response.failed", "error"):
                break
    return over_http, events


async def test_the_openai_sdk_reads_the_logprobs_over_http_and_its_websocket(
    start_server: StartServer,
) -> None:
    running = await start_server(SCRIPT)
    with trio.fail_after(60):
        over_http, events = await in_thread(sdk_logprobs, running.address.http_url)
    part = over_http.output[0].content[0]
    assert part.text == ANSWER
    said = [entry.model_dump() for entry in part.logprobs]
    assert_logprobs(ANSWER, said)
    assert part.logprobs[0].top_logprobs[0].token == part.logprobs[0].token
    final = events[-1].response.output[0].content[0]
    assert [entry.model_dump() for entry in final.logprobs] == said
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [entry.model_dump() for e in deltas for entry in e.logprobs] == said


async def test_a_prototype_response_resumed_from_the_store_keeps_saying_logprobs(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Its connection gone, the suspended Response is rebuilt cold on another one (the store
    keeps that its create asked for logprobs): the answer after the calls says them too."""
    running = await start_server(TOOL_THEN_ANSWER, store=SQLiteStore(tmp_path / "s.sqlite3"))
    with trio.fail_after(20):
        _, rest = await resumed_elsewhere(running, create(**ASK))
    assert [t.source for t in running.server.responses.turns] == ["store"]
    assert_logprobs(ANSWER, message_logprobs(rest))
