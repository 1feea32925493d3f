"""What goes over the wire between this server and vLLM's OpenAI-compatible server, as data.

Kept apart from the session so the engine's protocol can be read (and tested) without a socket:
the body of a `/v1/completions` request, the lines of its event stream (a piece of output, the
final usage, a streamed error), the models `/v1/models` lists, the KV cache `/metrics` reports,
and what each of the engine's refusals and transport failures means for the Response (an
`EngineError` with a code).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import attrs
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from proto_server.engine.limits import ENGINE_UNAVAILABLE, GenerationLimits, GeneratorError

ENGINE_ERROR = "engine_error"
ENGINE_TIMEOUT = "engine_timeout"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

#: How much of an engine's error body is read to say what went wrong.
ERROR_BODY_BYTES = 64 * 1024
#: A streamed completion is read as raw bytes (`sse_lines`): nothing may encode it.
STREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
#: How long start-up and `/readyz` wait for the engine to list its models.
PROBE_TIMEOUT_S = 5.0


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


#: A sampled token's logprob, and the likeliest tokens at its position (id, logprob), the
#: likeliest first: what the engine says of each token when asked (`logprobs`).
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@attrs.frozen
class Piece:
    """One streamed choice: its text, the ids that made it, and why it stopped, if it did;
    with the logprob of each of those ids, when they were asked for."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


#: How the engine names a token it is asked to name by id (`return_tokens_as_token_ids`).
TOKEN_ID = "token_id:"


def _token_id(name: str) -> int:
    if not name.startswith(TOKEN_ID):
        raise EngineError(ENGINE_ERROR, f"the engine named a token {name!r}, not by its id")
    return int(name[len(TOKEN_ID) :])


def parse_logprobs(value: Any) -> tuple[TokenLogprob, ...]:
    """A streamed choice's `logprobs` (the completions API's: `token_logprobs` and, per token,
    `top_logprobs` by `token_id:N`, the sampled token among them), each token's likeliest
    sorted, likeliest first (the engine lists the sampled token first)."""
    if not isinstance(value, dict):
        return ()
    sampled = value.get("token_logprobs") or []
    tops = value.get("top_logprobs") or [None] * len(sampled)
    parsed = []
    for logprob, top in zip(sampled, tops, strict=True):
        ranked = sorted(
            ((_token_id(name), float(other)) for name, other in (top or {}).items()),
            key=lambda entry: -entry[1],
        )
        parsed.append((float(logprob if logprob is not None else "-inf"), tuple(ranked)))
    return tuple(parsed)


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
            parse_logprobs(choice.get("logprobs")),
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
    apart (vLLM's `cache_salt`); the logprobs the limits ask for, their tokens named by id."""
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
    if limits.engine_logprobs is not None:
        body["logprobs"] = limits.engine_logprobs
        body["return_tokens_as_token_ids"] = True
    if structure is not None:
        body["structured_outputs"] = {"structural_tag": json.dumps(structure)}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


# -- what the engine says of its KV cache ----------------------------------------------------------

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
