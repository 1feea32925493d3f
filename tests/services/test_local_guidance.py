"""Constrained decoding on the local model: a random-weight Llama under a grammar still calls
the tools it is offered, with arguments their schemas allow (which is the point)."""
# ruff: noqa: E402  (the imports below need torch, which `require` checks first)

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from ..support.requirements import MODEL_EXTRA, require

require("torch", MODEL_EXTRA)
require("llguidance", MODEL_EXTRA)

import attrs
import jsonschema
import torch
import trio

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.core.tool_choice import ToolChoice
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.constraints import Constraint
from proto_server.engine.default_model import example_value
from proto_server.engine.families.harmony import HARMONY
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.engine.local import LocalGenerator, LocalSession, greedy
from proto_server.engine.schema_grammar import check_text_format
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import FunctionCall, Item, Message
from proto_server.wire.tools import FunctionTool

from ..server.test_structured_output import SCHEMAS as SMALL_SCHEMAS
from ..support.clients import END, TERMINAL, model_connect
from ..support.tinymodel import (
    INSTRUCTIONS,
    NO_LIMITS,
    USER,
    make,
    outputs,
    segment,
    serve,
    tiny_llama,
    tiny_tokenizer,
)
from ..unit.test_families import npm_tokenizer

pytestmark = pytest.mark.model

#: A random model writes a free string forever; `maxLength` lets it close.
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "maxLength": 8}},
        "required": ["cmd"],
    },
    "strict": False,
}
PICK = {
    "type": "function",
    "name": "pick",
    "description": "Pick a colour and a digit.",
    "parameters": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    "strict": True,
}
TOOLS = tuple(converter.structure(tool, FunctionTool) for tool in (EXEC, PICK))
SCHEMAS = {tool.name: tool.parameters for tool in TOOLS}
REQUIRED = GenerationLimits(tool_choice=ToolChoice("required"))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def open_session(generator: LocalGenerator, tools: Sequence[FunctionTool] = TOOLS) -> LocalSession:
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=tools)
    conversation.extend([USER])
    return generator.open_session(conversation)


async def bounded(session: LocalSession, limits: GenerationLimits = NO_LIMITS) -> list[Chunk]:
    """One segment, in a minute at most."""
    with trio.fail_after(60):
        return await segment(session, limits)


def calls(items: Sequence[Item]) -> list[FunctionCall]:
    """The segment's calls, each checked against its tool's schema."""
    made = [item for item in items if isinstance(item, FunctionCall)]
    for call in made:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return made


