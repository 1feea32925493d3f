"""Mistral rendered by mistral-common, one item at a time (engine/mistral_renderer.py).

The tokenizers are the Tekken vocabulary mistral-common ships (Mistral Nemo's), written at the
versions whose framing is tested (`bench.mistral.mistral_folder`): the version changes where
the system prompt and the tools go and how calls are written, not the vocabulary. Version 7 is
Mistral Small 3's framing (a JSON list of calls with ids), version 13 Devstral 2's and Mistral
3's (`[TOOL_CALLS]name[ARGS]{...}`, the tools before the first user message). The server's
tokenizer is the one transformers converts from that file, as Mistral's model folders ship it.
"""

# ruff: noqa: E402  (the imports below need the model extra, which `require` checks first)

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ..support.requirements import MODEL_EXTRA, require

require("mistral_common", MODEL_EXTRA)
require("transformers", MODEL_EXTRA)

# mistral-common and the tokenizer transformers converts from it: the model extra
pytestmark = pytest.mark.model

from mistral_common.protocol.instruct.chunk import TextChunk, ThinkChunk
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, Tool, ToolCall
from mistral_common.protocol.instruct.tool_calls import FunctionCall as MistralCall
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from proto_server_bench.mistral import mistral_folder

from proto_server.core.conversation import render_items
from proto_server.engine import families
from proto_server.engine.chunks import ReasoningDelta
from proto_server.engine.families.mistral import MISTRAL, MISTRAL_JSON
from proto_server.engine.mistral_renderer import THINK_TAGS, MistralRenderer, mistral_call_id
from proto_server.engine.model_files import load_tokenizer
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES, TemplateError
from proto_server.engine.renderers import renderer_for
from proto_server.engine.thinking import split_thinking
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    ReasoningText,
)
from proto_server.wire.tools import FunctionTool

from .test_families import arguments, calls_of, fed, split, text_of, tokens_of

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = FunctionTool(name="get_weather", description="The weather in a city.", parameters=CITY)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tekken")
    return {version: mistral_folder(root, version) for version in ("v3", "v7", "v11", "v13")}


@functools.cache
def renderer_of(folder: Path) -> tuple[Any, MistralRenderer]:
    tokenizer = load_tokenizer(folder).tokenizer
    renderer = renderer_for(families.choose(tokenizer), tokenizer, cache_bytes=RENDER_CACHE_BYTES)
    assert isinstance(renderer, MistralRenderer)
    return tokenizer, renderer


def whole(folder: Path, messages: list[Any], tools: list[Tool]) -> list[int]:
    """What mistral-common renders for the whole conversation, as vLLM's own API would (a
    conversation that ends in the model's answer is checked as mistral-common checks one for
    fine-tuning)."""
    ends = isinstance(messages[-1], AssistantMessage)
    mode = ValidationMode.finetuning if ends else ValidationMode.test
    mistral = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=mode)
    request = ChatCompletionRequest(messages=messages, tools=tools)
    return list(mistral.encode_chat_completion(request).tokens)


def item_by_item(renderer: MistralRenderer, items: Sequence[Item]) -> list[int]:
    prefix = renderer.render_prefix("Be brief.", [WEATHER])
    return [*prefix, *render_items(renderer, items).tokens]


TOOLS = [Tool(function=Function(name="get_weather", description=WEATHER.description or "",
                                parameters=CITY))]  # fmt: skip
LOOP: list[Item] = [
    Message(role="user", content="Weather in Paris and Rome?"),
    Message(role="assistant", content="Looking."),
    FunctionCall(call_id="call_parisAAAA1", name="get_weather", arguments='{"city": "Paris"}'),
    FunctionCall(call_id="call_2", name="get_weather", arguments='{"city": "Rome"}'),
    FunctionCallOutput(call_id="call_parisAAAA1", output="sunny"),
    FunctionCallOutput(call_id="call_2", output="rain"),
    Message(role="assistant", content="Sunny in Paris, rain in Rome."),
]
LATER: list[Item] = [Message(role="user", content="And tomorrow?")]


def messages_of(items: Sequence[Item]) -> list[Any]:
    """The same conversation as mistral-common's messages (ids as the renderer cuts them)."""
    calls = [
        ToolCall(id=mistral_call_id(i.call_id),
                 function=MistralCall(name=i.name, arguments=i.arguments))
        for i in items if isinstance(i, FunctionCall)
    ]  # fmt: skip
    messages: list[Any] = [SystemMessage(content="Be brief.")]
    for item in items:
        match item:
            case Message(role="user", content=text):
                messages.append(UserMessage(content=text))
            case Message(role="assistant", content=text) if text == "Looking.":
                messages.append(AssistantMessage(content=text, tool_calls=calls))
            case Message(role="assistant", content=text):
                messages.append(AssistantMessage(content=text))
            case FunctionCallOutput(call_id=call_id, output=output):
                messages.append(ToolMessage(content=output, tool_call_id=mistral_call_id(call_id)))
    return messages


