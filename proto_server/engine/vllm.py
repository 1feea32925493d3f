"""The vLLM generator: a rollout kept warm in an inference engine's prefix cache.

This server renders and tokenizes the conversation itself, with the served model's own
tokenizer and chat template (the loader `--generator local` uses), so it always knows the exact
token ids of a prompt. Each segment sends the whole prompt as token ids to the engine's
OpenAI-compatible `/v1/completions` (streamed, `return_token_ids`), so its automatic prefix
cache finds every block it already holds (the previous prompt, and the model's own output where
the chat template renders it as the model wrote it) and prefills only the tail. The prompt is
always the conversation as rendered, as a cold re-prefill would send it; the ids the engine saw
last (the prompt and what it generated) are kept to know what it should find cached. The
engine's own count, `usage.prompt_tokens_details.cached_tokens`, is what the Response reports.

A forced call (`tool_choice` required or named) opens the call in the prompt (`<tool_call>[`
for Hermes, each family its own, families/) and constrains the rest to a block of calls of the
allowed tools in the family's syntax with vLLM's structured outputs (structural tags); both go
through the family's parser, as the local model's do, the forced one streamed as it
decodes (it cannot be invalid), an unforced one held until its block closes. A structured
answer (`text.format`) is constrained the same way, to a JSON instance of its schema (or a call
block, when calls are allowed); the schema is checked with llguidance when the request arrives,
so one no grammar takes is a 400 rather than a failed Response.

Every failure of the engine becomes an `EngineError` with a code (`engine_unavailable`,
`engine_error`, `engine_timeout`, `context_length_exceeded`), raised here and turned into
`response.failed` by the sampling loop. Cancelling a segment closes its HTTP stream, which
makes vLLM abort the request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from proto_server.core.conversation import Conversation
from proto_server.core.text_format import TextFormat
from proto_server.engine.chat_template import RENDER_CACHE_BYTES
from proto_server.engine.chunks import Chunk, Prefilled, SegmentEnd, hand_over
from proto_server.engine.families import AUTO, choose
from proto_server.engine.families.base import CallFrame
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.limits import ENGINE_UNAVAILABLE, GenerationLimits, GeneratorError
from proto_server.engine.model_files import LoadedTokenizer
from proto_server.engine.thinking import split_thinking
from proto_server.engine.tokens import common_prefix
from proto_server.wire.tools import FunctionTool, function_tools

ENGINE_ERROR = "engine_error"
ENGINE_TIMEOUT = "engine_timeout"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

#: How much of an engine's error body is read to say what went wrong.
ERROR_BODY_BYTES = 64 * 1024
#: A streamed completion is read as raw bytes (`sse_lines`): nothing may encode it.
STREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
#: How long start-up and `/readyz` wait for the engine to list its models.
PROBE_TIMEOUT_S = 5.0
log = logging.getLogger("proto_server.engine.vllm")  # the server's structured log lines
CPU_RECIPE = (
    "python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --enable-prefix-caching "
    "--enable-prompt-tokens-details"
)


class EngineError(GeneratorError):
    """The engine refused, failed, stalled or went away; `code` says which."""


class EngineSetupError(Exception):
    """The engine or the model's tokenizer cannot be had at start-up; the message says what to
    run or pass."""


# -- what the engine says, as data ---------------------------------------------------------------


@attrs.frozen
class ServedModel:
    """One model the engine serves: its served name, the path it was loaded from."""

    name: str
    root: str | None = None
    max_model_len: int | None = None


@attrs.frozen
class Piece:
    """One streamed choice: its text, the ids that made it, and why it stopped, if it did."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@attrs.frozen
class EngineUsage:
    prompt_tokens: int
    completion_tokens: int
    #: The engine's prefix-cache hits (None: it was started without prompt-token details).
    cached_tokens: int | None


