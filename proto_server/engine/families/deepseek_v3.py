# ruff: noqa: RUF001, RUF002  (DeepSeek's special tokens are written with fullwidth bars)
"""DeepSeek V3's tool-call tokens, as its chat template writes an earlier call:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

further calls after a newline, each in its own `<｜tool▁call▁begin｜>`. The template takes no
tools (they are offered in the system prompt), reads a call's arguments as JSON text, and
tests for an assistant message without content; it leaves out `<｜tool▁calls▁end｜>` after a
single call, so a block whose last call is whole counts when the turn ends (as vLLM's
`deepseek_v3` parser, which reads each call alone, does).
"""

from __future__ import annotations

from proto_server.engine.families.base import CallFrame, ToolSyntax

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"


class DeepSeekV3(ToolSyntax):
    name = "deepseek_v3"
    frame = CallFrame(
        open=CALLS_BEGIN,
        name_prefix="<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        name_suffix="\n```json\n",
        args_suffix="\n```<｜tool▁call▁end｜>",
        separator="\n",
        close=CALLS_END,
    )
    template_arguments_text = True
    call_content = None


DEEPSEEK_V3 = DeepSeekV3()
