"""A local model that thinks: its `<think>` block streams as a reasoning item, over the server.

The tiny random Llama with a byte-level tokenizer whose vocabulary has `<think>` and `</think>`
(as Qwen3's and DeepSeek R1's do), teacher-forced to write a thought, an answer, then a call;
the real local generator, parser and server do the rest.
"""

# ruff: noqa: E402  (the imports below need torch, which `require` checks first)

from __future__ import annotations

from typing import Any

import pytest
import trio

from ..support.requirements import MODEL_EXTRA, require

require("torch", MODEL_EXTRA)

pytestmark = pytest.mark.model  # the tiny random Llama

from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.chunks import ReasoningDelta, TextDelta, ToolCallBegin
from proto_server.testing import StreamChecker

from ..support.clients import END, connect
from ..support.frames import create
from ..support.tinymodel import CHATML, Scripted, make, serve, tiny_tokenizer

THOUGHT = "The loop stops one short."
CALL = '<tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls"}}]</tool_call>'
SAID = f"<think>\n{THOUGHT}\n</think>\n\nLet me look.{CALL}"


def thinking_tokenizer(template: str = CHATML) -> Any:
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_a_tokenizer_with_think_tokens_thinks_and_a_prompt_may_open_the_block() -> None:
    assert not ChatTemplateRenderer(tiny_tokenizer()).thinks
    plain = ChatTemplateRenderer(thinking_tokenizer())
    assert plain.thinks and not plain.opens_thinking
    opening = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert ChatTemplateRenderer(thinking_tokenizer(opening)).opens_thinking


async def test_the_local_model_streams_its_thinking_as_a_reasoning_item(
    nursery: trio.Nursery,
) -> None:
    tokenizer = thinking_tokenizer()
    running = await serve(nursery, make(tokenizer, Scripted(tokenizer, [SAID]), max_tokens=200))
    checker = StreamChecker(dialect="prototype")
    with trio.fail_after(60):
        async with connect(f"{running.address.ws_url}?dialect=prototype") as client:
            frame = create()
            checker.sent(frame)
            await client.send(frame)
            events = await client.until("response.done", *END)
    for event in events:
        checker.received(event)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call"]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert done[1]["content"][0]["text"] == "Let me look."
    usage = events[-1]["response"]["usage"]
    # the block's tokens, its tags included; the blank lines after it are the answer's
    thought = len(tokenizer.encode(f"<think>\n{THOUGHT}\n</think>", add_special_tokens=False))
    assert usage["output_tokens_details"]["reasoning_tokens"] == thought


def test_chunks_of_the_thinking_parser_are_what_the_generator_hands_over() -> None:
    """The same split, fed as the generator feeds it: token by decoded token."""
    from proto_server.engine.families.hermes import ToolCallParser
    from proto_server.engine.thinking import ThinkingParser

    tokenizer = thinking_tokenizer()
    parser = ThinkingParser(ToolCallParser(["exec_command"]))
    chunks = []
    for token in tokenizer.encode(SAID, add_special_tokens=False):
        chunks += parser.feed(tokenizer.decode([token]), 1)
    more, left = parser.finish()
    chunks += more
    assert "".join(c.text for c in chunks if isinstance(c, ReasoningDelta)) == THOUGHT
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == "Let me look."
    assert [c.name for c in chunks if isinstance(c, ToolCallBegin)] == ["exec_command"]
    total = len(tokenizer.encode(SAID, add_special_tokens=False))
    assert sum(getattr(c, "tokens", 0) for c in chunks) + left == total