def parse_models(body: Any) -> list[ServedModel]:
    """The models of a `GET /v1/models` answer."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise EngineSetupError(f"the engine's /v1/models answer is not a model list: {body!r}")
    models = []
    for entry in body["data"]:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            root, length = entry.get("root"), entry.get("max_model_len")
            models.append(
                ServedModel(
                    entry["id"],
                    root if isinstance(root, str) else None,
                    length if isinstance(length, int) else None,
                )
            )
    return models


def choose_model(models: Sequence[ServedModel], wanted: str | None, url: str) -> ServedModel:
    """The served model named `wanted`, or the only one."""
    names = ", ".join(model.name for model in models) or "none"
    if wanted is not None:
        for model in models:
            if model.name == wanted:
                return model
        raise EngineSetupError(
            f"the engine at {url} serves no model {wanted!r} (it serves: {names}); pass one of "
            "them with --model"
        )
    if len(models) != 1:
        raise EngineSetupError(
            f"the engine at {url} serves {len(models)} models ({names}); pick one with --model"
        )
    return models[0]


def parse_sse(line: bytes | str) -> Piece | EngineUsage | None:
    """One line of the engine's event stream: a piece of output, the final usage, or nothing
    (blank lines, comments, `[DONE]`). An error the engine streams raises `EngineError`."""
    if isinstance(line, str):
        line = line.encode()
    if not line.startswith(b"data:"):
        return None
    data = line[len(b"data:") :].strip()
    if data == b"[DONE]" or not data:
        return None
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EngineError(
            ENGINE_ERROR, f"the engine streamed something not JSON: {data[:200]!r}"
        ) from exc
    if not isinstance(event, dict):
        raise EngineError(ENGINE_ERROR, f"the engine streamed an unexpected value: {data[:200]!r}")
    if "error" in event:
        raise error_for_body(500, event)
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        return Piece(
            choice.get("text") or "",
            tuple(choice.get("token_ids") or ()),
            choice.get("finish_reason"),
        )
    usage = event.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        return EngineUsage(
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            details.get("cached_tokens") if isinstance(details, dict) else None,
        )
    return None


async def sse_lines(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of an event stream as the engine sends it (plain bytes: it is asked for no
    encoding), without the text decoding httpx's own line reader does for every piece."""
    pending = b""
    async for part in parts:
        *lines, pending = (pending + part).split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return repr(body)[:500]


def error_for_body(status: int, body: Any) -> EngineError:
    """What an engine's refusal means for the Response: a prompt over the model's context is
    `context_length_exceeded`; anything else the engine could not do is `engine_error`."""
    message = _message(body)
    if status == 400 and ("context length" in message or "maximum model length" in message):
        return EngineError(
            CONTEXT_LENGTH_EXCEEDED,
            f"the conversation no longer fits the model's context ({message}); start a new "
            "Response with a shorter history",
        )
    return EngineError(ENGINE_ERROR, f"the engine answered {status}: {message}")


def error_for_status(status: int, raw: bytes) -> EngineError:
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = raw[:500].decode("utf-8", "replace")
    return error_for_body(status, body)


