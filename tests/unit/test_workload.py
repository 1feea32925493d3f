"""The benchmark's Codex-shaped workload: sizes as promised, and the same for the same seed."""

from __future__ import annotations

import orjson
import pytest
from proto_server_bench.workload import make_workload, streaming_text

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.tokenizer import o200k_base
from proto_server.wire.converter import converter
from proto_server.wire.items import FunctionCall, Item
from proto_server.wire.tools import Tool

KB = 1024


def test_the_same_seed_gives_the_same_workload_and_another_does_not() -> None:
    assert make_workload(3) == make_workload(3)
    assert make_workload(3) != make_workload(4)


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_sizes_are_those_of_a_codex_rollout(seed: int) -> None:
    workload = make_workload(seed)
    sizes = workload.sizes()
    assert 30 <= sizes["tool_rounds"] <= 50
    assert sizes["turns"] == sizes["tool_rounds"] + 1
    assert 16 * KB <= sizes["developer_bytes"] <= 18 * KB
    assert 17 * KB <= sizes["tools_bytes"] <= 20 * KB
    assert [t.get("name", t["type"]) for t in workload.tools][:2] == ["exec_command", "write_stdin"]
    header = 200  # Codex's "Chunk ID / Wall time / ..." lines before the output
    for round_ in workload.rounds:
        size = len(round_.output.encode())
        assert KB <= size <= 8 * KB + header or 16 * KB <= size <= 48 * KB + header
        arguments = orjson.loads(round_.arguments)
        assert arguments["cmd"] == round_.command
        assert 20 <= len(o200k_base().encode_ordinary(round_.arguments)) <= 80
    assert 200 <= len(o200k_base().encode_ordinary(workload.final)) <= 600


def test_flags_set_the_rounds_and_the_sizes() -> None:
    workload = make_workload(0, rounds=3, output_kb=(2, 2), large_share=0.0)
    assert workload.turns == 4
    assert all(2 * KB <= len(r.output.encode()) <= 2 * KB + 300 for r in workload.rounds)
    segments = workload.script().segments
    assert [len(s.tool_calls) for s in segments] == [1, 1, 1, 0]
    assert segments[-1].text == workload.final
    with pytest.raises(ValueError, match="at least one tool round"):
        make_workload(0, rounds=0)


def test_the_default_rollout_grows_past_100k_tokens() -> None:
    workload = make_workload(0)
    tools = [converter.structure(t, Tool) for t in workload.tools]  # type: ignore[arg-type]
    conversation = Conversation(O200kRenderer(), tools=tools)
    opening = workload.opening("nonce-1")
    assert "nonce-1" in opening[1]["content"][0]["text"]
    conversation.extend(converter.structure(i, Item) for i in opening)  # type: ignore[arg-type]
    for index, round_ in enumerate(workload.rounds):
        call = FunctionCall(call_id=f"c{index}", name="exec_command", arguments=round_.arguments)
        output = converter.structure(workload.tool_output(index, f"c{index}"), Item)  # type: ignore[arg-type]
        conversation.extend([call, output])
    assert conversation.token_count > 100_000


def test_streaming_text_has_about_the_tokens_asked_for() -> None:
    assert abs(len(o200k_base().encode_ordinary(streaming_text(500))) - 500) <= 5
