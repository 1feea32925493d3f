"""Model outputs written to break the families' parsers: arguments nested thousands deep, huge
arguments, a frame padded with whitespace, names and strings that never end, openings and
harmony headers repeated by the thousand, blocks never closed, all split anywhere.

Every family's parser (engine/families/, and the thinking parser in front of one) reads them
without raising: a block it cannot read is the model's text, a streamed call ends where its
arguments leave what a call may be; every token is carried once. And its work is linear in what
it is fed: counted here as the lines of the parsers' own code that run (deterministic, unlike
time), which double, not quadruple, when the output doubles. Work done inside str methods
(searches, copies) is not counted by that; docs/engines.md says how it was measured.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto_server.engine import thinking
from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.chunks import Chunk, ToolCallBegin, ToolCallEnd
from proto_server.engine.families import base, framed, harmony, hermes, parser_for, stream
from proto_server.engine.families.base import (
    MAX_ARGUMENTS_DEPTH,
    WHITESPACE,
    ToolSyntax,
    json_object,
)
from proto_server.engine.families.deepseek_v3 import DEEPSEEK_V3
from proto_server.engine.families.harmony import HARMONY
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.families.llama3 import LLAMA3_JSON
from proto_server.engine.families.qwen import QWEN
from proto_server.engine.thinking import ThinkingParser
from proto_server.wire.items import FunctionCall

from .test_families import (
    EVERY,
    calls_of,
    fed,
    npm_tokenizer,
    split,
    streamed_arguments,
    text_of,
    tokens_of,
)

ALL = [*EVERY, HARMONY]
PARSER_FILES = frozenset(
    module.__file__ for module in (base, stream, framed, hermes, harmony, thinking)
)


def family(syntax: ToolSyntax) -> str:
    return syntax.name


def nested(depth: int) -> str:
    """Arguments `depth` levels deep: an object holding arrays."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def block_of(syntax: ToolSyntax, arguments: str) -> str:
    """A call of `f` with `arguments`, as the family writes it (harmony: after
    `<|start|>assistant`, its `<|call|>` a stop token, never fed)."""
    return syntax.frame.block([("f", arguments)])


def well_formed(chunks: Sequence[Chunk]) -> None:
    """Every call that begins ends, and nothing else comes between."""
    inside = False
    for chunk in chunks:
        if isinstance(chunk, ToolCallBegin):
            assert not inside
            inside = True
        elif isinstance(chunk, ToolCallEnd):
            assert inside
            inside = False
        else:
            assert inside == (type(chunk).__name__ == "ToolCallArgumentsDelta"), chunks
    assert not inside


# -- depth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("syntax", ALL, ids=family)
@pytest.mark.parametrize("depth", [MAX_ARGUMENTS_DEPTH + 1, 990, 5_000])
def test_arguments_past_the_cap_are_text_or_end_the_streamed_call(
    syntax: ToolSyntax, depth: int
) -> None:
    """Held, the block is the model's text; under a grammar the call ends where its arguments
    pass the cap (as a streamed call that leaves the frame does), and nothing after it is
    said. Python's decoder overflowed its stack on these from about 990 levels. At the cap
    they are a call."""
    arguments = nested(MAX_ARGUMENTS_DEPTH)
    block = block_of(syntax, arguments)
    pieces = split(block, range(0, len(block), 5), [1])
    for forced in (False, True):
        chunks = fed(syntax, pieces, ["f"], forced=forced)
        assert calls_of(chunks) == [("f", json.loads(arguments))]
    block = block_of(syntax, nested(depth))
    pieces = split(block, range(0, len(block), 7), [1, 2])
    held = fed(syntax, pieces, ["f"])
    assert calls_of(held) == [] and text_of(held) == block
    assert tokens_of(held) == sum(tokens for _, tokens in pieces)
    streamed = fed(syntax, pieces, ["f"], forced=True)
    well_formed(streamed)
    (arguments,) = streamed_arguments(streamed)
    assert nested(depth).startswith(arguments) and not json_object(arguments)
    assert text_of(streamed) == ""
    assert tokens_of(streamed) == sum(tokens for _, tokens in pieces)


