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
from proto_server.engine.families.hermes import HERMES, ToolCallParser, parse_calls
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
    pieces: list[str],
    names: tuple[str, ...] = NAMES,
    max_calls: int | None = None,
    forced: bool = False,
) -> Parsed:
    """Feed each piece as one token; check the chunk grammar and that every token is counted."""
    parser = ToolCallParser(names, max_calls=max_calls, forced=forced)
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
    parse(pieces, forced=True)  # no grammar held it: still every begin ends, every token counts
    parsed = parse(pieces)
    if not parsed.calls:  # the text as written, except an answer that is only whitespace
        assert parsed.text == (text if text.strip(" \n") else "")
    for name, arguments in parsed.calls:
        assert name in NAMES
        assert isinstance(json.loads(arguments), dict)


def test_a_rendered_call_is_what_the_parser_reads_back() -> None:
    text = HERMES.call_text("exec_command", '{"cmd": "ls -la"}')
    assert text == CALL
    assert parse([text]).calls == [("exec_command", '{"cmd": "ls -la"}')]
    # arguments that are not a JSON object are carried as a string, and still parse
    assert parse_calls(HERMES.call_text("exec_command", "ls")[11:-12], NAMES) is None


def test_the_tools_are_described_with_their_schemas() -> None:
    tool = FunctionTool(
        name="exec_command",
        description="Run a shell command.",
        parameters={"type": "object", "properties": {"cmd": {"type": "string"}}},
    )
    text = HERMES.describe_tools([tool])
    listed = json.loads(text.split("<tools>")[1].split("</tools>")[0])
    assert listed == [
        {
            "name": "exec_command",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        }
    ]
    assert "<tool_call>[{" in text


# -- forced blocks (under a grammar) stream --------------------------------------------------------

TWO = (
    '<tool_call>[{"name": "read_file", "arguments": {"path": "a}\\"{.py", "n": [1, {"x": "]"}]}}, '
    '{"name": "exec_command", "arguments": {"cmd": "echo \\\\\\"}\\""}}]</tool_call>'
)


def feed_all(
    pieces: list[str],
    *,
    forced: bool,
    tokens: list[int] | None = None,
    max_calls: int | None = None,
) -> tuple[list[list[Chunk]], int, bool]:
    """The chunks each piece gave (finish's last), the tokens finish returned, and `called`."""
    parser = ToolCallParser(NAMES, max_calls=max_calls, forced=forced)
    out = [parser.feed(piece, tokens[i] if tokens else 1) for i, piece in enumerate(pieces)]
    rest, leftover = parser.finish()
    return [*out, rest], leftover, parser.called


def flat(per_piece: list[list[Chunk]]) -> list[Chunk]:
    return [chunk for chunks in per_piece for chunk in chunks]


@pytest.mark.parametrize(
    "block",
    [
        CALL,
        TWO,
        "  \n" + TWO + " after",
        '<tool_call>{"name": "read_file", "arguments": {}}</tool_call>',
    ],
)
def test_a_forced_block_gives_the_held_chunks_split_anywhere(block: str) -> None:
    for pieces in [*splits(block), *(list(p) for p in [block])]:
        held = feed_all(pieces, forced=False)
        streamed = feed_all(pieces, forced=True)
        assert flat(streamed[0]) == flat(held[0]), pieces
        assert streamed[1:] == held[1:]
    for pieces in splits(block)[::7]:  # several tokens per piece, and pieces of no text
        tokens = [len(piece) % 3 for piece in pieces]
        assert flat(feed_all(pieces, forced=True, tokens=tokens)[0]) == flat(
            feed_all(pieces, forced=False, tokens=tokens)[0]
        )


def test_a_forced_call_streams_its_arguments_before_they_close() -> None:
    pieces = list(TWO)  # one character a token
    per_piece, leftover, called = feed_all(pieces, forced=True)
    assert called
    first_close = TWO.index('"]"}]}') + 6  # the first call's arguments close here
    begin_at = next(
        i for i, cs in enumerate(per_piece) if any(isinstance(c, ToolCallBegin) for c in cs)
    )
    deltas_before = [
        c for cs in per_piece[:first_close] for c in cs if isinstance(c, ToolCallArgumentsDelta)
    ]
    assert begin_at == TWO.index('"arguments": {') + len('"arguments": ')
    assert len(deltas_before) > 10
    parsed = parse(pieces)  # what the held path makes of it: the same calls
    arguments = "".join(c.delta for c in deltas_before)
    assert parsed.calls[0][1].startswith(arguments)
    chunks = flat(per_piece)
    assert [c.name for c in chunks if isinstance(c, ToolCallBegin)] == ["read_file", "exec_command"]
    assert sum(getattr(c, "tokens", 0) for c in chunks) + leftover == len(pieces)


def test_a_forced_block_in_another_shape_is_held() -> None:
    """Arguments before the name (a grammar that lets the order vary): held, then valid."""
    block = '<tool_call>[{"arguments": {"cmd": "ls"}, "name": "exec_command"}]</tool_call>'
    for pieces in splits(block):
        per_piece, _, called = feed_all(pieces, forced=True)
        assert called and flat(per_piece) == flat(feed_all(pieces, forced=False)[0])
        assert not any(per_piece[:-2]) or len(pieces) == 2


def test_a_forced_block_past_the_allowed_calls_and_one_cut_short() -> None:
    for pieces in splits(TWO)[::5]:
        assert flat(feed_all(pieces, forced=True, max_calls=1)[0]) == flat(
            feed_all(pieces, forced=False, max_calls=1)[0]
        )
    cut = TWO[: TWO.index("exec_command") + 30]  # max_output_tokens mid-arguments
    per_piece, leftover, called = feed_all(list(cut), forced=True)
    chunks = flat(per_piece)
    assert called
    assert chunks.count(ToolCallEnd()) == 2 and isinstance(chunks[-1], ToolCallEnd)
    assert sum(getattr(c, "tokens", 0) for c in chunks) + leftover == len(cut)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(NAMES),
            st.dictionaries(
                st.text(max_size=4),
                st.recursive(
                    st.text(max_size=5) | st.integers(),
                    lambda v: (
                        st.lists(v, max_size=2)
                        | st.dictionaries(st.text(max_size=3), v, max_size=2)
                    ),
                    max_leaves=4,
                ),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=3,
    ),
    st.lists(st.integers(min_value=0, max_value=400), max_size=40),
    st.booleans(),
)
def test_any_forced_call_list_streams_as_it_would_be_held(
    calls: list[tuple[str, dict[str, object]]], cuts: list[int], compact: bool
) -> None:
    separators = (",", ":") if compact else (", ", ": ")  # vLLM's and the local grammar's
    listed = json.dumps(
        [{"name": name, "arguments": arguments} for name, arguments in calls],
        separators=separators,
    )
    text = OPEN_TAG + listed + "</tool_call>"
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]
    streamed, held = feed_all(pieces, forced=True), feed_all(pieces, forced=False)
    assert flat(streamed[0]) == flat(held[0])
    assert streamed[1:] == held[1:]
    assert parse(pieces).calls == [
        (name, json.dumps(arguments, separators=separators)) for name, arguments in calls
    ]


OPEN_TAG = "<tool_call>"
