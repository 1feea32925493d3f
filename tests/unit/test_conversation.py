"""The Conversation is extended incrementally: a turn costs O(new items), not O(history)."""

from __future__ import annotations

from collections.abc import Sequence

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer, item_text
from proto_server.core.tokenizer import o200k_base
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Item, Message, UnknownItem


def test_extending_renders_only_the_new_items() -> None:
    conv = Conversation(O200kRenderer(), instructions="be brief")
    history = [Message(role="user", content="line\n" * 5000)]
    conv.extend(history)
    rendered_before = conv.rendered_tokens
    new = [FunctionCallOutput(call_id="call_1", output="ok")]
    added = conv.extend(new)
    assert added == len(o200k_base().encode_ordinary(item_text(new[0])))
    assert conv.rendered_tokens - rendered_before == added
    assert conv.token_count == rendered_before + added


def test_model_segments_are_runs_of_model_items() -> None:
    conv = Conversation(O200kRenderer())
    conv.extend([Message(role="user", content="go")])
    assert conv.model_segments == 0
    conv.extend([
        UnknownItem({"type": "reasoning", "summary": []}),
        Message(role="assistant", content="looking"),
        FunctionCall(call_id="a", name="f", arguments="{}"),
        FunctionCall(call_id="b", name="f", arguments="{}"),
    ])  # fmt: skip
    assert conv.model_segments == 1
    end = conv.token_count
    assert conv.model_output_end == end
    conv.extend(
        [FunctionCallOutput(call_id="a", output="1"), FunctionCallOutput(call_id="b", output="2")]
    )
    assert conv.tool_outputs == 2
    assert conv.model_output_end == end
    conv.extend([Message(role="assistant", content="done")])
    assert conv.model_segments == 2


class Declining(O200kRenderer):
    """A renderer that would join runs of outputs and model turns, and declines every one:
    how often it is asked is what rendering a long history costs."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def render_run(self, items: Sequence[Item], previous: Item | None) -> Sequence[int] | None:
        self.asked.append(len(items))
        return None

    render_turn = render_run


def test_a_long_run_the_renderer_will_not_join_is_asked_about_once_not_per_tail() -> None:
    """20,000 calls in a client's history took minutes when every tail of the run was scanned
    and offered again; a tail of calls after a call is asked as the one before it was: once."""
    calls = [FunctionCall(call_id=f"c{i}", name="f", arguments="{}") for i in range(2_000)]
    outputs = [FunctionCallOutput(call_id=f"c{i}", output="ok") for i in range(2_000)]
    text = Message(role="assistant", content="text")
    renderer = Declining()
    conversation = Conversation(renderer)
    conversation.extend([text, *calls, *outputs])
    # the turn; its calls alone, and once more after a call; the outputs, and once more after
    # an output; never a shorter tail again
    assert renderer.asked == [2_001, 2_000, 1_999, 2_000, 1_999]
    plain = Conversation(O200kRenderer())
    plain.extend([text, *calls, *outputs])
    assert list(conversation.tokens) == list(plain.tokens)  # declined: rendered item by item