#: Each family and the real tokenizer that writes it (Hermes' tags are Qwen3's tokens too).
WRITERS = [(QWEN, "qwen3"), (HERMES, "qwen3"), (DEEPSEEK_V3, "deepseek_v3"),
           (LLAMA3_JSON, "llama3_1"), (HARMONY, "gptoss")]  # fmt: skip


@pytest.mark.npm
@pytest.mark.model  # its tokenizer is read by transformers
@pytest.mark.parametrize(("syntax", "package"), WRITERS, ids=lambda x: getattr(x, "name", x))
def test_a_thousand_levels_as_real_tokenizers_write_them_are_read_as_text(
    syntax: ToolSyntax, package: str
) -> None:
    """The depth that overflowed is well within an output limit: the real tokenizers write two
    brackets a token, so a thousand levels are about a thousand tokens, fed here one by one."""
    tokenizer = npm_tokenizer(package)
    block = block_of(syntax, nested(1_000))
    ids = tokenizer.encode(block, add_special_tokens=False)
    assert len(ids) < 1_100
    pieces = [(tokenizer.decode([token]), 1) for token in ids]
    assert "".join(text for text, _ in pieces) == block
    chunks = fed(syntax, pieces, ["f"])
    assert calls_of(chunks) == [] and text_of(chunks) == block
    assert tokens_of(chunks) == len(ids)


@pytest.mark.npm
@pytest.mark.model  # its tokenizer is read by transformers
def test_a_call_too_deep_to_decode_is_rendered_as_written_on_the_next_turn() -> None:
    """A template that takes a call's arguments as an object (Hermes' here, on Qwen3's
    template) is given them as written where they nest past the cap, not decoded (where
    Python's decoder overflowed): a client may send such a call back."""
    tokenizer = npm_tokenizer("qwen3")
    renderer = ChatTemplateRenderer(tokenizer, syntax=HERMES, cache_bytes=0)
    assert renderer.renders_calls and not HERMES.template_arguments_text
    for depth in (MAX_ARGUMENTS_DEPTH + 1, 5_000):
        call = FunctionCall(call_id="call_1", name="f", arguments=nested(depth))
        assert nested(depth) in tokenizer.decode(list(renderer.render_item(call)))


# -- any hostile output --------------------------------------------------------------------------