@pytest.mark.parametrize("version", ["v7", "v13"])
def test_a_tool_loop_rendered_item_by_item_is_what_mistral_common_renders_whole(
    folders: dict[str, Path], version: str
) -> None:
    """A text and two calls are one assistant message (the model writes them so), each output
    a tool message: token for token mistral-common's rendering of the whole loop."""
    _, renderer = renderer_of(folders[version])
    assert item_by_item(renderer, LOOP) == whole(folders[version], messages_of(LOOP), TOOLS)


def test_a_new_user_message_is_rendered_where_version_13_renders_it(
    folders: dict[str, Path],
) -> None:
    _, renderer = renderer_of(folders["v13"])
    conversation = [*LOOP, *LATER]
    expected = whole(folders["v13"], messages_of(conversation), TOOLS)
    assert item_by_item(renderer, conversation) == expected


def test_before_version_13_a_new_user_message_leaves_the_tools_where_they_were(
    folders: dict[str, Path],
) -> None:
    """mistral-common moves version 7's tools to the last user message (so vLLM's own engine
    prefills the whole conversation again); a rollout's prompt only grows: what was rendered
    stays, and the new message follows it."""
    tokenizer, renderer = renderer_of(folders["v7"])
    before = item_by_item(renderer, LOOP)
    after = item_by_item(renderer, [*LOOP, *LATER])
    assert after[: len(before)] == before
    assert tokenizer.decode(after[len(before) :]) == "[INST]And tomorrow?[/INST]"
    moved = whole(folders["v7"], messages_of([*LOOP, *LATER]), TOOLS)
    assert moved[: len(before)] != before  # what the rollout keeps and vLLM's own would not


def test_versions_are_told_apart_and_an_old_one_is_refused_saying_why(
    folders: dict[str, Path],
) -> None:
    for version, family in (("v7", MISTRAL_JSON), ("v13", MISTRAL)):
        tokenizer = load_tokenizer(folders[version]).tokenizer
        assert families.choose(tokenizer) is family
    tokenizer = load_tokenizer(folders["v3"]).tokenizer
    with pytest.raises(TemplateError, match=r"tokenizer v3 puts the instructions in the last user"):
        renderer_for(families.choose(tokenizer), tokenizer, cache_bytes=RENDER_CACHE_BYTES)


def test_a_folder_with_only_tekken_json_is_read(tmp_path: Path) -> None:
    """transformers reads such a folder through mistral-common; the server decodes with the
    fast tokenizer converted from the same file, and renders with mistral-common."""
    folder = mistral_folder(tmp_path, "v13", tokenizer_json=False)
    tokenizer, renderer = renderer_of(folder)
    assert type(tokenizer).__name__ != "MistralCommonBackend"
    assert tokenizer.name_or_path == str(folder)
    assert item_by_item(renderer, LOOP) == whole(folder, messages_of(LOOP), TOOLS)


def test_a_tokenizer_that_numbers_text_otherwise_is_refused(folders: dict[str, Path]) -> None:
    smollm2 = load_tokenizer(None).tokenizer
    mistral = MistralTokenizer.from_file(str(folders["v13"] / "tekken.json"))
    with pytest.raises(TemplateError, match="numbers text differently"):
        MistralRenderer(mistral, smollm2)


def test_call_ids_are_nine_letters_or_digits_and_stay_apart() -> None:
    assert mistral_call_id("call_abcdefghi") == "abcdefghi"  # as vLLM cuts them
    short = [mistral_call_id(f"call_{n}") for n in range(1000)]
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in short)
    assert len(set(short)) == 1000
    assert mistral_call_id("call_1") == mistral_call_id("call_1")


@pytest.mark.parametrize("version", ["v7", "v13"])
@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(st.tuples(st.sampled_from(["get_weather", "run"]), arguments), min_size=1,
                   max_size=3),
    cuts=st.lists(st.integers(min_value=0), max_size=6),
)  # fmt: skip
def test_what_the_renderer_writes_for_calls_is_read_back_as_those_calls(
    folders: dict[str, Path], version: str, calls: list[tuple[str, dict[str, Any]]],
    cuts: list[int],
) -> None:  # fmt: skip
    """The model's turn as the renderer renders it back, fed to the family's parser in any
    pieces: the same calls, nothing said as text, every token counted."""
    tokenizer, renderer = renderer_of(folders[version])
    items: list[Item] = [
        FunctionCall(call_id=f"call_{n}", name=name, arguments=json.dumps(arguments))
        for n, (name, arguments) in enumerate(calls)
    ]
    tokens = render_items(renderer, items).tokens
    text = tokenizer.decode(list(tokens)[:-1])  # the turn's end, `</s>`, ends the parse
    syntax = families.choose(tokenizer)
    chunks = fed(syntax, split(text, cuts, [1] * (len(cuts) + 1)), ["get_weather", "run"])
    assert calls_of(chunks) == calls
    assert text_of(chunks) == ""


