"""The vLLM generator's pure parts, on data: request bodies, the engine's stream, its errors,
start-up refusals; and the server-side pieces it needs (append's `tool_choice`, `/readyz`).
The engine itself is tested for real in tests/services/test_vllm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio

from proto_server.core.tool_choice import ToolChoice
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.vllm import (
    CONTEXT_LENGTH_EXCEEDED,
    ENGINE_ERROR,
    ENGINE_TIMEOUT,
    ENGINE_UNAVAILABLE,
    EngineError,
    EngineSetupError,
    EngineUsage,
    Piece,
    ServedModel,
    choose_model,
    completion_request,
    discover,
    error_for_exception,
    error_for_status,
    forced_call_format,
    parse_models,
    parse_sse,
    tokenizer_source,
)
from proto_server.wire.tools import FunctionTool

from ..support.clients import connect
from ..support.frames import EXEC_COMMAND
from ..support.servers import StartServer, free_port

URL = "http://127.0.0.1:9/v1"
TOOLS = (
    FunctionTool(name="exec_command", parameters=EXEC_COMMAND["parameters"]),
    FunctionTool(name="read_file", parameters={"type": "object"}),
)

# What vLLM 0.32 (CPU) streamed for one short answer, abridged.
STREAM = [
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"Bon",'
    '"finish_reason":null,"prompt_token_ids":[1,9690,198],"token_ids":[30904]}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"",'
    '"finish_reason":"stop","stop_reason":2,"prompt_token_ids":null,"token_ids":[2]}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"prompt_tokens":35,'
    '"total_tokens":37,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}',
    "",
    "data: [DONE]",
]


def test_the_engine_stream_parses_into_pieces_and_usage() -> None:
    parsed = [event for line in STREAM if (event := parse_sse(line)) is not None]
    assert parsed == [
        Piece("Bon", (30904,)),
        Piece("", (2,), "stop"),
        EngineUsage(prompt_tokens=35, completion_tokens=2, cached_tokens=32),
    ]


def test_usage_without_prompt_details_has_no_cached_count() -> None:
    line = 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
    assert parse_sse(line) == EngineUsage(3, 1, None)


def test_an_error_in_the_stream_raises_engine_error() -> None:
    with pytest.raises(EngineError) as caught:
        parse_sse('data: {"error": {"message": "boom", "code": 500}}')
    assert caught.value.code == ENGINE_ERROR and "boom" in str(caught.value)
    with pytest.raises(EngineError):
        parse_sse("data: {not json")


def test_refusals_are_classified_by_what_they_mean() -> None:
    too_long = json.dumps(
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens. However, your "
                "prompt contains 9000 input tokens",
                "type": "BadRequestError",
                "code": 400,
            }
        }
    ).encode()
    assert error_for_status(400, too_long).code == CONTEXT_LENGTH_EXCEEDED
    other = error_for_status(400, b'{"error": {"message": "bad schema"}}')
    assert other.code == ENGINE_ERROR and "bad schema" in str(other)
    assert error_for_status(500, b"Internal Server Error").code == ENGINE_ERROR
    assert error_for_status(503, b"").code == ENGINE_ERROR


def test_transport_failures_are_classified() -> None:
    request = httpx.Request("POST", URL)
    cases = {
        httpx.ConnectError("refused", request=request): ENGINE_UNAVAILABLE,
        httpx.ConnectTimeout("slow", request=request): ENGINE_UNAVAILABLE,
        httpx.ReadTimeout("silent", request=request): ENGINE_TIMEOUT,
        httpx.PoolTimeout("busy", request=request): ENGINE_TIMEOUT,
        httpx.RemoteProtocolError("gone", request=request): ENGINE_UNAVAILABLE,
        httpx.ReadError("reset", request=request): ENGINE_UNAVAILABLE,
        httpx.UnsupportedProtocol("odd", request=request): ENGINE_ERROR,
    }
    for exc, code in cases.items():
        assert error_for_exception(exc, URL).code == code, exc


def test_a_request_sends_the_prompt_as_ids_with_the_sampling_it_was_given() -> None:
    limits = GenerationLimits(temperature=0.0, top_p=0.5, seed=7)
    body = completion_request(
        model="smollm2",
        prompt=[1, 2, 3],
        max_tokens=16,
        limits=limits,
        stop_token_ids={2, 0},
        stop=["</tool_call>"],
    )
    assert body == {
        "model": "smollm2",
        "prompt": [1, 2, 3],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stop_token_ids": [0, 2],
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 7,
        "stop": ["</tool_call>"],
        "include_stop_str_in_output": True,
    }
    free = completion_request(
        model="m", prompt=[1], max_tokens=1, limits=GenerationLimits(),
        stop_token_ids=(),
    )  # fmt: skip
    assert "stop" not in free and "temperature" not in free and "seed" not in free
    assert "cache_salt" not in free  # no tenant: the engine's cache is shared, as before
    salted = completion_request(
        model="m", prompt=[1], max_tokens=1, limits=GenerationLimits(),
        stop_token_ids=(), cache_salt="k1-salt",
    )  # fmt: skip
    assert salted["cache_salt"] == "k1-salt"


def test_a_structure_goes_to_the_engine_as_a_structural_tag() -> None:
    """What the engine must follow (tests/services/test_vllm.py checks what it accepts) goes as a
    structural tag, and the block still stops at its close."""
    structure = forced_call_format(TOOLS, 1)
    body = completion_request(
        model="m", prompt=[1], max_tokens=8, limits=GenerationLimits(),
        stop_token_ids=(), stop=["</tool_call>"], structure=structure,
    )  # fmt: skip
    assert json.loads(body["structured_outputs"]["structural_tag"]) == structure
    assert body["stop"] == ["</tool_call>"]


def test_the_model_is_picked_from_what_the_engine_serves() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "a", "root": "/models/a", "max_model_len": 8192},
            {"id": "b", "root": None},
        ],
    }
    models = parse_models(body)
    assert models == [ServedModel("a", "/models/a", 8192), ServedModel("b")]
    assert choose_model(models, "b", URL).name == "b"
    with pytest.raises(EngineSetupError, match="pick one with --model"):
        choose_model(models, None, URL)
    with pytest.raises(EngineSetupError, match="serves no model 'c'"):
        choose_model(models, "c", URL)
    assert choose_model(models[:1], None, URL).name == "a"


def test_the_tokenizer_comes_from_the_flag_or_an_existing_root(tmp_path: Any) -> None:
    assert tokenizer_source(ServedModel("a", "/nowhere"), "/my/tok") == "/my/tok"
    assert tokenizer_source(ServedModel("a", str(tmp_path)), None) == str(tmp_path)
    with pytest.raises(EngineSetupError, match="--tokenizer PATH"):
        tokenizer_source(ServedModel("a", "/nowhere/at/all"), None)


async def test_discover_says_what_to_run_when_no_engine_answers() -> None:
    with trio.fail_after(10), pytest.raises(EngineSetupError, match="start vLLM first"):
        await discover(f"http://127.0.0.1:{free_port()}/v1", None)


def test_serve_stops_with_exit_2_when_the_engine_is_not_there() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    command = [sys.executable, "-m", "proto_server", "serve", "--store", ":memory:"]
    done = subprocess.run(
        [*command, "--generator", "vllm", "--engine-url", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no engine answers at" in done.stderr and "--engine-url" in done.stderr
    done = subprocess.run(
        [*command, "--generator", "vllm"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "needs --engine-url" in done.stderr


def test_serve_with_several_engines_stops_with_exit_2_when_none_answers() -> None:
    urls = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    done = subprocess.run(
        [sys.executable, "-m", "proto_server", "serve", "--store", ":memory:", "--generator",
         "vllm", "--engine-url", urls[0], "--engine-url", urls[1]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no engine answers:" in done.stderr
    assert all(f"no engine answers at {url}" in done.stderr for url in urls)


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [("--engine-timeout", "0", "must be positive and finite, got 0.0"),
     ("--engine-timeout", "inf", "must be positive and finite, got inf"),
     ("--engine-timeout", "nan", "must be positive and finite, got nan"),
     ("--engine-connections", "0", "must be at least 1, got 0"),
     ("--max-tokens", "-1", "must be at least 1, got -1"),
     ("--engine-probe-interval", "0", "must be positive and finite, got 0.0"),
     ("--engine-probe-interval", "inf", "must be positive and finite, got inf")],
)  # fmt: skip
def test_the_engine_flags_refuse_what_is_not_a_positive_finite_number(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, why: str
) -> None:
    """Refused before any engine is asked (none runs at the default URL here)."""
    from proto_server.cli import main

    assert main(["serve", "--store", ":memory:", "--generator", "vllm", flag, value]) == 2
    assert capsys.readouterr().err == f"proto-server: {flag}: {why}\n"


def test_help_says_what_model_means_for_each_generator() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proto_server", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    text = " ".join(done.stdout.split())
    assert "vllm: the served model's name" in text
    for flag in ("--engine-url", "--tokenizer", "--engine-connections", "--engine-timeout"):
        assert flag in text


async def test_readyz_is_200_with_a_generator_that_needs_no_engine(
    start_server: StartServer,
) -> None:
    running = await start_server()
    root = running.address.http_url.removesuffix("/v1")
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=root) as http:
            answer = await http.get("/readyz")
    assert answer.status_code == 200 and answer.json() == {"status": "ready"}


SCRIPT = {
    "segments": [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"text": "done"},
    ]
}


async def test_an_append_may_change_the_tool_choice_for_the_rest(
    start_server: StartServer,
) -> None:
    running = await start_server(SCRIPT)
    create = {"type": "response.create", "input": "go", "tools": [EXEC_COMMAND]}
    with trio.fail_after(10):
        async with connect(running.prototype_url) as client:
            await client.send(create)
            events = await client.segment()
            (call,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "a"}
            append = {"type": "response.append", "input": [output]}
            await client.send({**append, "tool_choice": {"type": "function", "name": "nope"}})
            (error,) = await client.segment()
            assert error["type"] == "error" and error["error"]["param"] == "tool_choice"
            await client.send({**append, "tool_choice": "none"})
            events = await client.segment()
    final = events[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["tool_choice"] == "none"


def test_limits_carry_the_sampling_and_the_changed_tool_choice() -> None:
    from proto_server.wire.response import Response

    response = Response(
        id="r", created_at=0, status="in_progress", model="m", temperature=0.2, top_p=0.9,
        seed=3, tool_choice="none",
    )  # fmt: skip
    limits = GenerationLimits.for_response(response, output_tokens=0, tool_calls=0)
    assert (limits.temperature, limits.top_p, limits.seed) == (0.2, 0.9, 3)
    assert limits.tool_choice == ToolChoice("none") and limits.max_calls == 0
