"""The Response object that response-level events carry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from proto_server.wire.errors import ErrorDetail
from proto_server.wire.items import Item
from proto_server.wire.tools import Tool


@attrs.frozen(kw_only=True)
class InputTokensDetails:
    cached_tokens: int = 0
    #: OpenAI's API requires it (openai-python 3.57); this server writes no cache it bills.
    cache_write_tokens: int = 0


@attrs.frozen(kw_only=True)
class OutputTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen(kw_only=True)
class Usage:
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


@attrs.frozen(kw_only=True)
class Response:
    """Every field the published Responses API schema requires; nullable ones as null."""

    #: What `text` is when a request sets none.
    DEFAULT_TEXT: ClassVar[Mapping[str, Any]] = {"format": {"type": "text"}}

    id: str
    object: str = "response"
    created_at: int
    #: When it completed (unix seconds); null unless `status` is `completed`.
    completed_at: int | None = None
    status: str
    background: bool = False
    error: ErrorDetail | None = None
    incomplete_details: Mapping[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: tuple[Item, ...] = ()
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: Any = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: Any = attrs.field(factory=lambda: dict(Response.DEFAULT_TEXT))
    tool_choice: Any = "auto"
    tools: tuple[Tool, ...] = ()
    top_logprobs: int = 0
    top_p: float = 1.0
    #: This server's extension: the sampling seed the request set (null: none).
    seed: int | None = None
    truncation: str = "disabled"
    usage: Usage | None = None
    user: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