def error_for_exception(exc: httpx.HTTPError, url: str) -> EngineError:
    """A transport failure: a stall is `engine_timeout`, an engine that is not there (or went
    away mid-stream) `engine_unavailable`, anything else `engine_error`."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return EngineError(ENGINE_UNAVAILABLE, f"the engine at {url} is not reachable ({exc!r})")
    if isinstance(exc, httpx.TimeoutException):
        return EngineError(
            ENGINE_TIMEOUT,
            f"the engine at {url} sent nothing for too long ({exc!r}; --engine-timeout)",
        )
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return EngineError(ENGINE_UNAVAILABLE, f"the engine at {url} went away ({exc!r})")
    return EngineError(ENGINE_ERROR, f"the engine at {url} failed: {exc!r}")


# -- what is sent to the engine -----------------------------------------------------------------


#: The arguments of a call that is not `strict` under `auto`: any object, as the model wrote it.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: How many whitespace characters may follow one another in constrained arguments: enough for
#: `json.dumps`'s `", "` and `": "`, too few for a runaway model to pad forever.
MAX_WHITESPACE = 1


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _arguments(tool: FunctionTool, constrained: bool) -> dict[str, Any]:
    schema = (tool.parameters or ANY_OBJECT) if constrained else ANY_OBJECT
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _named(tools: Sequence[FunctionTool], constrained: bool, frame: CallFrame) -> dict[str, Any]:
    """The rest of a call after its name's prefix: one of `tools`' names, then its arguments."""
    calls = [
        _sequence(
            _const(f"{tool.name}{frame.name_suffix}"),
            _arguments(tool, constrained or bool(tool.strict)),
        )
        for tool in tools
    ]
    named = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    return _sequence(named, _const(frame.args_suffix)) if frame.args_suffix else named


def _more_calls(
    tools: Sequence[FunctionTool], max_calls: int | None, constrained: bool, frame: CallFrame
) -> list[dict[str, Any]]:
    """The calls after the first in one block, as many as the request still allows."""
    max_calls = frame.most_calls(max_calls)
    if max_calls == 1 or frame.separator is None:
        return []
    call = _sequence(_const(frame.separator + frame.name_prefix), _named(tools, constrained, frame))
    most = -1 if max_calls is None else max_calls - 1
    return [{"type": "repeat", "min": 0, "max": most, "content": call}]


def _close(frame: CallFrame) -> list[dict[str, Any]]:
    return [_const(frame.close)] if frame.close else []


def forced_call_head(tools: Sequence[FunctionTool], frame: CallFrame = HERMES.frame) -> str:
    """What a forced call is sure to start with, put in the prompt rather than decoded: the
    block's opening up to the name, and with one tool allowed, up to its arguments (but the
    whitespace before them). Decoding it would cost a step per token before the arguments, the
    client seeing nothing meanwhile."""
    head = frame.opening
    if len(tools) == 1:
        head += tools[0].name + frame.name_suffix.rstrip(" ")
    return head


def forced_call_format(
    tools: Sequence[FunctionTool], max_calls: int | None, frame: CallFrame = HERMES.frame
) -> dict[str, Any]:
    """vLLM's structured output (an xgrammar structural tag) for what follows
    `forced_call_head`: the first call's rest, more calls up to `max_calls`, the block's close;
    every call's arguments valid against its tool's parameters."""
    if len(tools) == 1:
        space = frame.name_suffix[len(frame.name_suffix.rstrip(" ")) :]
        first = _sequence(
            *([_const(space)] if space else []),
            _arguments(tools[0], True),
            *([_const(frame.args_suffix)] if frame.args_suffix else []),
        )
    else:
        first = _named(tools, True, frame)
    more = _more_calls(tools, max_calls, True, frame)
    return {"type": "structural_tag", "format": _sequence(first, *more, *_close(frame))}


def answer_format(
    form: TextFormat,
    tools: Sequence[FunctionTool],
    max_calls: int | None,
    frame: CallFrame = HERMES.frame,
) -> dict[str, Any]:
    """The structured output of a structured answer: JSON valid against `form`'s schema, with
    at most `MAX_WHITESPACE` whitespace in a row; with `tools`, a call block instead is allowed
    (a `strict` tool's arguments valid against its parameters)."""
    answer = {
        "type": "json_schema",
        "json_schema": dict(form.schema),
        "max_whitespace_cnt": MAX_WHITESPACE,
    }
    if not tools:
        return {"type": "structural_tag", "format": answer}
    block = _sequence(
        _const(frame.opening),
        _named(tools, False, frame),
        *_more_calls(tools, max_calls, False, frame),
        *_close(frame),
    )
    return {"type": "structural_tag", "format": {"type": "or", "elements": [answer, block]}}


def strict_call_format(
    tools: Sequence[FunctionTool], max_calls: int | None, frame: CallFrame = HERMES.frame
) -> dict[str, Any]:
    """The structured output under `auto` when a tool is `strict`: text is free, and a block the
    model opens holds calls of the offered tools, a `strict` one's arguments valid against its
    parameters (the others' any object). Where each call opens its own block and nothing
    closes it (Mistral's `[TOOL_CALLS]name[ARGS]{...}`), each call is a tag of its own (the
    parser keeps the calls the request allows)."""
    if not frame.close and frame.separator == frame.open:
        tags = [
            {
                "type": "tag",
                "begin": f"{frame.open}{frame.name_prefix}{tool.name}{frame.name_suffix}",
                "content": _arguments(tool, bool(tool.strict)),
                "end": frame.args_suffix,
            }
            for tool in tools
        ]
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [frame.open], "tags": tags},
        }
    block = {
        "type": "tag",
        "begin": frame.opening if frame.bare else frame.open + frame.list_open + frame.name_prefix,
        "content": _sequence(
            _named(tools, False, frame), *_more_calls(tools, max_calls, False, frame)
        ),
        "end": frame.close,
    }
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": [frame.trigger], "tags": [block]},
    }


