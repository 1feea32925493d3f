"""`<think>` blocks split from the answer as they stream (engine/thinking.py).

What a model thinks comes out as reasoning, what it answers goes on to the call parser as it
wrote it, in whatever pieces the tokens decode to; every token fed is carried exactly once.
"""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from proto_server.engine.chunks import Chunk, ReasoningDelta, TextDelta, ToolCallBegin
from proto_server.engine.families.hermes import HERMES, ToolCallParser
from proto_server.engine.thinking import ThinkingParser

WORDS = st.text(st.sampled_from("ab <>/\nthink"), max_size=30)


def pieces_of(text: str, cuts: list[int], tokens: list[int]) -> list[tuple[str, int]]:
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    spans = [text[a:b] for a, b in itertools.pairwise(points)]
    return [(span, tokens[i % len(tokens)]) for i, span in enumerate(spans)]


def run(parser: ThinkingParser, pieces: list[tuple[str, int]]) -> tuple[list[Chunk], int]:
    chunks: list[Chunk] = []
    for text, tokens in pieces:
        chunks += parser.feed(text, tokens)
    more, left = parser.finish()
    return chunks + more, left


def carried(chunks: list[Chunk]) -> int:
    return sum(getattr(chunk, "tokens", 0) for chunk in chunks)


def reasoning(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, ReasoningDelta))


def text(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, TextDelta))


@given(
    thought=WORDS.filter(lambda t: "</think>" not in t),
    answer=WORDS,
    cuts=st.lists(st.integers(0, 80), max_size=12),
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
@example(thought="a\n\nb", answer="", cuts=[9, 10, 11], tokens=[1])
def test_a_block_becomes_reasoning_and_the_rest_the_answer(
    thought: str, answer: str, cuts: list[int], tokens: list[int]
) -> None:
    written = f"<think>\n{thought}\n</think>\n\n{answer}"
    pieces = pieces_of(written, cuts, tokens)
    chunks, left = run(ThinkingParser(ToolCallParser([])), pieces)
    assert reasoning(chunks) == thought.strip(" \t\r\n")
    assert text(chunks) == answer.lstrip(" \t\r\n") or (not answer.strip() and text(chunks) == "")
    assert carried(chunks) + left == sum(t for _, t in pieces)
    # the reasoning comes first, all of it
    kinds = [type(c) for c in chunks if not isinstance(c, TextDelta) or c.text]
    assert kinds == sorted(kinds, key=lambda k: k is not ReasoningDelta)


@given(answer=WORDS, cuts=st.lists(st.integers(0, 40), max_size=8))
def test_without_a_block_everything_is_the_answer(answer: str, cuts: list[int]) -> None:
    pieces = pieces_of(answer, cuts, [1])
    chunks, left = run(ThinkingParser(ToolCallParser([])), pieces)
    stripped = answer.lstrip(" \t\r\n")
    if not stripped.startswith("<think>"):
        assert reasoning(chunks) == ""
        assert text(chunks) == (answer if answer.strip() else "")
    assert carried(chunks) + left == len(pieces)


@given(cuts=st.lists(st.integers(0, 120), max_size=16))
def test_a_call_after_thinking_is_parsed_by_the_call_parser(cuts: list[int]) -> None:
    written = "<think>\nI should list the files.\n</think>\n\n" + HERMES.call_text(
        "exec_command", '{"cmd": "ls"}'
    )
    parser = ThinkingParser(ToolCallParser(["exec_command"]))
    chunks, _ = run(parser, pieces_of(written, cuts, [1]))
    assert reasoning(chunks) == "I should list the files."
    assert [c.name for c in chunks if isinstance(c, ToolCallBegin)] == ["exec_command"]
    assert text(chunks) == "" and parser.called


def test_a_prompt_that_opened_the_block_starts_inside_it() -> None:
    """DeepSeek R1's generation prompt ends in `<think>\\n`: the model's first words think."""
    parser = ThinkingParser(ToolCallParser([]), thinking=True)
    chunks, left = run(parser, [("Hmm", 1), (", yes.", 2), ("</think>", 1), ("Yes.", 1)])
    assert reasoning(chunks) == "Hmm, yes." and text(chunks) == "Yes."
    assert carried(chunks) + left == 5


def test_thinking_cut_off_is_still_reasoning() -> None:
    chunks, left = run(ThinkingParser(ToolCallParser([])), [("<think>", 1), ("still ", 1)])
    assert reasoning(chunks) == "still" and text(chunks) == ""
    assert carried(chunks) + left == 2
