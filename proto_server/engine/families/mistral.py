"""Mistral's and Devstral's `[TOOL_CALLS]`, in the tokenizer's two versions.

From tokenizer version 11 (the vocabulary has `[ARGS]`) each call is
`[TOOL_CALLS]NAME[ARGS]{...}`, calls one after another; before it, one `[TOOL_CALLS]` opens a
JSON list, `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}, ...]` (mistral-common
writes the call's id, which the server reads past: `call_id`s are its own). Either way the
block ends with the turn (`</s>`), as vLLM's `mistral` parser reads it.

Conversations are rendered by mistral-common where the model's folder has its `tekken.json`
(engine/mistral_renderer.py), else by the model's chat template.
"""

from __future__ import annotations

from proto_server.engine.families.base import CallFrame, Rendering, ToolSyntax

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralFamily(ToolSyntax):
    """Rendered by mistral-common where it can be (module docstring)."""

    rendering = Rendering.MISTRAL_COMMON


class Mistral(MistralFamily):
    """Version 11 and later."""

    name = "mistral"
    frame = CallFrame(
        open=TOOL_CALLS,
        name_prefix="",
        name_suffix=ARGS,
        args_suffix="",
        separator=TOOL_CALLS,
        close="",
    )


class MistralJson(MistralFamily):
    """Before version 11."""

    name = "mistral_json"
    frame = CallFrame(
        open=TOOL_CALLS,
        list_open="[",
        name_prefix='{"name": "',
        name_suffix='", "arguments": ',
        args_suffix="}",
        separator=", ",
        close="]",
        id_key="id",
    )

    def stop(self, max_calls: int | None) -> list[str]:
        return []  # a `]` is no mark of a call's end in text: the turn's end (`</s>`) is


MISTRAL = Mistral()
MISTRAL_JSON = MistralJson()
