"""What the engine serves, asked once at start-up: its model, its replicas, its KV cache.

Kept apart from the generator because it runs before one exists (`serve --generator vllm`,
`bench`): each failure is an `EngineSetupError` whose message says what to start or pass, which
the command line turns into a refusal rather than a failed Response.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx
import trio

from proto_server.engine.vllm.protocol import (
    PROBE_TIMEOUT_S,
    EngineSetupError,
    ServedModel,
    choose_model,
    parse_kv_capacity,
    parse_models,
)

CPU_RECIPE = (
    "python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --enable-prefix-caching "
    "--enable-prompt-tokens-details"
)


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
