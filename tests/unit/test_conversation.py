"""The Conversation is extended incrementally: a turn costs O(new items), not O(history)."""

from __future__ import annotations

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer, item_text
from proto_server.core.tokenizer import o200k_base
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message, UnknownItem


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