THOUGHT = "Both cities: call for each."


def test_magistral_s_thinking_is_rendered_back_where_the_model_wrote_it(
    folders: dict[str, Path],
) -> None:
    """A reasoning item is the `[THINK]` block that opens the model's message, and the text
    and calls after it continue that message: token for token mistral-common's rendering of
    assistant messages that hold a think chunk; a turn that ended in its thinking is closed
    (`</s>`) before what follows."""
    _, renderer = renderer_of(folders["v13"])
    assert renderer.thinks and renderer.think_tags == ("[THINK]", "[/THINK]")
    thought = Reasoning(content=(ReasoningText(text=THOUGHT),))
    loop = [LOOP[0], thought, *LOOP[1:6], thought, LOOP[6]]
    messages = messages_of(LOOP)
    for index in (2, 5):  # the two answers, each after its thinking
        message = messages[index]
        chunks = [ThinkChunk(thinking=THOUGHT, closed=True), TextChunk(text=message.content)]
        messages[index] = AssistantMessage(content=chunks, tool_calls=message.tool_calls)
    assert item_by_item(renderer, loop) == whole(folders["v13"], messages, TOOLS)
    # a turn of only thinking, then the user again
    only = [LOOP[0], thought, *LATER]
    think = AssistantMessage(content=[ThinkChunk(thinking=THOUGHT, closed=True)])
    expected = [SystemMessage(content="Be brief."), UserMessage(content=LOOP[0].content), think,
                UserMessage(content="And tomorrow?")]  # fmt: skip
    assert item_by_item(renderer, only) == whole(folders["v13"], expected, TOOLS)


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_magistral_s_thinking_is_read_as_reasoning_as_it_streams(cuts: list[int]) -> None:
    written = f'[THINK]{THOUGHT}[/THINK]Looking.[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}'
    parser = split_thinking(
        families.parser_for(MISTRAL, ["get_weather"]), thinks=True, opened=False, tags=THINK_TAGS
    )
    chunks = [c for piece, t in split(written, cuts, [1]) for c in parser.feed(piece, t)]
    held, leftover = parser.finish()
    chunks += held
    assert "".join(c.text for c in chunks if isinstance(c, ReasoningDelta)) == THOUGHT
    assert text_of(chunks) == "Looking."
    assert calls_of(chunks) == [("get_weather", {"city": "Paris"})]
    assert tokens_of(chunks) + leftover == len(split(written, cuts, [1]))


@pytest.mark.parametrize("version", ["v11", "v13"])
def test_from_version_11_outputs_are_shown_in_their_calls_order(
    folders: dict[str, Path], version: str
) -> None:
    """mistral-common puts outputs in their calls' order from version 11 on (13 shows no
    ids on results: the order is all that ties them); outputs sent the other way round are
    rendered so too."""
    _, renderer = renderer_of(folders[version])
    swapped = [*LOOP[:4], LOOP[5], LOOP[4], LOOP[6]]
    expected = whole(folders[version], messages_of(LOOP), TOOLS)
    assert item_by_item(renderer, swapped) == expected


def test_outputs_whose_calls_are_no_longer_known_are_shown_as_they_came(
    folders: dict[str, Path],
) -> None:
    _, renderer = renderer_of(folders["v13"])
    outputs = [FunctionCallOutput(call_id=f"call_gone{n}", output="x") for n in range(2)]
    assert renderer.render_run(outputs, None) is None


@pytest.mark.parametrize("written", ["", "[1, 2]", '"x"'])
def test_arguments_that_are_no_object_are_shown_as_mistral_common_reads_them(
    folders: dict[str, Path], written: str
) -> None:
    _, renderer = renderer_of(folders["v13"])
    call = FunctionCall(call_id="call_abcdefghi", name="get_weather", arguments=written)
    calls = [ToolCall(id="abcdefghi", function=MistralCall(name="get_weather",
                                                           arguments=written or "{}"))]  # fmt: skip
    messages = [SystemMessage(content="Be brief."), UserMessage(content="Hi"),
                AssistantMessage(content=None, tool_calls=calls)]  # fmt: skip
    conversation = [Message(role="user", content="Hi"), call]
    assert item_by_item(renderer, conversation) == whole(folders["v13"], messages, TOOLS)