class Prefers:
    """A model that wants to write `text`: its next token when the grammar allows it, else the
    best token the grammar allows (what a real model under a mask does)."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.script = tokenizer.encode(text, add_special_tokens=False)

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        wanted = self.script[len(generated)] if len(generated) < len(self.script) else None
        if wanted is not None and logits[wanted] > -torch.inf:
            return int(wanted)
        return greedy(logits, generated)


async def test_required_makes_a_valid_call_to_an_offered_tool(tokenizer: Any) -> None:
    generator = make(tokenizer, greedy, max_tokens=200)
    session = open_session(generator)
    chunks = await bounded(session, REQUIRED)
    (call,) = calls(outputs(chunks))
    assert call.name in SCHEMAS
    assert not [chunk for chunk in chunks if isinstance(chunk, TextDelta)]
    await session.aclose()


class Recording:
    """A send channel that notes how many tokens had been chosen when each chunk came."""

    def __init__(self, chooser: Any) -> None:
        self.chooser = chooser
        self.sent: list[tuple[Chunk, int]] = []

    async def send(self, chunk: Chunk) -> None:
        self.sent.append((chunk, self.chooser.count))


class Counting:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        self.count += 1
        return greedy(logits, generated)


@pytest.mark.parametrize("name", ["exec_command", "pick"])
async def test_a_forced_call_streams_as_it_decodes(tokenizer: Any, name: str) -> None:
    """Under the grammar the call is valid from its first token: its begin and argument pieces
    go out as they decode, not at the close of the block."""
    chooser = Counting()
    generator = make(tokenizer, chooser, max_tokens=200)
    session = open_session(generator)
    recording = Recording(chooser)
    with trio.fail_after(60):
        await session.generate(
            recording, GenerationLimits(tool_choice=ToolChoice("required", name))
        )  # type: ignore[arg-type]
    (call,) = calls(outputs([chunk for chunk, _ in recording.sent]))
    assert call.name == name
    begin = next(at for chunk, at in recording.sent if isinstance(chunk, ToolCallBegin))
    deltas = [at for chunk, at in recording.sent if isinstance(chunk, ToolCallArgumentsDelta)]
    assert len(deltas) > 1
    assert begin < deltas[-1] and len(set(deltas)) > 1, "pieces went out at different steps"
    assert deltas[0] < chooser.count - 2  # well before `}]</tool_call>` was decoded
    await session.aclose()


@pytest.mark.parametrize("name", ["exec_command", "pick"])
async def test_a_named_function_is_the_one_called(tokenizer: Any, name: str) -> None:
    """`pick` is strict: its enum, range and required fields hold."""
    generator = make(tokenizer, greedy, max_tokens=200)
    session = open_session(generator)
    chunks = await bounded(session, GenerationLimits(tool_choice=ToolChoice("required", name)))
    (call,) = calls(outputs(chunks))
    assert call.name == name
    await session.aclose()


TWO_CALLS = HERMES.call_text("pick", '{"color": "red", "n": 1}').replace(
    "}]", '}, {"name": "pick", "arguments": {"color": "blue", "n": 2}}]'
)


@pytest.mark.parametrize(
    ("limits", "most"),
    [
        (REQUIRED, 2),
        (GenerationLimits(tool_choice=ToolChoice("required"), parallel_tool_calls=False), 1),
        (GenerationLimits(tool_choice=ToolChoice("required"), max_tool_calls=1), 1),
    ],
    ids=["parallel", "parallel_tool_calls-false", "max_tool_calls-1"],
)
async def test_a_forced_block_holds_at_most_the_calls_allowed(
    tokenizer: Any, limits: GenerationLimits, most: int
) -> None:
    """The model wants two calls; when one is allowed the grammar closes the list after it."""
    generator = make(tokenizer, Prefers(tokenizer, TWO_CALLS), max_tokens=300)
    session = open_session(generator)
    made = calls(outputs(await bounded(session, limits)))
    assert [(call.name, json.loads(call.arguments)) for call in made] == [
        ("pick", {"color": "red", "n": 1}),
        ("pick", {"color": "blue", "n": 2}),
    ][:most]
    await session.aclose()


async def test_a_strict_tool_under_auto_constrains_a_call_the_model_opens(
    tokenizer: Any,
) -> None:
    """Text stays free; the block it opens must be a valid call (`green` is not an option)."""
    wants = "Let me pick. " + HERMES.call_text("pick", '{"color": "green", "n": 12}')
    generator = make(tokenizer, Prefers(tokenizer, wants), max_tokens=300)
    session = open_session(generator)
    items = outputs(await bounded(session))
    assert isinstance(items[0], Message) and items[0].content[0].text == "Let me pick. "
    (call,) = calls(items)
    assert call.name == "pick"
    await session.aclose()


async def test_without_a_strict_tool_auto_is_unconstrained(tokenizer: Any) -> None:
    generator = make(tokenizer, greedy, max_tokens=4)
    session = open_session(generator, TOOLS[:1])
    assert await session._constraint(GenerationLimits()) is None
    await session.aclose()


@pytest.mark.parametrize("choice", [ToolChoice("none"), ToolChoice("required")], ids=str)
async def test_no_calls_left_means_no_grammar_and_no_call(
    tokenizer: Any, choice: ToolChoice
) -> None:
    """`none` (or `max_tool_calls` spent) wins over `strict` and `required`: a call the model
    writes is plain text."""
    text = HERMES.call_text("pick", '{"color": "green"}')
    generator = make(tokenizer, Prefers(tokenizer, text), max_tokens=300)
    session = open_session(generator)
    chunks = await bounded(session, GenerationLimits(tool_choice=choice, max_tool_calls=0))
    assert not [chunk for chunk in chunks if isinstance(chunk, ToolCallBegin)]
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)).startswith(text)
    await session.aclose()


async def test_a_strict_schema_llguidance_cannot_compile_refuses_the_segment(
    tokenizer: Any,
) -> None:
    odd = FunctionTool(
        name="odd",
        parameters={"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}},
        strict=True,
    )
    generator = make(tokenizer, greedy)
    session = open_session(generator, [odd])
    with pytest.raises(GenerationRefused, match="cannot constrain decoding") as refused:
        await bounded(session, REQUIRED)
    assert refused.value.code == "invalid_tool_schema"
    await session.aclose()
    # not strict: the same schema, its unknown keyword ignored
    session = open_session(generator, [attrs.evolve(odd, strict=False)])
    (call,) = [i for i in outputs(await bounded(session, REQUIRED)) if isinstance(i, FunctionCall)]
    assert call.name == "odd" and isinstance(json.loads(call.arguments), dict)
    await session.aclose()


async def test_a_forced_call_over_the_server_suspends_and_resumes(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    """tool_choice required in the prototype dialect: `response.done` with the call; after the
    append the Response resumes on the warm cache (no call left: it answers in text)."""
    generator = make(tokenizer, greedy, max_tokens=200)
    running = await serve(nursery, generator)
    create = {
        "type": "response.create",
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": [{"type": "message", "role": "user", "content": USER.content}],
        "tools": [EXEC, PICK],
        "tool_choice": "required",
        "max_tool_calls": 1,
    }
    with trio.fail_after(60):
        async with model_connect(running.prototype_url) as client:
            await client.send(create)
            first = await client.segment()
            assert first[-1]["type"] == "response.done"
            (call,) = [
                e["item"]
                for e in first
                if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
            ]
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            types = [e["type"] for e in first]
            done = types.index("response.output_item.done")
            deltas = [
                i for i, t in enumerate(types) if t == "response.function_call_arguments.delta"
            ]
            assert len(deltas) > 1 and deltas[-1] < done  # the arguments streamed, then the item
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
            await client.send({"type": "response.append", "input": [output]})
            second = await client.until(*TERMINAL)
        await running.server.wait_idle()
    final = second[-1]["response"]
    assert final["status"] in ("completed", "incomplete")
    assert [item["type"] for item in final["output"]].count("function_call") == 1
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert generator.live_caches == 0


class SlowTokenizer:
    """A tokenizer without a Rust backend, which llguidance cannot read."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


