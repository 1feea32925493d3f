"""`--generator vllm` against a real vLLM (CPU build) serving SmolLM2-135M-Instruct.

One engine serves the whole session (tests/support/engine.py); each test starts its own
proto-server in front of it. Prompts stay short: the CPU engine prefills a few hundred tokens
a second.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine.chunks import Chunk, TextDelta
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.model_files import LoadedTokenizer, load_tokenizer
from proto_server.engine.vllm import (
    VllmGenerator,
    answer_format,
    discover,
    forced_call_format,
    forced_call_head,
    strict_call_format,
)
from proto_server.engine.vllm.protocol import parse_sse
from proto_server.server.listener.app import BoundAddress, ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.wire.items import Message
from proto_server.wire.tools import FunctionTool

from ..support.clients import TERMINAL, Checked, in_thread, model_connect, sse
from ..support.engine import BLOCK_SIZE, SERVED_NAME, Engine, grammar_accepts
from ..support.frames import launched_create
from ..support.servers import read_line

# its own deadlines (up to 300 s, for a busy CPU decoding) name what each test waits for
# the engine serves SmolLM2 as the project's loader converts it (transformers: the model extra)
pytestmark = [pytest.mark.engine, pytest.mark.model, pytest.mark.deadline(400)]

RUN = "exec_command"
TOOL = {
    "type": "function",
    "name": RUN,
    "description": "Run a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
    "strict": False,
}
ASK = "List the files in the current directory."
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"
ITERATION = "vllm:iteration_tokens_total"


@pytest.fixture(scope="session")
def vllm_tokenizer(vllm_engine: Engine) -> LoadedTokenizer:
    return load_tokenizer(vllm_engine.model_dir)


class Served:
    def __init__(self, server: ProtoServer, address: BoundAddress, generator: VllmGenerator):
        self.server = server
        self.address = address
        self.generator = generator

    @property
    def prototype_url(self) -> str:
        return f"{self.address.ws_url}?dialect=prototype"


StartVllm = Callable[..., Any]


@pytest.fixture
async def start_vllm(
    nursery: trio.Nursery, vllm_engine: Engine, vllm_tokenizer: LoadedTokenizer
) -> AsyncIterator[StartVllm]:
    """`await start_vllm(max_tokens=..., timeout_s=...)`: a proto-server in front of the engine."""
    generators: list[VllmGenerator] = []

    async def start(
        *, max_tokens: int = 48, timeout_s: float = 60.0, connections: int = 64, **config: Any
    ) -> Served:
        with trio.fail_after(10):
            model = await discover(vllm_engine.url, None)
        generator = VllmGenerator(
            vllm_engine.url,
            model,
            vllm_tokenizer,
            max_tokens=max_tokens,
            timeout_s=timeout_s,
            connections=connections,
        )
        generators.append(generator)
        server = ProtoServer(generator, ServerConfig(port=0, default_model=model.name, **config))
        address = await nursery.start(server.serve)
        return Served(server, address, generator)

    yield start
    for generator in generators:
        await generator.aclose()


def segment_usage(events: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(prompt, cached, output) tokens of each segment, from the cumulative usage of the
    Response at each `response.done` and at its end."""
    marks = [e["response"]["usage"] for e in events if e["type"] in {"response.done", *TERMINAL}]
    result, before = [], (0, 0, 0)
    for usage in marks:
        now = (
            usage["input_tokens"],
            usage["input_tokens_details"]["cached_tokens"],
            usage["output_tokens"],
        )
        result.append((now[0] - before[0], now[1] - before[1], now[2] - before[2]))
        before = now
    return result


def calls_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def assert_warm(segments: list[tuple[int, int, int]]) -> None:
    """Every resumed segment found the previous segment's prompt in the engine's cache (the
    engine counts whole blocks: at most one block short of it)."""
    for (previous, _, _), (_, cached, _) in itertools.pairwise(segments):
        assert cached >= previous - BLOCK_SIZE, segments


async def test_a_prototype_rollout_forced_twice_then_free_is_served_warm(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    served = await start_vllm()
    events: list[dict[str, Any]] = []
    with trio.fail_after(180):
        async with model_connect(served.prototype_url) as client:
            await client.send(
                {
                    "type": "response.create",
                    "input": ASK,
                    "tools": [TOOL],
                    "tool_choice": "required",
                    "temperature": 0,
                }
            )
            for round_ in range(2):
                segment = await client.until("response.done", *TERMINAL)
                events += segment
                assert segment[-1]["type"] == "response.done", segment[-1]
                outputs = [
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}
                    for call in calls_of(segment)
                ]
                assert outputs, "a forced segment made no call"
                append: dict[str, Any] = {"type": "response.append", "input": outputs}
                if round_ == 1:
                    append["tool_choice"] = "none"  # the rest of the Response answers in text
                await client.send(append)
            last = await client.until(*TERMINAL)
            events += last
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), final
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    assert final["tool_choice"] == "none"
    calls = calls_of(events)
    assert len(calls) >= 2 and not calls_of(last)
    for call in calls:
        assert call["name"] == RUN
        jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    segments = segment_usage(events)
    assert len(segments) == 3
    print("segments (prompt, cached, output):", segments)
    assert segments[0][1] == 0  # nothing was warm (the session's own cache may hold the start)
    assert_warm(segments)
    await wait_running(vllm_engine, 0, timeout_s=10)  # nothing left on the engine (it lags a step)


