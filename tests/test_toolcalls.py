"""The streaming tool-call parser on crafted model outputs: split anywhere, malformed, unknown."""

from __future__ import annotations

import itertools
import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto_server.engine.chunks import (
    Chunk,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.toolcalls import ToolCallParser, call_text, describe_tools, parse_calls
from proto_server.wire.tools import FunctionTool

NAMES = ("exec_command", "read_file")
CALL = '<tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls -la"}}]</tool_call>'


@attrs.frozen
class Parsed:
    text: str
    calls: list[tuple[str, str]]
    tokens: int
    called: bool


def parse(
    pieces: list[str], names: tuple[str, ...] = NAMES, max_calls: int | None = None
) -> Parsed:
    """Feed each piece as one token; check the chunk grammar and that every token is counted."""
    parser = ToolCallParser(names, max_calls=max_calls)
    chunks: list[Chunk] = []
    for piece in pieces:
        chunks += parser.feed(piece, 1)
    rest, leftover = parser.finish()
    chunks += rest
    text, calls, tokens = "", [], leftover
    open_call: list[str] | None = None
    for chunk in chunks:
        match chunk:
            case TextDelta(text=delta, tokens=n):
                assert open_call is None and delta
                text += delta
                tokens += n
            case ToolCallBegin(name=name, tokens=n):
                assert open_call is None
                open_call = [name, ""]
                tokens += n
            case ToolCallArgumentsDelta(delta=delta, tokens=n):
                assert open_call is not None and delta
                open_call[1] += delta
                tokens += n
            case ToolCallEnd():
                assert open_call is not None
                calls.append((open_call[0], open_call[1]))
                open_call = None
    assert open_call is None
    assert tokens == len(pieces), "every token fed is carried by exactly one chunk"
    return Parsed(text, calls, tokens, parser.called)


def splits(text: str) -> list[list[str]]:
    """The text in two pieces at every position, and one character per piece."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("pieces", splits(CALL))
def test_a_call_split_anywhere_is_one_call(pieces: list[str]) -> None:
    parsed = parse(pieces)
    assert parsed.calls == [("exec_command", '{"cmd": "ls -la"}')]
    assert parsed.text == ""
    assert parsed.called


def test_argument_deltas_follow_the_model_pieces() -> None:
    parser = ToolCallParser(NAMES)
    pieces = [
        '<tool_call>[{"name": "exec_command", "arguments": ',
        '{"cmd"',
        ': "ls"}',
        "}]",
        "</tool",
    ]
    chunks = [chunk for piece in pieces for chunk in parser.feed(piece, 1)]
    assert chunks == []  # held until the block closes
    chunks = parser.feed("_call>", 1)
    assert chunks == [
        ToolCallBegin("exec_command", 1),
        ToolCallArgumentsDelta('{"cmd"', 1),
        ToolCallArgumentsDelta(': "ls"}', 4),  # and the closing syntax after the arguments
        ToolCallEnd(),
    ]


def test_text_streams_before_a_call_and_a_possible_tag_is_held() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Let me look.", 1) == [TextDelta("Let me look.", 1)]
    assert parser.feed("\n<tool", 1) == [TextDelta("\n", 1)]
    assert parser.feed("_", 1) == []
    parsed = parse(["Let me look.\n", CALL])
    assert parsed.text == "Let me look.\n"
    assert parsed.calls == [("exec_command", '{"cmd": "ls -la"}')]


def test_a_tag_like_word_is_text() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("a <tool", 1) == [TextDelta("a ", 1)]
    assert parser.feed("box>", 1) == [TextDelta("<toolbox>", 1)]


def test_prose_about_the_tag_is_released_without_waiting_for_a_close() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Use <tool_call>", 1) == [TextDelta("Use ", 1)]
    assert parser.feed(" tags", 1) == [TextDelta("<tool_call>", 1), TextDelta(" tags", 0)]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls"}]</tool_call>',  # bad JSON
        '<tool_call>[{"name": "rm_rf", "arguments": {}}]</tool_call>',  # not offered
        '<tool_call>[{"name": "exec_command", "arguments": ["ls"]}]</tool_call>',  # not an object
        '<tool_call>[{"name": "exec_command", "arguments": "ls"}]</tool_call>',  # string, not JSON
        '<tool_call>[{"name": "exec_command"}]</tool_call>',  # no arguments
        '<tool_call>[{"name": "exec_command", "arguments": {}, "x": 1}]</tool_call>',  # extra key
        "<tool_call>[]</tool_call>",  # no call at all
        '<tool_call>[{"name": 3, "arguments": {}}]</tool_call>',  # name not a string
        '<tool_call>{"name": "exec_command", "arguments": {}} trailing</tool_call>',
        '<tool_call>[{"name": "exec_command", "arguments": {}}, {"name": "nope", '
        '"arguments": {}}]</tool_call>',  # one bad call spoils the block
        '<tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls"}}]',  # never closed
    ],
)
def test_an_invalid_block_becomes_the_text_the_model_wrote(block: str) -> None:
    for pieces in splits(block):
        parsed = parse(pieces)
        assert parsed.calls == []
        assert parsed.text == block
        assert not parsed.called


def test_hermes_style_single_object_and_several_calls_in_a_list() -> None:
    hermes = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    assert parse([hermes]).calls == [("read_file", '{"path": "a.py"}')]
    two = (
        '<tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}, '
        '{"arguments": {"cmd": "ls"}, "name": "exec_command"}]</tool_call>'
    )
    for pieces in splits(two):
        assert parse(pieces).calls == [
            ("read_file", '{"path": "a.py"}'),
            ("exec_command", '{"cmd": "ls"}'),
        ]


def test_a_block_with_more_calls_than_allowed_keeps_the_first_and_every_token() -> None:
    """parallel_tool_calls: false or max_tool_calls: the request's limit, whatever was written."""
    two = (
        '<tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}, '
        '{"name": "exec_command", "arguments": {"cmd": "ls"}}]</tool_call>'
    )
    for pieces in splits(two):
        assert parse(pieces, max_calls=1).calls == [("read_file", '{"path": "a.py"}')]
    assert parse(list(two), max_calls=0).text == two  # no call allowed: tags are plain text


def test_arguments_given_as_a_json_string_are_unwrapped() -> None:
    block = (
        '<tool_call>[{"name": "exec_command", "arguments": "{\\"cmd\\": \\"ls\\"}"}]</tool_call>'
    )
    assert parse(list(block)).calls == [("exec_command", '{"cmd": "ls"}')]


def test_leading_whitespace_before_a_call_opens_no_message() -> None:
    parsed = parse(["\n", "  ", CALL])
    assert parsed.text == ""
    assert len(parsed.calls) == 1
    assert parse(["\n", " hi"]).text == "\n hi"
    assert parse(["\n", " "]).text == ""


def test_without_offered_tools_tags_are_plain_text() -> None:
    parsed = parse(list(CALL), names=())
    assert parsed.text == CALL
    assert parsed.calls == []


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "[",
    "]",
    "{",
    "}",
    '"name": ',
    '"exec_command"',
    '"read_file"',
    '"arguments": ',
    '{"cmd": "ls"}',
    ", ",
    ":",
    '"',
    "\\",
    " ",
    "\n",
    "hello",
    "é",
]