async def test_without_a_fast_tokenizer_a_forced_call_is_refused_when_it_arrives(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    """No grammar: `required` gets a typed error, `auto` with a strict tool runs free."""
    generator = make(SlowTokenizer(tokenizer), greedy, max_tokens=4)
    assert not generator.forces_tool_calls
    session = open_session(generator)
    assert await session._constraint(GenerationLimits()) is None
    await session.aclose()
    running = await serve(nursery, generator)
    create = {"type": "response.create", "model": "tiny", "input": "hi", "tools": [EXEC, PICK]}
    with trio.fail_after(30):
        async with model_connect(running.prototype_url) as client:
            await client.send({**create, "tool_choice": {"type": "function", "name": "pick"}})
            (refused,) = await client.segment()
            assert refused["type"] == "error"
            assert refused["error"]["code"] == "unsupported_tool_choice"
            await client.send(create)
            assert (await client.until(*TERMINAL))[-1]["type"] == "response.incomplete"
        await running.server.wait_idle()


def test_the_mask_of_each_step_allows_the_call_and_refuses_some_tokens(tokenizer: Any) -> None:
    """Every token of a valid call is allowed at its step, and no step allows everything."""
    generator = make(tokenizer, greedy)
    constraint: Constraint = generator.guide.constrain(TOOLS, max_calls=None)
    logits = torch.zeros(generator.model.config.vocab_size)
    steps = tokenizer.encode(HERMES.call_text("pick", '{"color": "red", "n": 1}'))
    for token in steps:
        allowed = constraint.mask(logits)
        assert allowed[token] == 0 and int((allowed == 0).sum()) < len(logits)
        constraint.consume(token)


# -- structured output (`text.format`) ------------------------------------------------------------

ANSWER = TextFormat(kind="json_schema", schema=SCHEMAS["pick"], strict=True)


def answer_text(items: Sequence[Item]) -> str:
    (message,) = items
    assert isinstance(message, Message)
    return message.content[0].text


@pytest.mark.parametrize("prose", ["", "Sure! The colour is green."], ids=["greedy", "prose"])
async def test_a_json_schema_answer_is_an_instance_whatever_the_model_wants(
    tokenizer: Any, prose: str
) -> None:
    """A random model (greedy), or one that wants to write prose, answers an instance."""
    generator = make(tokenizer, Prefers(tokenizer, prose), max_tokens=200)
    session = open_session(generator, [])
    items = outputs(await bounded(session, GenerationLimits(text_format=ANSWER)))
    jsonschema.validate(json.loads(answer_text(items)), SCHEMAS["pick"])
    await session.aclose()


async def test_json_object_allows_what_the_model_writes_when_it_is_an_object(
    tokenizer: Any,
) -> None:
    """The grammar of `json_object` lets an object through as the model writes it (that it
    forces one is the json_schema tests' and the engine test's)."""
    generator = make(tokenizer, Prefers(tokenizer, '{"ok": true, "n": [1, 2]}'), max_tokens=200)
    session = open_session(generator, [])
    limits = GenerationLimits(text_format=TextFormat(kind="json_object"))
    items = outputs(await bounded(session, limits))
    assert json.loads(answer_text(items)) == {"ok": True, "n": [1, 2]}
    await session.aclose()


async def test_with_tools_under_auto_the_answer_is_an_instance_or_a_valid_call(
    tokenizer: Any,
) -> None:
    """The grammar allows a call block instead of the answer; either one is valid."""
    wants = HERMES.call_text("pick", '{"color": "green", "n": 12}')
    generator = make(tokenizer, Prefers(tokenizer, wants), max_tokens=300)
    session = open_session(generator)
    (call,) = calls(outputs(await bounded(session, GenerationLimits(text_format=ANSWER))))
    assert call.name == "pick"
    await session.aclose()
    generator = make(tokenizer, Prefers(tokenizer, '{"color": "blue", "n": 3}'), max_tokens=300)
    session = open_session(generator)
    items = outputs(await bounded(session, GenerationLimits(text_format=ANSWER)))
    assert json.loads(answer_text(items)) == {"color": "blue", "n": 3}
    await session.aclose()


@pytest.mark.npm  # the real gpt-oss tokenizer comes from tests/clients (npm)
async def test_gpt_oss_answers_after_its_final_header_which_the_prompt_holds() -> None:
    """harmony writes an answer under `<|channel|>final<|message|>`: the local model is prompted
    with that header (as the engine is), decodes only the JSON, which streams as text; the next
    turn renders the answer back on final, so the cache holds all of it."""
    tokenizer = npm_tokenizer("gptoss")
    wants = '{"color": "red", "n": 4}'
    model = tiny_llama(vocab_size=len(tokenizer), eos_token_id=None)
    generator = LocalGenerator(
        model, tokenizer, threads=1, choose=Prefers(tokenizer, wants), max_tokens=40
    )
    assert generator.syntax is HARMONY
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS)
    conversation.extend([USER])
    plain = len(conversation.turn_prompt(generator.renderer.generation_prompt))
    session = generator.open_session(conversation)
    chunks = await bounded(session, GenerationLimits(text_format=ANSWER))
    prefilled = chunks[0]
    assert isinstance(prefilled, Prefilled)
    head = tokenizer.encode(HARMONY.answer_head, add_special_tokens=False)
    assert prefilled.prompt_tokens == plain + len(head) == plain + 3
    items = outputs(chunks)
    assert answer_text(items) == wants
    conversation.extend([*items, Message(role="user", content="and blue?")])
    (again, *_) = await bounded(session, GenerationLimits(max_output_tokens=1))
    assert isinstance(again, Prefilled)
    written = len(tokenizer.encode(wants, add_special_tokens=False))
    assert again.cached_tokens == prefilled.prompt_tokens + written
    await session.aclose()