async def test_a_forced_call_streams_before_the_segment_ends(start_vllm: StartVllm) -> None:
    """Under structured outputs the call cannot be invalid: its item opens at the arguments and
    they stream as the engine decodes them, instead of all at the segment's end."""
    served = await start_vllm()
    arrivals: list[tuple[float, dict[str, Any]]] = []
    with trio.fail_after(120):
        async with model_connect(served.prototype_url) as client:
            await client.send(
                {
                    "type": "response.create",
                    "input": ASK,
                    "tools": [TOOL],
                    "tool_choice": {"type": "function", "name": RUN},
                    "temperature": 0,
                }
            )
            while not arrivals or arrivals[-1][1]["type"] not in ("response.done", *TERMINAL):
                event = await client.receive()
                arrivals.append((trio.current_time(), event))
    events = [event for _, event in arrivals]
    assert events[-1]["type"] == "response.done", events[-1]
    (call,) = calls_of(events)
    jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    added = next(at for at, e in arrivals if e["type"] == "response.output_item.added")
    deltas = [at for at, e in arrivals if e["type"] == "response.function_call_arguments.delta"]
    closed = next(at for at, e in arrivals if e["type"] == "response.function_call_arguments.done")
    print(f"call open {closed - added:.3f} s before its arguments closed, {len(deltas)} deltas")
    assert len(deltas) > 1
    # not all at once at the close: they arrive over most of the time the arguments took to
    # decode (relative, as a fast engine decodes them in milliseconds; at once: microseconds)
    assert closed - added > 0.002 and deltas[-1] - deltas[0] > 0.5 * (closed - added)


CITIES = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
#: One call already in the history: SmolLM2 then calls again on its own, under `auto`.
WEATHER_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "Sunny, 21 C."},
    {"role": "assistant", "content": "It is sunny in Paris, 21 C."},
    {"role": "user", "content": "And what is the weather in Berlin?"},
]  # fmt: skip


@pytest.mark.parametrize("strict", [True, False])
async def test_a_strict_tool_under_auto_is_called_within_its_schema(
    start_vllm: StartVllm, strict: bool
) -> None:
    """Under `auto` the model chooses whether to call; a call it opens to a `strict` tool is
    held to the tool's schema by the engine (a structural tag): asked for Berlin, it can only
    name a city the schema allows. Without `strict` it names Berlin: the grammar did that."""
    served = await start_vllm()
    tool = {"type": "function", "name": "get_weather", "description": "Get the weather of a city.",
            "parameters": CITIES, "strict": strict}  # fmt: skip
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(120):
            answer = await http.post(
                "/responses",
                json={"model": SERVED_NAME, "input": WEATHER_HISTORY, "tools": [tool],
                      "tool_choice": "auto", "temperature": 0},
            )  # fmt: skip
    assert answer.status_code == 200, answer.text
    (call,) = [item for item in answer.json()["output"] if item["type"] == "function_call"]
    arguments = json.loads(call["arguments"])
    if strict:
        jsonschema.validate(arguments, CITIES)
    else:
        assert arguments == {"city": "Berlin"}


#: A structured answer: a city the schema allows.
CITY_ANSWER = TextFormat(kind="json_schema", schema=CITIES, strict=True)


