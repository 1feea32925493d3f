"""What constrains a segment on vLLM: structural tags for its structured outputs.

A forced call (`tool_choice` required or named) opens its block in the prompt
(`forced_call_head`) and is constrained to calls of the allowed tools in the family's syntax
(`forced_call_format`); a `strict` tool under `auto` constrains only the blocks the model opens
(`strict_call_format`); a structured answer (`text.format`) is JSON valid against its schema,
or a call block where calls are allowed (`answer_format`). Kept apart from the wire protocol:
these are pure functions of the tools and the family's `CallFrame`, which the protocol only
carries as `structured_outputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proto_server.core.text_format import TextFormat
from proto_server.engine.families.base import CallFrame
from proto_server.engine.families.hermes import HERMES
from proto_server.wire.tools import FunctionTool

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