@pytest.mark.parametrize("past", [0, 1])
async def test_the_limit_in_a_forced_call_makes_it_incomplete_but_not_past_its_arguments(
    tokenizer: Any, past: int
) -> None:
    """Stopped by `max_output_tokens` inside its arguments, the call is cut: the segment is
    `incomplete` and the call not ended (its item ends `incomplete`). Stopped once they are
    whole, before the block's close, it is a call, and the segment is not `incomplete`."""
    arguments = '{"color": "red", "n": 1}'  # what `pick`'s strict schema allows
    wants = HERMES.call_text("pick", arguments)
    script = tokenizer.encode(wants, add_special_tokens=False)
    whole = next(
        k for k in range(1, len(script) + 1)
        if tokenizer.decode(script[:k]).find(arguments) >= 0
    )  # fmt: skip
    generator = make(tokenizer, Prefers(tokenizer, wants), max_tokens=200)
    session = open_session(generator)
    limits = GenerationLimits(
        tool_choice=ToolChoice("required", "pick"), max_output_tokens=whole - 1 + past
    )
    chunks = await bounded(session, limits)
    end = chunks[-1]
    assert isinstance(end, SegmentEnd)
    ends = [chunk for chunk in chunks if isinstance(chunk, ToolCallEnd)]
    if past:
        assert end.incomplete is None and len(ends) == 1
        (call,) = calls(outputs(chunks))
        assert json.loads(call.arguments) == json.loads(arguments)
    else:
        assert end.incomplete == "max_output_tokens" and ends == []
    await session.aclose()


