"""Which constraint a segment decodes under, decided once for every engine (sans-IO).

The request's limits and the offered tools decide it; each engine only turns the plan into its
own mechanism (the local model: an llguidance grammar, constraints.py; vLLM: the request's
structural tag, vllm/grammar.py). In order: a call the segment must make (`tool_choice`
required or a named function, calls still allowed); a structured answer (`text.format`), or a
call block where calls are allowed; nothing when no call is left; under `auto` with a `strict`
tool, the calls the model opens; else nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from proto_server.core.text_format import TextFormat
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.wire.tools import FunctionTool


@attrs.frozen
class Unconstrained:
    """The model writes what it likes; the parser finds any call in it."""


@attrs.frozen
class ForcedCall:
    """The segment is calls of `tools` from its first token, at most `max_calls` of them."""

    tools: tuple[FunctionTool, ...]
    max_calls: int | None


@attrs.frozen
class StructuredAnswer:
    """A JSON answer of `form`'s schema, or, where `tools` is not empty, a call block instead."""

    form: TextFormat
    tools: tuple[FunctionTool, ...]
    max_calls: int | None


@attrs.frozen
class StrictCalls:
    """Free text, and a call block the model opens holds valid calls of `tools` (a lazy
    grammar: a `strict` tool's arguments follow its schema)."""

    tools: tuple[FunctionTool, ...]
    max_calls: int | None


ConstraintPlan = Unconstrained | ForcedCall | StructuredAnswer | StrictCalls


def plan_constraint(
    limits: GenerationLimits, tools: Sequence[FunctionTool], *, guided: bool
) -> ConstraintPlan:
    """The constraint of a segment within `limits` offered `tools` (the named one only, where
    `tool_choice` names one). `guided`: the engine can decode under a grammar; without one a
    `strict` tool's call is decoded free (a forced call or a structured answer was refused when
    the request arrived: `forces_tool_calls`, `check_text_format`). A forced call with no tool
    to call is refused (`GenerationRefused`)."""
    allowed = tuple(tool for tool in tools if limits.tool_choice.name in (None, tool.name))
    max_calls = limits.max_calls
    if limits.must_call:
        if not allowed:
            raise GenerationRefused(
                "unsupported_tool_choice",
                'tool_choice is "required", but the request offers no function tool to call.',
            )
        return ForcedCall(allowed, max_calls)
    if limits.text_format is not None:
        return StructuredAnswer(limits.text_format, allowed if max_calls != 0 else (), max_calls)
    if max_calls != 0 and guided and any(tool.strict for tool in allowed):
        return StrictCalls(allowed, max_calls)
    return Unconstrained()
