"""The constrained scalars of the events' fields: each a `NewType` that the converter checks
(wire/converter.py), refusing any other value with the field's path."""

from __future__ import annotations

from typing import NewType

#: An integer above zero (`max_output_tokens`); the converter refuses anything else.
PositiveInt = NewType("PositiveInt", int)
#: An integer of zero or more (`max_tool_calls`); the converter refuses anything else.
NonNegativeInt = NewType("NonNegativeInt", int)
#: A lane of a WebSocket connection: 1-256 of `[A-Za-z0-9_.-]`, as the SDKs allow; the
#: converter refuses anything else with `invalid_stream_id`.
StreamId = NewType("StreamId", str)