def fragments(syntax: ToolSyntax) -> list[str]:
    """What a hostile output is made of: the family's own syntax, whole and in parts."""
    frame = syntax.frame
    literals = [
        *(frame.open, frame.list_open, frame.name_prefix, frame.name_suffix, frame.args_suffix),
        *(frame.separator or "", frame.close, frame.opening + "f"),
    ]
    parts = [part for literal in literals for part in (literal, literal[: len(literal) // 2])]
    extra = ["f", '"f"', "{", "}", "[", "]", '"', "\\", ":", ",", " ", "\n", "x", '{"a": 1}']
    if syntax is HARMONY:
        extra += ["<|start|>assistant", "<|channel|>analysis", "<|channel|>final"]
        extra += ["<|message|>", "<|end|>", "<|call|>", "<|return|>", " to=functions.f"]
    return [part for part in parts + extra if part]


def wholes(syntax: ToolSyntax) -> list[str]:
    """Whole hostile stretches: calls nested too deep, closed or not, and (harmony) a thousand
    messages or headers in a row."""
    head = syntax.frame.opening + "f" + syntax.frame.name_suffix
    found = [block_of(syntax, nested(990)), block_of(syntax, nested(5_000)),
             head + "{" + "[" * 3_000, head + "{" + "{" * 3_000]  # fmt: skip
    if syntax is HARMONY:
        found += [
            "<|start|>assistant<|channel|>analysis<|message|>x<|end|>" * 1_000,
            "<|channel|>final<|message|>x<|end|>" * 1_000,
            " to=functions.f<|channel|>commentary<|message|>{}<|end|>" * 1_000,
        ]
    return found


@st.composite
def hostile(draw: st.DrawFn, syntax: ToolSyntax) -> str:
    """An output of fragments, some repeated by the thousand (deep brackets, huge strings,
    whitespace runs, repeated openings and headers), and whole hostile stretches."""
    runs = st.tuples(
        st.sampled_from(fragments(syntax)),
        st.sampled_from([1, 1, 1, 2, 3, 300, 1_000, 5_000]),
    )
    parts = st.one_of(runs.map(lambda run: run[0] * run[1]), st.sampled_from(wholes(syntax)))
    return "".join(draw(st.lists(parts, max_size=12)))


@pytest.mark.parametrize("syntax", ALL, ids=family)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    cuts=st.lists(st.integers(0, 10**6), max_size=24),
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
def test_no_output_makes_a_parser_raise_or_lose_a_token(
    syntax: ToolSyntax, data: st.DataObject, cuts: list[int], tokens: list[int]
) -> None:
    output = data.draw(hostile(syntax))
    pieces = split(output, cuts, tokens)
    total = sum(count for _, count in pieces)
    for forced in (False, True):
        chunks = fed(syntax, pieces, ["f"], forced=forced)
        well_formed(chunks)
        assert tokens_of(chunks) == total
        if forced:
            continue
        calls = calls_of(chunks)
        assert all(name == "f" and json_object(json.dumps(args)) for name, args in calls)
        if syntax is HARMONY:
            continue
        said = text_of(chunks)
        if not calls:  # the output as written, but for an answer that is only whitespace
            assert said == (output if output.strip(WHITESPACE) else "")
        else:  # what came before its calls
            assert output.startswith(said)
    thinks = ThinkingParser(parser_for(syntax, ["f"]))  # a thinking model's output, the same
    pieces = split("<think>" + output, cuts, tokens)
    chunks = [chunk for text, count in pieces for chunk in thinks.feed(text, count)]
    held, leftover = thinks.finish()
    well_formed([*chunks, *held])
    assert tokens_of([*chunks, *held]) + leftover == sum(count for _, count in pieces)


# -- linear work ---------------------------------------------------------------------------------


def work(parser: Any, pieces: Sequence[str]) -> int:
    """The lines of the parsers' own code that run to read `pieces`, one token each."""
    lines = 0

    def count(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        lines += event == "line"
        return count

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        return count if frame.f_code.co_filename in PARSER_FILES else None

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        for piece in pieces:
            parser.feed(piece, 1)
        parser.finish()
    finally:
        sys.settrace(before)
    return lines


def shapes(syntax: ToolSyntax) -> dict[str, Callable[[int], list[str]]]:
    """Hostile outputs of `n` tokens for `syntax`, each a block's start and then one character
    a token, or (harmony's headers) one piece holding `n` messages."""
    frame = syntax.frame
    head = frame.open + frame.list_open
    call = frame.opening + "f" + frame.name_suffix
    found = {
        "whitespace in the frame": lambda n: [head, *" " * n],
        "a name that never ends": lambda n: [head + frame.name_prefix, *"a" * n],
        "a key that never ends": lambda n: [head + '{"', *"k" * n],
        "a string that never ends": lambda n: [call + '{"a": "', *"x" * n],
        "brackets": lambda n: [call + "{", *"[" * n],
        "openings": lambda n: [frame.open or "{"] * n,
        "thinking whitespace": lambda n: ["<think>a", *"\n" * n],
    }
    if frame.id_key is not None:
        found["an id that never ends"] = lambda n: [
            call + f'{{}}, "{frame.id_key}": "',
            *"x" * n,
        ]
    if syntax is HARMONY:
        message = "<|start|>assistant<|channel|>analysis<|message|>x<|end|>"
        found["headers in one piece"] = lambda n: [
            "<|channel|>final<|message|>x<|end|>" + message * n
        ]
        found["a held call"] = lambda n: [
            " to=functions.f<|channel|>commentary<|message|>{",
            *"x" * n,
        ]
    return found


CASES = [(syntax, shape) for syntax in ALL for shape in shapes(syntax)]


@pytest.mark.parametrize(("syntax", "shape"), CASES, ids=lambda x: getattr(x, "name", x))
def test_a_parsers_work_doubles_when_its_hostile_output_doubles(
    syntax: ToolSyntax, shape: str
) -> None:
    """Each piece is read once, however the text before it went: quadratic work (a scan that
    starts over on each piece, a recursion per message) would quadruple."""
    make = shapes(syntax)[shape]
    for forced in (False, True):
        counts = []
        for n in (300, 600):
            parser = parser_for(syntax, ["f"], forced=forced)
            if shape == "thinking whitespace":
                parser = ThinkingParser(parser)
            counts.append(work(parser, make(n)))
        assert counts[1] <= 2.5 * counts[0], (forced, counts)