@pytest.mark.npm  # the real gpt-oss tokenizer comes from tests/clients (npm)
async def test_gpt_oss_s_forced_call_is_decoded_to_the_end_of_its_arguments() -> None:
    """Under the grammar harmony's call streams from its header on; the call counts once its
    arguments end (the turn's `<|call|>`), so decoding does not stop at the header (it did:
    the call came back with no arguments)."""
    tokenizer = npm_tokenizer("gptoss")
    arguments = '{"color": "red", "n": 4}'
    model = tiny_llama(vocab_size=len(tokenizer), eos_token_id=None)
    wants = HARMONY.call_text("pick", arguments) + "<|call|>"
    generator = LocalGenerator(
        model, tokenizer, threads=1, choose=Prefers(tokenizer, wants), max_tokens=60
    )
    session = open_session(generator)
    limits = GenerationLimits(tool_choice=ToolChoice("required", "pick"))
    chunks = await bounded(session, limits)
    (call,) = calls(outputs(chunks))
    assert (call.name, json.loads(call.arguments)) == ("pick", json.loads(arguments))
    await session.aclose()


async def test_a_schema_the_grammar_cannot_take_is_a_400_naming_its_path(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    """Before any event, over HTTP and WebSocket alike; the connection lives on. Compiling a
    schema (and bisecting it for the part to blame) takes time no byte count foretells, so it
    runs on a preparation thread however small the request."""
    import httpx

    schema = {
        "type": "object",
        "properties": {"when": {"type": "string", "pattern": "(?=x)"}},
        "required": ["when"],
    }
    text = {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}
    create = {"type": "response.create", "model": "tiny", "input": "hi", "text": text}
    generator = make(tokenizer, greedy, max_tokens=4)
    checked_on: list[tuple[str, bool]] = []  # (format, on the event loop's thread)
    check = generator.check_text_format

    def spy(form: TextFormat) -> None:
        checked_on.append((form.kind, threading.current_thread() is threading.main_thread()))
        check(form)

    generator.check_text_format = spy  # type: ignore[method-assign]
    running = await serve(nursery, generator)
    with trio.fail_after(30):
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{running.address.http_url}/responses",
                json={k: v for k, v in create.items() if k != "type"},
            )
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert (error["code"], error["param"]) == (
            "invalid_json_schema",
            "text.format.schema.properties.when",
        )
        assert "look-around" in error["message"]
        async with model_connect(running.address.ws_url) as client:
            await client.send(create)
            (refused,) = await client.until(*END)
            assert refused["type"] == "error" and refused["error"] == error
            await client.send({**create, "text": {"format": {"type": "json_object"}}})
            assert (await client.until(*END))[-1]["type"] != "error"
        await running.server.wait_idle()
    assert checked_on == [("json_schema", False), ("json_schema", False), ("json_object", True)]


@pytest.mark.parametrize("strict", [True, False])
def test_the_part_to_blame_is_found_in_a_wide_schema(strict: bool) -> None:
    """The 400 names the one bad subschema among hundreds (bisected, not tried one by one)."""
    leaf = {"type": "object", "properties": {f"q{j}": {"type": "string"} for j in range(4)}}
    properties = {f"p{i}": json.loads(json.dumps(leaf)) for i in range(500)}
    properties["p371"]["properties"]["q2"] = {"anyOf": [{"type": "string"}, {"type": "bogus"}]}
    schema = {"type": "object", "properties": properties, "$defs": {"ok": {"type": "string"}}}
    with pytest.raises(ProtocolError) as refused:
        check_text_format(TextFormat(kind="json_schema", schema=schema, strict=strict))
    assert refused.value.detail.param == "text.format.schema.properties.p371.properties.q2.anyOf[1]"
    assert "bogus" in str(refused.value)
    check_text_format(TextFormat(kind="json_schema", schema={**schema, "properties": {}}))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SMALL_SCHEMAS)
@example(schema={"enum": ["\x7f"]})
def test_the_grammar_accepts_the_default_models_instance_of_small_schemas(
    tokenizer: Any, schema: dict[str, Any]
) -> None:
    """Written as the grammar writes JSON (`json.dumps`, characters unescaped, properties in
    the schema's order), an instance of the schema (the default model's) is a path through the
    grammar to its end: strict and not."""
    generator = make(tokenizer, greedy)
    # DEL is a control character to llguidance's JSON strings: it writes it escaped
    text = json.dumps(example_value(schema), ensure_ascii=False).replace("\x7f", "\\u007f")
    for strict in (True, False):
        form = TextFormat(kind="json_schema", schema=schema, strict=strict)
        constraint = generator.guide.constrain([], max_calls=None, answer=form)
        for token in tokenizer.encode(text, add_special_tokens=False):
            constraint.consume(token)
        constraint.consume(tokenizer.eos_token_id)