def completion_request(
    *,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    limits: GenerationLimits,
    stop_token_ids: Collection[int],
    stop: Sequence[str] = (),
    structure: dict[str, Any] | None = None,
    stream: bool = True,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The body of one `/v1/completions` request: the prompt as token ids, streamed with its
    ids and usage; the request's sampling passed through; stopping at the model's end of turn
    and at `stop` (a call block's close, where the family's block has one); `structure`: a
    structural tag the output must follow (`forced_call_format`, `strict_call_format`,
    `answer_format`); `cache_salt`: the tenant's, so the engine's prefix cache keeps tenants
    apart (vLLM's `cache_salt`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "stream": stream,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stop_token_ids": sorted(stop_token_ids),
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "seed", "priority"):
        value = getattr(limits, name)
        if value is not None:
            body[name] = value
    if stop:
        body["stop"] = list(stop)
        body["include_stop_str_in_output"] = True
    if structure is not None:
        body["structured_outputs"] = {"structural_tag": json.dumps(structure)}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


# -- the generator -------------------------------------------------------------------------------

#: The engine's info gauge whose labels say its KV cache's size (vLLM 0.32 `v1/metrics`).
CACHE_CONFIG_INFO = "vllm:cache_config_info"


def parse_kv_capacity(text: str) -> int | None:
    """The engine's KV cache in tokens, from its `/metrics` scrape: the labels of
    `vllm:cache_config_info`, `kv_cache_size_tokens` (what the engine logs as its KV cache
    size) or else `num_gpu_blocks` times `block_size`, summed over its engines (data
    parallel: each has its own cache); None if it does not say."""
    total, found = 0, False
    for family in text_string_to_metric_families(text):
        if family.name != CACHE_CONFIG_INFO:
            continue
        for sample in family.samples:
            labels = sample.labels
            try:
                if labels.get("kv_cache_size_tokens", "None") != "None":
                    tokens = int(labels["kv_cache_size_tokens"])
                else:
                    tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):  # not initialised yet ("None")
                continue
            total += tokens
            found = True
    return total if found else None


