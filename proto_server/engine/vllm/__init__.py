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

The package holds one idea per module: `protocol` (what goes over the wire to the engine and
what comes back: requests, streamed pieces, usage, refusals, `/metrics`), `grammar` (what
constrains a segment: vLLM's structural tags for forced and strict calls and structured
answers), `discovery` (what the engine serves, asked at start-up), `generator` (the
`TokenGenerator`: one shared HTTP client, readiness) and `session` (one rollout's segments).
Every name importers use is re-exported here.
"""

from proto_server.engine.limits import ENGINE_UNAVAILABLE
from proto_server.engine.vllm.discovery import (
    CPU_RECIPE,
    discover,
    discover_replicas,
    engine_kv_capacity,
    tokenizer_source,
)
from proto_server.engine.vllm.generator import VllmGenerator
from proto_server.engine.vllm.grammar import (
    ANY_OBJECT,
    MAX_WHITESPACE,
    answer_format,
    forced_call_format,
    forced_call_head,
    strict_call_format,
)
from proto_server.engine.vllm.protocol import (
    CACHE_CONFIG_INFO,
    CONTEXT_LENGTH_EXCEEDED,
    ENGINE_ERROR,
    ENGINE_TIMEOUT,
    ERROR_BODY_BYTES,
    PROBE_TIMEOUT_S,
    STREAM_HEADERS,
    EngineError,
    EngineSetupError,
    EngineUsage,
    Piece,
    ServedModel,
    choose_model,
    completion_request,
    error_for_body,
    error_for_exception,
    error_for_status,
    parse_kv_capacity,
    parse_models,
    parse_sse,
    sse_lines,
)
from proto_server.engine.vllm.session import VllmSession

__all__ = [
    "ANY_OBJECT",
    "CACHE_CONFIG_INFO",
    "CONTEXT_LENGTH_EXCEEDED",
    "CPU_RECIPE",
    "ENGINE_ERROR",
    "ENGINE_TIMEOUT",
    "ENGINE_UNAVAILABLE",
    "ERROR_BODY_BYTES",
    "MAX_WHITESPACE",
    "PROBE_TIMEOUT_S",
    "STREAM_HEADERS",
    "EngineError",
    "EngineSetupError",
    "EngineUsage",
    "Piece",
    "ServedModel",
    "VllmGenerator",
    "VllmSession",
    "answer_format",
    "choose_model",
    "completion_request",
    "discover",
    "discover_replicas",
    "engine_kv_capacity",
    "error_for_body",
    "error_for_exception",
    "error_for_status",
    "forced_call_format",
    "forced_call_head",
    "parse_kv_capacity",
    "parse_models",
    "parse_sse",
    "sse_lines",
    "strict_call_format",
    "tokenizer_source",
]