async def test_a_json_schema_answer_on_the_engine_is_an_instance(start_vllm: StartVllm) -> None:
    """`text.format` json_schema through proto-server on the real engine (SmolLM2): asked for
    Berlin, the answer is JSON naming a city the schema allows, streamed as text deltas; a
    `json_object` answer is an object; a schema no grammar takes is a 400 naming its path."""
    served = await start_vllm(max_tokens=96)
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITIES, "strict": True}}
    request = {"model": SERVED_NAME, "input": "Which city is the capital of Germany? Answer as "
               "JSON.", "temperature": 0, "stream": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(120):
            events = await sse(http, "/responses", {**request, "text": text})
            other = await sse(
                http, "/responses", {**request, "text": {"format": {"type": "json_object"}}}
            )
            bad = {"type": "object", "properties": {"city": {"type": "bogus"}}}
            refused = await http.post(
                "/responses",
                json={**request, "text": {"format": {**text["format"], "schema": bad}}},
            )
    # a schema no grammar takes: refused before anything reaches the engine
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "text.format.schema.properties.city"
    assert events[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    jsonschema.validate(json.loads(deltas), CITIES)
    assert output_text(events[-1]["response"]) == deltas
    assert other[-1]["type"] == "response.completed"
    assert isinstance(json.loads(output_text(other[-1]["response"])), dict)


def test_the_call_structures_accept_exactly_the_calls_allowed(vllm_engine: Engine) -> None:
    """What follows a forced call's head, and a block under `auto`, as the engine's xgrammar
    reads the structures this server sends: valid calls pass, others do not."""
    weather = FunctionTool(name="get_weather", parameters=CITIES, strict=True)
    run = FunctionTool(name=RUN, parameters=TOOL["parameters"])
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    cases = [  # (structure, [(text, accepted)])
        (forced_call_format([weather], None), [
            (' {"city": "Paris"}}]</tool_call>', True),
            (f' {{"city": "Paris"}}}}, {call}]</tool_call>', True),
            (' {"city": "Berlin"}}]</tool_call>', False),
            (' {"city": "Paris"}]</tool_call>', False),
        ]),
        (forced_call_format([weather], 1), [
            (' {"city": "Paris"}}]</tool_call>', True),
            (f' {{"city": "Paris"}}}}, {call}]</tool_call>', False),
        ]),
        (forced_call_format([weather, run], 2), [
            (f'{RUN}", "arguments": {{"cmd": "ls"}}}}]</tool_call>', True),
            (f'{RUN}", "arguments": {{"cmd": "ls"}}}}, {call}]</tool_call>', True),
            (f'{RUN}", "arguments": {{"cwd": "/"}}}}]</tool_call>', False),
            ('read_file", "arguments": {}}]</tool_call>', False),
        ]),
        (strict_call_format([weather, run], None), [
            ("No call, only text.", True),
            (f"Let me look. <tool_call>[{call}]</tool_call>", True),
            ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>',
             False),
            (f'<tool_call>[{{"name": "{RUN}", "arguments": {{"any": 1}}}}]</tool_call>', True),
        ]),
        (answer_format(CITY_ANSWER, [], None), [
            ('{"city": "Paris"}', True),
            ('{"city": "Berlin"}', False),
            ("Paris", False),
            (f"<tool_call>[{call}]</tool_call>", False),
        ]),
        (answer_format(CITY_ANSWER, [weather], 1), [
            ('{"city": "Rome"}', True),
            (f"<tool_call>[{call}]</tool_call>", True),
            (f"<tool_call>[{call}, {call}]</tool_call>", False),
            ("Rome", False),
        ]),
    ]  # fmt: skip
    assert forced_call_head([weather]) == '<tool_call>[{"name": "get_weather", "arguments":'
    assert forced_call_head([weather, run]) == '<tool_call>[{"name": "'
    accepted = grammar_accepts(vllm_engine.python, vllm_engine.model_dir, cases)
    assert accepted == [[want for _, want in texts] for _, texts in cases]


async def test_an_evicted_suspended_response_holds_nothing_on_the_engine(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    """A suspended Response has no request on the engine (its state is the engine's prefix
    cache); evicting it past `--max-suspended` ends it `incomplete` and leaves the engine idle,
    and the Response that took its place resumes warm."""
    served = await start_vllm(max_suspended_rollouts=1)
    create = {"type": "response.create", "input": ASK, "tools": [TOOL],
              "tool_choice": "required", "temperature": 0}  # fmt: skip
    with trio.fail_after(180):
        async with (
            model_connect(served.prototype_url) as first,
            model_connect(served.prototype_url) as second,
        ):
            await first.send(create)
            assert (await first.until("response.done", *TERMINAL))[-1]["type"] == "response.done"
            await second.send({**create, "input": f"{ASK} Then read README.md."})
            segment = await second.until("response.done", *TERMINAL)
            assert segment[-1]["type"] == "response.done"
            evicted = (await first.until(*TERMINAL))[-1]
            assert evicted["type"] == "response.incomplete"
            assert evicted["response"]["incomplete_details"] == {
                "reason": "suspended_rollout_limit"
            }
            await wait_running(vllm_engine, 0, timeout_s=10)  # the gauge lags a step
            outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
                       for c in calls_of(segment)]  # fmt: skip
            await second.send({"type": "response.append", "input": outputs, "tool_choice": "none"})
            rest = await second.until(*TERMINAL)
    assert rest[-1]["type"] in ("response.completed", "response.incomplete"), rest[-1]
    assert_warm(segment_usage([*segment, *rest]))
    await wait_running(vllm_engine, 0, timeout_s=10)  # the gauge lags a step


def sdk_chain(http_url: str, turns: int) -> list[Any]:
    """Four turns through the official SDK's WebSocket: each a `response.create` chained by
    `previous_response_id`, the tool's output as the next input."""
    from openai import OpenAI

    client = OpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
    responses: list[Any] = []
    with client.responses.connect() as connection:
        previous = None
        items: Any = ASK
        for turn in range(turns):
            connection.response.create(
                model=SERVED_NAME,
                input=items,
                tools=[TOOL],
                tool_choice="required" if turn < turns - 1 else "none",
                previous_response_id=previous,
                temperature=0,
                store=False,
            )
            for event in connection:
                if event.type == "error":
                    raise AssertionError(f"turn {turn}: {event.error}")
                if event.type in ("response.completed", "response.incomplete", "response.failed"):
                    response = event.response
                    break
            if response.status != "completed":
                raise AssertionError(f"turn {turn}: {response.status}: {response.model_dump()}")
            responses.append(response)
            previous = response.id
            items = [
                {"type": "function_call_output", "call_id": item.call_id, "output": "a.py"}
                for item in response.output
                if item.type == "function_call"
            ]
    return responses


async def test_a_launched_chain_through_the_openai_sdk_is_served_warm(
    start_vllm: StartVllm,
) -> None:
    served = await start_vllm(max_tokens=64)
    with trio.fail_after(240):
        responses = await in_thread(sdk_chain, served.address.http_url, 4)
    assert [r.status for r in responses] == ["completed"] * 4, [r.error for r in responses]
    for response in responses[:3]:
        (call, *_) = [item for item in response.output if item.type == "function_call"]
        jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    assert not [item for item in responses[3].output if item.type == "function_call"]
    segments = [
        (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens)
        for r in responses
    ]
    print("turns (prompt, cached, output):", segments)
    assert_warm(segments)
    assert [t.source for t in served.server.responses.turns] == ["fresh", "cache", "cache", "cache"]


async def test_stateless_http_turns_reuse_the_engine_cache_and_readyz_says_ready(
    start_vllm: StartVllm,
) -> None:
    served = await start_vllm(max_tokens=16)
    ask = f"Say hello. ({uuid.uuid4().hex[:8]})"
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(120):
            first = await http.post(
                "/responses", json={"model": SERVED_NAME, "input": ask, "temperature": 0}
            )
            assert first.status_code == 200, first.text
            body = first.json()
            history = [{"role": "user", "content": ask}, *body["output"]]
            history.append({"role": "user", "content": "Now say goodbye."})
            async with http.stream(
                "POST",
                "/responses",
                json={"model": SERVED_NAME, "input": history, "stream": True, "temperature": 0},
            ) as second:
                lines = [line async for line in second.aiter_lines() if line.startswith("data:")]
    events = [json.loads(line[5:]) for line in lines]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    texts = [output_text(body), output_text(events[-1]["response"])]
    assert all(texts) and not any("<|im_end|>" in text for text in texts), texts
    usage = [body["usage"], events[-1]["response"]["usage"]]
    print("stateless turns:", usage)
    assert usage[0]["input_tokens_details"]["cached_tokens"] == 0
    # stateless, yet the engine's prefix cache kept the first request's blocks
    assert usage[1]["input_tokens_details"]["cached_tokens"] >= (
        usage[0]["input_tokens"] - BLOCK_SIZE
    )
    root = served.address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=10) as http:
        ready = await http.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


