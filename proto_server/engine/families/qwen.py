"""The Qwen family (Qwen 2.5, Qwen3): Hermes' tags, written as Qwen's chat template writes them.

Qwen's template renders an earlier call as

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

a further call of the same message after a newline, in tags of its own. Hermes' parser reads
that too, but a grammar writing Hermes' form (`<tool_call>[{...}]</tool_call>`) makes the
model's tokens differ from what the template renders for the same call on the next turn, and
the engine's prefix cache misses from there. Under this family a forced or `strict` call is
written in the template's form exactly, newlines included, and the template is given the
arguments as the model wrote them (it writes a string as it is), so the next turn's prompt
begins with the tokens the model wrote. A model is told from Hermes by rendering a call with
its template (`renders_its_calls`): SmolLM2 and Hermes have `<tool_call>` but not this form.
"""

from __future__ import annotations

from typing import Any

from proto_server.engine.families.base import CallFrame, ToolSyntax

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
#: Calls of one message are one block to the parser and the grammar: the separator closes a
#: call's tags and opens the next's.
FRAME = CallFrame(
    open=OPEN,
    name_prefix='\n{"name": "',
    name_suffix='", "arguments": ',
    args_suffix="}\n",
    separator=f"{CLOSE}\n{OPEN}",
    close=CLOSE,
)
_PROBE_NAME = "probe_tool"


class Qwen(ToolSyntax):
    name = "qwen"
    frame = FRAME
    template_arguments_text = True


QWEN = Qwen()


def renders_its_calls(tokenizer: Any) -> str | None:
    """The call the tokenizer's chat template renders, if it is in Qwen's form (else None)."""
    call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # no template, or one that renders no calls: not Qwen's
        return None
    block = FRAME.block([(_PROBE_NAME, "{}")])
    return block if isinstance(text, str) and block in text else None
