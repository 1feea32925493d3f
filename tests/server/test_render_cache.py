"""The chat-template renderer keeps what it rendered lately: a stateless client resending its
history is rendered only where it is new, with the same tokens, in bounded memory."""
# ruff: noqa: E402  (the imports below need transformers, which `require` checks first)

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import trio

from ..support.requirements import MODEL_EXTRA, require

require("torch", MODEL_EXTRA)

pytestmark = pytest.mark.model  # the tiny random Llama

from proto_server.cli import build_parser, main
from proto_server.core.conversation import Conversation
from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message, OutputText

from ..support.metrics import scrape, value
from ..support.tinymodel import Scripted, make, serve, tiny_tokenizer

HISTORY = [
    Message(role="user", content="the tests fail; fix the bug"),
    FunctionCall(call_id="call_1", name="exec_command", arguments='{"cmd": "ls"}'),
    FunctionCallOutput(call_id="call_1", output="a.py\nb.py"),
    Message(role="assistant", content=(OutputText(text="Fixed."),)),
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def render(renderer: ChatTemplateRenderer, items: list[Any]) -> list[int]:
    conversation = Conversation(renderer, instructions="Be brief.")
    conversation.extend(items)
    return list(conversation.tokens)


def test_a_resent_history_is_rendered_from_what_was_kept_with_the_same_tokens(
    tokenizer: Any,
) -> None:
    kept, fresh = ChatTemplateRenderer(tokenizer), ChatTemplateRenderer(tokenizer, cache_bytes=0)
    first = render(kept, HISTORY[:2])
    assert (kept.rendered.hits, kept.rendered.misses) == (0, 3)  # the system prompt, 2 items
    # the next stateless turn: the same prompt and history again, and what the turn adds
    second = render(kept, HISTORY)
    assert (kept.rendered.hits, kept.rendered.misses) == (3, 5)
    assert second[: len(first)] == first
    assert second == render(fresh, HISTORY)
    assert fresh.rendered.hits == 0 and fresh.rendered.nbytes == 0  # 0: nothing is kept


def test_the_same_text_from_another_role_is_another_message(tokenizer: Any) -> None:
    renderer = ChatTemplateRenderer(tokenizer)
    user = Message(role="user", content="ls")
    output = FunctionCallOutput(call_id="c", output="ls")
    assert list(renderer.render_item(user)) != list(renderer.render_item(output))
    assert renderer.rendered.hits == 0


def test_what_is_kept_stays_within_its_bytes(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The least recently used go first (the first time, a log line names the flag), and a
    message bigger than the whole cache is rendered but not kept."""
    renderer = ChatTemplateRenderer(tokenizer, cache_bytes=8 * 1024)
    with caplog.at_level(logging.INFO, logger="proto_server.engine.model_renderer"):
        for n in range(200):
            renderer.render_item(Message(role="user", content=f"message {n} " * 10))
            assert renderer.rendered.nbytes <= 8 * 1024
    full = [r for r in caplog.records if r.getMessage() == "render_cache.full"]
    assert len(full) == 1 and full[0].flag == "--render-cache-mb"  # type: ignore[attr-defined]
    assert renderer.rendered.evicted > 150
    renderer.render_item(Message(role="user", content="message 199 " * 10))
    renderer.render_item(Message(role="user", content="message 0 " * 10))
    assert renderer.rendered.hits == 1  # the latest is still there, the first long gone
    huge = Message(role="user", content="x" * 20_000)
    renderer.render_item(huge)
    renderer.render_item(huge)
    assert renderer.rendered.hits == 1 and renderer.rendered.nbytes <= 8 * 1024


def test_the_flag_takes_mebibytes_and_refuses_a_negative_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--render-cache-mb", "0"]).render_cache_mb == 0
    assert parser.parse_args(["serve"]).render_cache_mb == 64
    assert main(["serve", "--store", ":memory:", "--render-cache-mb", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "proto-server: --render-cache-mb: must be at least 0, got -1\n"


async def test_metrics_say_what_the_cache_found_and_holds(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    """A stateless client resends its history: the second request's messages are hits, the
    new one a miss, counted as each turn ends; the bytes kept are a gauge (`--render-cache-mb`
    is tuned by these)."""
    running = await serve(nursery, make(tokenizer, Scripted(tokenizer, ["Hi.", "Hi."])))
    base = running.address.http_url.removesuffix("/v1")
    history = [{"role": "user", "content": "the tests fail; fix the bug"},
               {"role": "assistant", "content": "Which test?"}]  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        with trio.fail_after(120):
            before = await scrape(http, base)
            for turn in (history, [*history, {"role": "user", "content": "test_a"}]):
                body = {"model": "m", "input": turn, "instructions": "Be brief.", "store": False}
                answer = await http.post(f"{base}/v1/responses", json=body)
                assert answer.status_code == 200, answer.text
            after = await scrape(http, base)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # the first turn renders the system prompt, 2 messages and its answer ("Hi.", as the
    # template says it); the second finds the first 3, renders 1 new, and finds its answer
    assert delta("proto_server_render_cache_total", outcome="miss") == 4 + 1
    assert delta("proto_server_render_cache_total", outcome="hit") == 3 + 1
    assert value(after, "proto_server_render_cache_bytes") > 0
