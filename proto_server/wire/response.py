"""The Response object that response-level events carry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from proto_server.wire.errors import ErrorDetail
from proto_server.wire.items import Item
from proto_server.wire.tools import Tool


@attrs.frozen(kw_only=True)
class InputTokensDetails:
    cached_tokens: int = 0


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
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: tuple[Item, ...] = ()
    previous_response_id: str | None = None
    instructions: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    store: bool = False
    error: ErrorDetail | None = None
    incomplete_details: Mapping[str, Any] | None = None
    usage: Usage | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