async def test_the_engines_models_token_counts_and_references_on_the_engine(
    start_vllm: StartVllm,
) -> None:
    """The rest of the surface on the real engine: its own model list, and input tokens counted
    with the real tokenizer and chat template, as a create is served (a reference too)."""
    served = await start_vllm(max_tokens=8)
    ask = f"Say hello. ({uuid.uuid4().hex[:8]})"
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(120):
            models = (await http.get("/models")).json()
            counted = await http.post("/responses/input_tokens", json={"input": ask})
            created = await http.post(
                "/responses", json={"model": SERVED_NAME, "input": ask, "temperature": 0}
            )
            assert created.status_code == 200, created.text
            reply = created.json()["output"][0]
            user = {"type": "message", "role": "user", "content": ask}
            counts = [
                await http.post("/responses/input_tokens", json={"input": [user, item]})
                for item in (reply, {"type": "item_reference", "id": reply["id"]})
            ]
    (listed,) = [model for model in models["data"] if model["id"] == SERVED_NAME]
    assert listed["owned_by"] == "vllm" and listed["max_model_len"] > 0  # as vLLM lists it
    assert counted.json()["input_tokens"] == created.json()["usage"]["input_tokens"]
    inline, referenced = (count.json()["input_tokens"] for count in counts)
    assert referenced == inline > counted.json()["input_tokens"]


def decoded_to_end(engine: Engine) -> float:
    """Requests the engine decoded to their end (an aborted one is counted apart)."""
    return sum(
        engine.metric("vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length")
    )


async def wait_running(engine: Engine, value: float, timeout_s: float = 20) -> None:
    """Poll the engine's gauge of running requests until it reads `value`."""
    for _ in range(int(timeout_s * 10)):
        if await trio.to_thread.run_sync(engine.metric, RUNNING) == value:
            return
        await trio.sleep(0.1)
    raise AssertionError(f"{RUNNING} never read {value} within {timeout_s} s")


LONG_ASK = "Write a very long story about a dragon who learns to code. Use many chapters."