@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_any_output_parses_without_crashing_and_keeps_every_token(
    fragments: list[str], cuts: list[int]
) -> None:
    text = "".join(fragments)
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]
    parsed = parse(pieces)
    if not parsed.calls:  # the text as written, except an answer that is only whitespace
        assert parsed.text == (text if text.strip(" \n") else "")
    for name, arguments in parsed.calls:
        assert name in NAMES
        assert isinstance(json.loads(arguments), dict)


def test_a_rendered_call_is_what_the_parser_reads_back() -> None:
    text = call_text("exec_command", '{"cmd": "ls -la"}')
    assert text == CALL
    assert parse([text]).calls == [("exec_command", '{"cmd": "ls -la"}')]
    # arguments that are not a JSON object are carried as a string, and still parse
    assert parse_calls(call_text("exec_command", "ls")[11:-12], NAMES) is None


def test_the_tools_are_described_with_their_schemas() -> None:
    tool = FunctionTool(
        name="exec_command",
        description="Run a shell command.",
        parameters={"type": "object", "properties": {"cmd": {"type": "string"}}},
    )
    text = describe_tools([tool])
    listed = json.loads(text.split("<tools>")[1].split("</tools>")[0])
    assert listed == [
        {
            "name": "exec_command",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        }
    ]
    assert "<tool_call>[{" in text