async def engine_kv_capacity(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """Ask the engine at `url` (its `/v1` base) how many tokens its KV cache holds, at start-up
    (`--kv-capacity-from-engine`); None if its `/metrics` does not say or does not answer."""
    root = url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(base_url=root, timeout=timeout_s) as client:
            answer = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_kv_capacity(answer.text) if answer.status_code == 200 else None


async def discover(url: str, wanted: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> ServedModel:
    """Ask the engine at `url` which model it serves (`GET /models`), at start-up."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            answer = await client.get("/models")
    except httpx.HTTPError as exc:
        raise EngineSetupError(
            f"no engine answers at {url} ({exc.__class__.__name__}); start vLLM first, e.g. "
            f"{CPU_RECIPE}, and pass its base URL (ending in /v1) with --engine-url"
        ) from exc
    if answer.status_code != 200:
        raise EngineSetupError(
            f"{url}/models answered {answer.status_code}; is --engine-url the engine's "
            "OpenAI-compatible base (e.g. http://127.0.0.1:8001/v1)?"
        )
    try:
        body = answer.json()
    except ValueError as exc:
        raise EngineSetupError(f"{url}/models did not answer JSON; is it vLLM?") from exc
    return choose_model(parse_models(body), wanted, url)


async def discover_replicas(
    urls: Sequence[str], wanted: str | None, timeout_s: float = PROBE_TIMEOUT_S
) -> tuple[ServedModel, dict[int, str]]:
    """Ask every engine at once which model it serves, at start-up: the model, and which of
    them do not answer (by index, with why). Those that answer must serve the same model under
    the same name and context length; at least one must answer."""
    found: dict[int, ServedModel] = {}
    down: dict[int, str] = {}

    async def ask(index: int, url: str) -> None:
        try:
            found[index] = await discover(url, wanted, timeout_s)
        except EngineSetupError as exc:
            down[index] = str(exc)

    async with trio.open_nursery() as nursery:
        for index, url in enumerate(urls):
            nursery.start_soon(ask, index, url)
    if not found:
        raise EngineSetupError("no engine answers: " + "; ".join(down[i] for i in sorted(down)))
    models = {(model.name, model.max_model_len) for model in found.values()}
    if len(models) > 1:
        served = ", ".join(
            f"{urls[i]} serves {found[i].name!r} ({found[i].max_model_len} tokens)"
            for i in sorted(found)
        )
        raise EngineSetupError(
            f"the engines serve different models ({served}); every --engine-url must serve "
            "the same model, under the same name and context length"
        )
    return found[min(found)], down


def tokenizer_source(model: ServedModel, tokenizer: str | None) -> str:
    """Where the served model's tokenizer is read from: `--tokenizer`, else the engine's
    `root` when that path exists on this machine."""
    if tokenizer is not None:
        return tokenizer
    if model.root is not None and Path(model.root).exists():
        return model.root
    raise EngineSetupError(
        f"the engine serves {model.name!r} from {model.root!r}, which is not on this machine; "
        "pass the model's tokenizer with --tokenizer PATH (a Hugging Face model directory or "
        "a GGUF file of the same model)"
    )


class VllmGenerator:
    """A model served by vLLM; every rollout's session shares one bounded HTTP client."""

    #: A forced call is constrained by the engine's structured outputs.
    forces_tool_calls = True

    def __init__(
        self,
        url: str,
        model: ServedModel,
        tokenizer: LoadedTokenizer,
        *,
        max_tokens: int = 512,
        connections: int = 64,
        timeout_s: float = 60.0,
        render_cache_bytes: int = RENDER_CACHE_BYTES,
        tool_syntax: str = AUTO,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer.tokenizer
        #: The model family's call syntax (`--tool-syntax`; families/).
        self.syntax = choose(self.tokenizer, tool_syntax)
        self.renderer = self.syntax.renderer(self.tokenizer, cache_bytes=render_cache_bytes)
        self.stop_ids = self.syntax.stop_ids(self.tokenizer, tokenizer.eos_token_id)
        #: What the engine writes for each: the end of the model's turn is no text of its own.
        self.stop_texts = {i: self.tokenizer.decode([i]) for i in self.stop_ids}
        self.max_tokens = max_tokens
        self.connections = connections
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client, made on first use inside the running event loop."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                limits=httpx.Limits(
                    max_connections=self.connections, max_keepalive_connections=self.connections
                ),
                timeout=httpx.Timeout(self.timeout_s, connect=PROBE_TIMEOUT_S),
            )
        return self._client

    def check_text_format(self, form: TextFormat) -> None:
        """Refuse a schema llguidance cannot compile, which vLLM (whose backends are llguidance
        and xgrammar) cannot either. Without llguidance installed the engine is the judge: its
        refusal fails the Response."""
        try:
            from proto_server.engine.schema_grammar import check_text_format
        except ImportError:
            return
        check_text_format(form)

    def open_session(
        self, conversation: Conversation, *, cache_salt: str | None = None
    ) -> VllmSession:
        return VllmSession(self, conversation, cache_salt=cache_salt)

    async def readiness(self) -> str | None:
        """None when the engine lists the served model within a short timeout; else why not."""
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                answer = await self.client.get("/models", timeout=PROBE_TIMEOUT_S)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            return f"the engine at {self.url} does not answer ({exc.__class__.__name__})"
        if answer.status_code != 200:
            return f"the engine at {self.url} answered {answer.status_code}"
        try:
            served = [model.name for model in parse_models(answer.json())]
        except (ValueError, EngineSetupError):
            return f"the engine at {self.url} does not list its models"
        if self.model.name not in served:  # restarted with another model
            return f"the engine at {self.url} serves {served}, not {self.model.name!r}"
        return None

    async def engine_models(self) -> list[dict[str, Any]] | None:
        """The engine's `/v1/models` entries, as it lists them (within a short timeout)."""
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                answer = await self.client.get("/models", timeout=PROBE_TIMEOUT_S)
            body = answer.json()
        except (httpx.HTTPError, trio.TooSlowError, ValueError):
            return None
        data = body.get("data") if answer.status_code == 200 and isinstance(body, dict) else None
        if not isinstance(data, list):
            return None
        return [entry for entry in data if isinstance(entry, dict) and "id" in entry]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class VllmSession:
    """One rollout on the engine: nothing is held there but what its prefix cache keeps."""

    def __init__(
        self, generator: VllmGenerator, conversation: Conversation, *, cache_salt: str | None
    ) -> None:
        self._generator = generator
        self._conversation = conversation
        self._cache_salt = cache_salt
        self._tools = function_tools(conversation.tools)
        #: The token ids the engine has seen last: the prompt it was sent and what it made.
        self.engine_ids: list[int] = []
        #: Per segment: (prompt tokens, what should be cached, what the engine said it had).
        self.segments: list[tuple[int, int, int | None]] = []

    async def prefill(self) -> Prefilled:
        """Bring the engine's cache up to the conversation (one token decoded and dropped)."""
        generator = self._generator
        prompt = list(self._conversation.tokens)
        body = completion_request(
            model=generator.name,
            prompt=prompt,
            max_tokens=1,
            limits=GenerationLimits(temperature=0.0),
            stop_token_ids=(),
            stream=False,
            cache_salt=self._cache_salt,
        )
        try:
            answer = await generator.client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, generator.url) from exc
        if answer.status_code != 200:
            raise error_for_status(answer.status_code, answer.content[:ERROR_BODY_BYTES])
        usage = answer.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self._record(prompt, prompt, int(cached))
        return Prefilled(prompt_tokens=len(prompt), cached_tokens=int(cached))

    async def generate(self, send: trio.MemorySendChannel[Chunk], limits: GenerationLimits) -> None:
        generator = self._generator
        prompt = [*self._conversation.tokens, *generator.renderer.generation_prompt]
        names = [tool.name for tool in self._tools]
        syntax = generator.syntax
        frame = syntax.frame
        head, structure = "", None
        if limits.must_call:
            choice = limits.tool_choice
            allowed = [t for t in self._tools if choice.name in (None, t.name)]
            head = forced_call_head(allowed, frame)
            structure = forced_call_format(allowed, limits.max_calls, frame)
            prompt += generator.tokenizer.encode(head, add_special_tokens=False)
        elif limits.text_format is not None:
            callable_tools = self._tools if limits.max_calls != 0 else []
            structure = answer_format(limits.text_format, callable_tools, limits.max_calls, frame)
        elif names and limits.max_calls != 0 and any(tool.strict for tool in self._tools):
            structure = strict_call_format(self._tools, limits.max_calls, frame)
        most = generator.max_tokens
        if limits.max_output_tokens is not None:
            most = min(most, limits.max_output_tokens)
        context = generator.model.max_model_len
        if context is not None and len(prompt) < context:
            most = min(most, context - len(prompt))  # longer: the engine refuses it, and says so
        renderer = generator.renderer
        parser = split_thinking(  # a model that thinks, unconstrained, writes `<think>` first
            syntax.parser(names, max_calls=limits.max_calls, forced=structure is not None),
            thinks=renderer.thinks and structure is None,
            opened=renderer.opens_thinking,
        )
        if most <= 0:
            await send.send(Prefilled(prompt_tokens=len(prompt), cached_tokens=0))
            await send.send(SegmentEnd(incomplete="max_output_tokens"))
            return
        body = completion_request(
            model=generator.name,
            prompt=prompt,
            max_tokens=most,
            limits=limits,
            stop_token_ids=generator.stop_ids,
            stop=syntax.stop if names and limits.max_calls != 0 else (),
            structure=structure,
            cache_salt=self._cache_salt,
        )
        generated: list[int] = []
        finish: str | None = None
        usage: EngineUsage | None = None
        chunks: list[Chunk] = parser.feed(head, 0) if head else []
        prefilled = False
        try:
            async with generator.client.stream(
                "POST", "/completions", content=orjson.dumps(body), headers=STREAM_HEADERS
            ) as answer:
                if answer.status_code != 200:
                    raw = b""
                    async for part in answer.aiter_bytes():
                        raw += part
                        if len(raw) >= ERROR_BODY_BYTES:
                            break
                    raise error_for_status(answer.status_code, raw)
                async for line in sse_lines(answer.aiter_raw()):
                    event = parse_sse(line)
                    if isinstance(event, EngineUsage):
                        usage = event
                    elif isinstance(event, Piece):
                        if not prefilled:  # the engine has the prompt: the first piece came
                            prefilled = True
                            await hand_over(
                                send, Prefilled(prompt_tokens=len(prompt), cached_tokens=0)
                            )
                        generated.extend(event.token_ids)
                        finish = event.finish_reason or finish
                        text = event.text
                        if event.token_ids and event.token_ids[-1] in generator.stop_ids:
                            text = text.removesuffix(generator.stop_texts[event.token_ids[-1]])
                        for chunk in [*chunks, *parser.feed(text, len(event.token_ids))]:
                            await hand_over(send, chunk)
                        chunks = []
        except httpx.HTTPError as exc:
            error = error_for_exception(exc, generator.url)
            error.unsent = not prefilled  # nothing handed over: another replica may take it
            raise error from exc
        if finish is None or finish == "abort" or not prefilled:
            raise EngineError(
                ENGINE_UNAVAILABLE if finish is None else ENGINE_ERROR,
                f"the engine's stream ended before the segment did (finish reason {finish!r})",
                unsent=not prefilled,
            )
        held, leftover = parser.finish()
        for chunk in held:
            await send.send(chunk)
        cached = usage.cached_tokens if usage is not None else None
        self._record(prompt, [*prompt, *generated], cached)
        await send.send(
            SegmentEnd(
                tokens=leftover,
                incomplete="max_output_tokens" if finish == "length" else None,
                cached_tokens=cached,
            )
        )

    def _record(self, prompt: list[int], seen: list[int], cached: int | None) -> None:
        expected = common_prefix(self.engine_ids, prompt)
        self.segments.append((len(prompt), expected, cached))
        log.debug(
            "vllm.segment",
            extra={"prompt_tokens": len(prompt), "expected_cached": expected, "cached": cached},
        )
        self.engine_ids = seen

    async def aclose(self) -> None:
        """Nothing to free: the engine's prefix cache evicts what no one uses."""