async def test_a_prompt_another_key_sent_is_not_in_the_engine_cache_for_this_one(
    start_vllm: StartVllm,
) -> None:
    """Each key's requests carry its own `cache_salt`: the engine's prefix cache keeps tenants
    apart (its `cached_tokens` would tell one what another sent), and a key finds its own."""
    served = await start_vllm(max_tokens=4, api_keys=("k1", "k2"))
    # the system prompt and the words are the same for both keys: only the salt differs
    ask = f"{LONG_ASK} ({uuid.uuid4().hex[:8]}) " + "Remember this plan. " * 12
    cached = []
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(120):
            for key in ("k1", "k2", "k1", "k2"):
                answer = await http.post(
                    "/responses",
                    json={"model": SERVED_NAME, "input": ask, "temperature": 0, "store": False},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert answer.status_code == 200, answer.text
                usage = answer.json()["usage"]
                cached.append(usage["input_tokens_details"]["cached_tokens"])
    print("cached tokens, k1 k2 k1 k2:", cached, "of", usage["input_tokens"])
    assert cached[0] == 0 and cached[1] == 0  # nothing of k1's prompt is warm for k2
    assert cached[2] >= usage["input_tokens"] - BLOCK_SIZE and cached[3] == cached[2]


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_a_cancel_or_a_disconnect_aborts_the_engine_request(
    start_vllm: StartVllm, vllm_engine: Engine, how: str
) -> None:
    # a disconnect aborts at once with --reattach-grace 0; under a grace the Response runs on
    # for a reattach (tests/server/test_reattach.py), and is cut, aborting it, once that lapses
    served = await start_vllm(max_tokens=512, reattach_grace_s=0)
    before = await trio.to_thread.run_sync(decoded_to_end, vllm_engine)
    with trio.fail_after(120):
        async with model_connect(served.prototype_url) as client:
            await client.send({"type": "response.create", "input": LONG_ASK, "temperature": 0})
            # the engine is decoding this Response (a fast one, 511 tokens to go: a second)
            await client.until("response.output_text.delta")
            if how == "cancel":
                await client.send({"type": "response.cancel"})
                events = await client.until(*TERMINAL)
                assert events[-1]["type"] == "response.cancelled"
            else:
                await client.vanish()  # the TCP goes, no close frame
        await wait_running(vllm_engine, 0, timeout_s=10)
        await served.server.wait_idle()
    assert await trio.to_thread.run_sync(decoded_to_end, vllm_engine) == before  # aborted


async def test_a_steer_aborts_the_engine_request_and_its_successor_is_served_warm(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    """`response.steer` on the engine: the steered segment's stream is closed, so vLLM aborts
    it (never two requests running: the successor's is the only one), and the successor the
    server starts by itself finds the steered Response's prompt in the engine's cache."""
    served = await start_vllm(max_tokens=256)  # the successor says "done." and stops
    running: list[float] = []
    before = await trio.to_thread.run_sync(decoded_to_end, vllm_engine)

    async def sample(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            running.append(await trio.to_thread.run_sync(vllm_engine.metric, RUNNING))
            await trio.sleep(0.05)

    with trio.fail_after(180):
        async with model_connect(served.address.ws_url) as raw, trio.open_nursery() as nursery:
            client = Checked(raw)
            await client.send(
                launched_create(input=LONG_ASK, model=SERVED_NAME, tools=[], temperature=0)
            )
            events = await client.until_lane(None, "response.output_text.delta")
            first = events[0]["response"]  # the engine is decoding it: 255 tokens to go
            steer = {"type": "response.steer", "previous_response_id": first["id"],
                     "input": "Stop the story. Say only: done."}  # fmt: skip
            await client.send(steer)
            await nursery.start(sample)
            events += await client.until_lane(None, "response.incomplete")
            steered = events[-1]["response"]
            events += await client.until_lane(None, "response.completed", "response.incomplete")
            client.checker.finish()
            nursery.cancel_scope.cancel()
        await wait_running(vllm_engine, 0, timeout_s=10)
    assert steered["id"] == first["id"]
    assert steered["incomplete_details"] == {"reason": "steered"}
    follower = events[-1]["response"]
    assert follower["id"] != first["id"] and follower["previous_response_id"] == first["id"]
    print("requests running, from the steer to the successor's end:", running)
    assert max(running) <= 1  # never the steered request beside its successor
    # of the two requests, only the successor's was decoded to its end: the other was aborted
    assert await trio.to_thread.run_sync(decoded_to_end, vllm_engine) == before + 1
    prompt = steered["usage"]["input_tokens"]
    cached = follower["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= prompt - BLOCK_SIZE, (prompt, cached)  # warm: its prompt was cached


async def test_a_shutdown_mid_stream_aborts_the_engine_request(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    served = await start_vllm(max_tokens=512)
    before = await trio.to_thread.run_sync(decoded_to_end, vllm_engine)
    with trio.fail_after(60):
        async with model_connect(served.prototype_url) as client:
            await client.send({"type": "response.create", "input": LONG_ASK, "temperature": 0})
            await client.until("response.output_text.delta")  # the engine is decoding it
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(served.server.shutdown, grace_s=0))
                events = await client.until(*TERMINAL)
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["incomplete_details"] == {"reason": "server_shutdown"}
        await wait_running(vllm_engine, 0, timeout_s=10)
    assert await trio.to_thread.run_sync(decoded_to_end, vllm_engine) == before  # aborted


async def test_a_launched_warm_up_fills_the_engine_cache_for_the_turn(
    start_vllm: StartVllm,
) -> None:
    """`generate: false` prefills on the engine (one token decoded and dropped); the chained
    turn then finds the whole warm-up prompt cached."""
    served = await start_vllm(max_tokens=8)
    nonce = uuid.uuid4().hex  # nothing of it is in the engine's cache yet
    with trio.fail_after(60):
        async with model_connect(served.address.ws_url) as client:
            await client.send(
                {"type": "response.create", "input": f"{nonce} {LONG_ASK}", "generate": False}
            )
            warm = (await client.until(*TERMINAL))[-1]["response"]
            await client.send(
                {
                    "type": "response.create",
                    "input": "Begin.",
                    "previous_response_id": warm["id"],
                    "temperature": 0,
                }
            )
            turn = (await client.until(*TERMINAL))[-1]["response"]
    assert warm["status"] == "completed" and warm["output"] == []
    assert warm["usage"]["input_tokens_details"]["cached_tokens"] < BLOCK_SIZE * 2
    cached = turn["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= warm["usage"]["input_tokens"] - BLOCK_SIZE, (warm["usage"], turn["usage"])


async def test_max_output_tokens_is_honoured(start_vllm: StartVllm) -> None:
    served = await start_vllm(max_tokens=256)
    with trio.fail_after(60):
        async with model_connect(served.prototype_url) as client:
            await client.send(
                {
                    "type": "response.create",
                    "input": LONG_ASK,
                    "max_output_tokens": 5,
                    "temperature": 0,
                }
            )
            events = await client.until(*TERMINAL)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 5


async def test_a_prompt_over_the_context_fails_context_length_exceeded_and_the_next_works(
    start_vllm: StartVllm,
) -> None:
    served = await start_vllm(max_tokens=8)
    with trio.fail_after(90):
        async with model_connect(served.prototype_url) as client:
            await client.send({"type": "response.create", "input": "word " * 9000})
            events = await client.until(*TERMINAL)
            assert events[-1]["type"] == "response.failed"
            error = events[-1]["response"]["error"]
            assert error["code"] == "context_length_exceeded", error
            await client.send({"type": "response.create", "input": "Hi", "temperature": 0})
            events = await client.until(*TERMINAL)
            assert events[-1]["type"] in ("response.completed", "response.incomplete")


async def test_an_engine_that_stalls_fails_engine_timeout(start_vllm: StartVllm) -> None:
    # a read timeout far below the prefill of a cold prompt: the engine stays silent too long
    served = await start_vllm(timeout_s=0.05)
    nonce = uuid.uuid4().hex
    with trio.fail_after(60):
        async with model_connect(served.prototype_url) as client:
            await client.send(
                {"type": "response.create", "input": f"{nonce} {LONG_ASK} " * 8, "tools": [TOOL]}
            )
            events = await client.until(*TERMINAL)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "engine_timeout"


async def test_the_benchmark_runs_every_path_on_the_same_engine(
    vllm_engine: Engine, vllm_tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """`proto-server bench vllm`, small: three turns through each of the five paths, with
    proto-server as a process of its own; every path gives numbers, and the files are there."""
    from proto_server_bench.paths import CALL_TOKENS, OURS, PATHS
    from proto_server_bench.vllm import PLOTS, measure
    from proto_server_bench.vllm_report import render, summarize, write_files

    assert vllm_engine.process is not None
    with trio.fail_after(300):
        results = await measure(
            engine_url=vllm_engine.url,
            engine_pid=vllm_engine.process.pid,
            model=SERVED_NAME,
            tokenizer=vllm_tokenizer.tokenizer,
            turns=3,
            tool_output_tokens=60,
            answer_tokens=32,
            nonce=uuid.uuid4().hex[:8],
        )
    summary = summarize(results)
    print(render(results, summary))
    assert summary["failed"] == {}
    for path in PATHS:
        turns = results[path]
        assert isinstance(turns, list) and [t.turn for t in turns] == [1, 2, 3]
        for t in turns:
            most = 32 if path in OURS or not t.called else CALL_TOKENS
            assert t.prompt_tokens > 0 and 0 < t.output_tokens <= most
            assert 0 < t.ttft_s <= t.turn_s and t.client_bytes > 0
            assert t.api_server_cpu_ms >= 0 and t.proto_cpu_ms >= 0
        assert turns[2].cached_tokens > 0  # the engine's prefix cache, on every path
        # forced, forced, the answer: on vLLM's own paths too (its hermes tool parser)
        assert [t.called for t in turns] == [True, True, False]
        assert all(t.valid for t in turns if t.called), path  # the tool is strict
    for path in OURS:
        turns = results[path]
        assert_warm([(t.prompt_tokens, t.cached_tokens, t.output_tokens) for t in turns])
    assert set(summary["goals"]) == set(OURS)
    plots = write_files(results, summary, tmp_path)
    assert plots == [tmp_path / name for name in PLOTS]
    assert all(path.stat().st_size > 0 for path in plots)
    assert json.loads((tmp_path / "bench-vllm.json").read_text())["turns"].keys() == set(PATHS)


async def test_temperature_top_p_and_seed_reach_the_engine(start_vllm: StartVllm) -> None:
    """Sampled at temperature 1: one seed gives one text, other seeds others; a top_p so small
    that only the likeliest token is left gives the greedy text whatever the seed."""
    served = await start_vllm(max_tokens=24)
    ask = "Write a short poem about the sea."

    async def text(**sampling: Any) -> str:
        body = {"model": SERVED_NAME, "input": ask, "store": False, **sampling}
        answer = await http.post("/responses", json=body)
        assert answer.status_code == 200, answer.text
        response = answer.json()
        if "seed" in sampling:
            assert response["seed"] == sampling["seed"]
        return "".join(
            part["text"]
            for item in response["output"]
            if item["type"] == "message"
            for part in item["content"]
        )

    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=60) as http:
        with trio.fail_after(180):
            first = await text(temperature=1.0, seed=7)
            again = await text(temperature=1.0, seed=7)
            others = [await text(temperature=1.0, seed=seed) for seed in (8, 9, 10)]
            greedy = await text(temperature=0)
            narrow = [await text(temperature=1.0, top_p=1e-6, seed=seed) for seed in (8, 9)]
    print("seed 7:", first, "| seeds 8-10:", others, "| greedy:", greedy)
    assert first and first == again
    assert any(other != first for other in others)
    assert narrow == [greedy, greedy]


def multi_token_steps(engine: Engine) -> float:
    """Engine steps so far that computed more than one token (a prefill, or a decode of two
    requests side by side), from vLLM's tokens-per-iteration histogram."""
    return engine.metric(f"{ITERATION}_count") - engine.metric(f"{ITERATION}_bucket", le="1.0")


@pytest.mark.parametrize("connections", [1, 2])
async def test_engine_connections_bounds_the_requests_on_the_engine(
    start_vllm: StartVllm, vllm_engine: Engine, connections: int
) -> None:
    """Two Responses at once both complete; with a pool of one connection they run one after
    the other on the engine (no engine step decodes both: the only steps of more than one token
    are the two prefills), with two side by side (steps decode both)."""
    served = await start_vllm(max_tokens=64, connections=connections)
    seen: list[float] = []
    done: list[str] = []

    async def respond(http: httpx.AsyncClient, nonce: int) -> None:
        body = {"model": SERVED_NAME, "input": f"{LONG_ASK} ({nonce})", "temperature": 0}
        answer = await http.post("/responses", json=body)
        assert answer.status_code == 200, answer.text
        done.append(answer.json()["status"])

    generated = await trio.to_thread.run_sync(vllm_engine.metric, GENERATED)
    multi_before = await trio.to_thread.run_sync(multi_token_steps, vllm_engine)
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=120) as http:
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(respond, http, 1)
                nursery.start_soon(respond, http, 2)
                while len(done) < 2:
                    seen.append(await trio.to_thread.run_sync(vllm_engine.metric, RUNNING))
                    await trio.sleep(0.05)
            # the engine counts a step's tokens after it sends them: wait for the last count
            for _ in range(100):
                if await trio.to_thread.run_sync(vllm_engine.metric, GENERATED) >= generated + 128:
                    break
                await trio.sleep(0.05)
    multi_after = await trio.to_thread.run_sync(multi_token_steps, vllm_engine)
    multi = multi_after - multi_before
    print(f"running requests seen: {sorted(set(seen))} over {len(seen)} samples; {multi:g} steps")
    assert done == ["incomplete", "incomplete"]  # each decoded its 64 tokens
    assert vllm_engine.metric(GENERATED) == generated + 128
    assert max(seen) <= connections
    if connections == 1:
        assert multi == 2  # each request's prefill, alone
    else:
        assert multi > 2  # side by side: steps that decoded both (64 here; fewer if one is late)


@pytest.mark.parametrize(
    ("flags", "admits"), [((), True), (("--no-kv-capacity-from-engine",), False)]
)
async def test_serve_finds_the_engine_model_and_its_tokenizer(
    nursery: trio.Nursery, vllm_engine: Engine, flags: tuple[str, ...], admits: bool
) -> None:
    """The CLI: the served model and its tokenizer come from the engine (`root`), and by
    default rollouts are admitted by the KV cache the engine reports."""
    from proto_server.engine.vllm import engine_kv_capacity

    command = [
        sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:",
        "--generator", "vllm", "--engine-url", vllm_engine.url, *flags,
    ]  # fmt: skip
    with trio.fail_after(120):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        line = await read_line(process.stdout)
        assert "vLLM model smollm2" in line, line
        root = line.split("listening on ")[1].split(" ")[0].removesuffix("/v1")
        async with httpx.AsyncClient(base_url=root, timeout=10) as http:
            ready = await http.get("/readyz")  # and the signal handlers are installed by now
            exposition = (await http.get("/metrics")).text
        assert ready.status_code == 200, ready.text
        said = re.search(r"^proto_server_kv_capacity_tokens (\S+)$", exposition, re.MULTILINE)
        capacity = await engine_kv_capacity(vllm_engine.url)
        assert capacity is not None
        reported = float(said.group(1)) if said else 0.0
        assert reported == (int(capacity * ServerConfig().kv_target_fill) if admits else 0)
        process.terminate()
        assert await process.wait() == 0


async def test_the_engine_killed_mid_stream_fails_the_response_then_serves_once_back(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    """Last in the file: it restarts the session's engine (about a minute)."""
    served = await start_vllm(max_tokens=512)
    root = served.address.http_url.removesuffix("/v1")
    async with model_connect(served.prototype_url) as client:
        with trio.fail_after(60):
            await client.send({"type": "response.create", "input": LONG_ASK, "temperature": 0})
            await client.until("response.output_text.delta")
            await trio.to_thread.run_sync(vllm_engine.kill)
            events = await client.until(*TERMINAL)
        assert events[-1]["type"] == "response.failed"
        code = events[-1]["response"]["error"]["code"]
        assert code in ("engine_unavailable", "engine_error"), events[-1]
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=root, timeout=10) as http:
                down = await http.get("/readyz")
            assert down.status_code == 503
            assert down.json()["error"]["code"] == "engine_unavailable"
            await client.send({"type": "response.create", "input": "Hi"})
            events = await client.until(*TERMINAL)
            assert events[-1]["response"]["error"]["code"] == "engine_unavailable"
        await trio.to_thread.run_sync(vllm_engine.start)  # same port, as a supervisor would
        with trio.fail_after(60):
            await client.send({"type": "response.create", "input": "Hi", "temperature": 0})
            events = await client.until(*TERMINAL)
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    async with httpx.AsyncClient(base_url=root, timeout=10) as http:
        assert (await http.get("/readyz")).status_code == 200


async def test_the_engines_kv_capacity_is_the_size_it_logged(vllm_engine: Engine) -> None:
    """`--kv-capacity-from-engine` reads what the engine logged at start-up as its cache."""
    from proto_server.engine.vllm import engine_kv_capacity

    with trio.fail_after(10):
        capacity = await engine_kv_capacity(vllm_engine.url)
    logged = re.search(r"KV cache size: ([\d,]+) tokens", vllm_engine.log_path.read_text())
    assert logged is not None
    assert capacity == int(logged.group(1).replace(",", ""))


async def test_admitted_by_the_engines_capacity_with_priorities_a_rollout_is_served_warm(
    start_vllm: StartVllm, vllm_engine: Engine
) -> None:
    """Admission on (the capacity the engine says) and `priority` on every segment: an engine
    on the default policy takes the field, and the rollout resumes warm."""
    from proto_server.engine.vllm import engine_kv_capacity

    with trio.fail_after(10):
        capacity = await engine_kv_capacity(vllm_engine.url)
    assert capacity is not None
    served = await start_vllm(kv_capacity_tokens=capacity, engine_priority=True)
    events: list[dict[str, Any]] = []
    with trio.fail_after(180):
        async with model_connect(served.prototype_url) as client:
            create = {"type": "response.create", "input": ASK, "tools": [TOOL]}
            await client.send({**create, "tool_choice": "required", "temperature": 0})
            segment = await client.until("response.done", *TERMINAL)
            assert segment[-1]["type"] == "response.done", segment[-1]
            events += segment
            outputs = [
                {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}
                for call in calls_of(segment)
            ]
            await client.send({"type": "response.append", "input": outputs, "tool_choice": "none"})
            events += await client.until(*TERMINAL)
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert_warm(segment_usage(events))
    scheduler = served.server.responses.admission.scheduler
    assert scheduler.capacity == int(capacity * 0.9)


HELLO = "Say hello to the team in one sentence."


async def test_logprobs_are_the_engines_own_for_the_tokens_it_sampled(
    start_vllm: StartVllm,
) -> None:
    """A segment asked for logprobs (greedy) gives each text token the logprob and the top 5
    the engine computed; they equal the engine's own for those tokens, computed apart (its
    `prompt_logprobs` of the whole sequence, in one prefill), and the same Response over HTTP
    and the prototype WebSocket says the same."""
    served = await start_vllm(max_tokens=12)
    generator = served.generator
    conversation = Conversation(generator.renderer, instructions=None, tools=())
    conversation.extend([Message(role="user", content=HELLO)])
    prompt = conversation.turn_prompt(generator.renderer.generation_prompt)
    session = generator.open_session(conversation)
    limits = GenerationLimits(temperature=0.0, top_logprobs=5)
    send, receive = trio.open_memory_channel[Chunk](1000)
    with trio.fail_after(120):
        async with send:
            await session.generate(send, limits)
        chunks = [chunk async for chunk in receive]
    said = [entry for chunk in chunks if isinstance(chunk, TextDelta) for entry in chunk.logprobs]
    sampled = session.engine_ids[len(prompt) :]
    texts = [i for i in sampled if i not in generator.stop_ids]  # the turn's end has no logprob
    assert said and len(said) == len(texts), (said, sampled)
    text = "".join(chunk.text for chunk in chunks if isinstance(chunk, TextDelta))
    assert b"".join(bytes(entry.bytes) for entry in said) == text.encode()
    async with httpx.AsyncClient(base_url=served.address.http_url, timeout=120) as http:
        with trio.fail_after(180):
            async with httpx.AsyncClient(base_url=generator.url, timeout=120) as engine:
                own = await engine.post(
                    "/completions",
                    json={
                        "model": SERVED_NAME,
                        "prompt": [*prompt, *texts],
                        "max_tokens": 1,
                        "temperature": 0,
                        "prompt_logprobs": 5,
                    },
                )
            assert own.status_code == 200, own.text
            ask = {
                "model": SERVED_NAME,
                "input": HELLO,
                "temperature": 0,
                "max_output_tokens": 12,
                "include": ["message.output_text.logprobs"],
                "top_logprobs": 5,
                "store": False,
            }
            answer = await http.post("/responses", json=ask)
            assert answer.status_code == 200, answer.text
        async with model_connect(served.prototype_url) as client:
            await client.send({"type": "response.create", **ask})
            events = await client.until(*TERMINAL)
    positions = own.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
    pieces = generator.pieces
    for token, entry, engine_said in zip(texts, said, positions, strict=True):
        assert math.isclose(entry.logprob, engine_said[str(token)]["logprob"], abs_tol=1e-3)
        ranked = sorted(engine_said.items(), key=lambda kv: kv[1]["rank"])
        top = [(int(i), lp["logprob"]) for i, lp in ranked if lp["rank"] <= 5][:5]
        assert [other.bytes for other in entry.top_logprobs] == [pieces(i)[1] for i, _ in top]
        for other, (_, logprob) in zip(entry.top_logprobs, top, strict=True):
            assert math.isclose(other.logprob, logprob, abs_tol=1e-3)
    for response in (answer.json(), events[-1]["response"]):
        (part,) = response["output"][0]["content"]
        assert part["text"] == text
        assert len(part["logprobs"]) == len(said)
        for wire, entry in zip(part["logprobs"], said, strict=True):
            assert wire["bytes"] == list(entry.bytes)
            assert math.isclose(wire["logprob"], entry.logprob, abs_tol=1e-4)
            assert [o["bytes"] for o in wire["top_logprobs"]] == [
                list(o.bytes) for o in entry.top_logprobs
            ]


class EngineSaid:
    """What the engine itself streamed back, per request: the prompt ids it says it was sent
    and the ids it returned (`return_token_ids`), read from its raw stream."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], list[int]]] = []

    def parse(self, line: bytes | str) -> Any:
        text = line.decode() if isinstance(line, bytes) else line
        if text.startswith("data: {"):
            for choice in json.loads(text.removeprefix("data: ")).get("choices") or ():
                if choice.get("prompt_token_ids") is not None:
                    self.requests.append((choice["prompt_token_ids"], []))
                self.requests[-1][1].extend(choice.get("token_ids") or ())
        return parse_sse(line)


async def test_token_ids_are_what_the_engine_was_sent_and_returned(
    start_vllm: StartVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prototype rollout (a forced call, then a free answer) with `output.token_ids`: each
    segment's first item's prompt is the prompt vLLM says it was sent, and the items' ids, in
    order, are exactly what it returned, but for what follows a call (no item's); each item's
    prompt is the one before it and its ids; the logprobs are one per id."""
    said = EngineSaid()
    monkeypatch.setattr("proto_server.engine.vllm.session.parse_sse", said.parse)
    served = await start_vllm(max_tokens=16)
    create = {"type": "response.create", "input": ASK, "tools": [TOOL], "tool_choice": "required",
              "temperature": 0, "include": ["output.token_ids"]}  # fmt: skip
    with trio.fail_after(240):
        async with model_connect(served.prototype_url) as client:
            await client.send(create)
            first = await client.until("response.done", *TERMINAL)
            assert first[-1]["type"] == "response.done"
            outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
                       for c in calls_of(first)]  # fmt: skip
            await client.send({"type": "response.append", "input": outputs, "tool_choice": "none"})
            rest = await client.until(*TERMINAL)
    output = rest[-1]["response"]["output"]
    done = [e["item"] for e in [*first, *rest] if e["type"] == "response.output_item.done"]
    assert output == done
    segments = [output[: len(first[-1]["response"]["output"])]]
    segments.append(output[len(segments[0]) :])
    assert len(said.requests) == len(segments) == 2
    for items, (prompt, returned) in zip(segments, said.requests, strict=True):
        assert items and items[0]["prompt_token_ids"] == prompt
        generated: list[int] = []
        for item in items:
            assert item["prompt_token_ids"] == prompt + generated
            assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
            assert all(p <= 0 for p in item["generation_log_probs"])
            generated += item["generation_token_ids"]
        assert returned[: len(generated)] == generated
        if items[-1]["type"] != "function_call":  # after a call: no item's (the turn's end)
            assert returned == generated
    assert segments[0][-1]["type"] == "function_call"
    assert said.requests[1][0][: len(said.requests[0][0])] == said.requests[0][0]
