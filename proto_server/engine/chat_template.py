"""A model's own chat template as a `Renderer`: items rendered one at a time, model tokens.

A chat template renders a whole list of messages; the Conversation wants one item at a time.
For the templates that concatenate one block per message (ChatML, as SmolLM2 uses, Llama 3,
most others) the block of a message is what rendering [probe, message] adds to rendering
[probe]. That is checked once when the renderer is built, so a template that does not render
messages one by one is refused up front rather than rendering a wrong prompt.

Tools, tool calls and tool outputs are rendered as the model was tuned on them, by its family
(families/): offered through the template's `tools=` where the template takes them, else in
the system prompt in the family's documented form; a call as an assistant message's
`tool_calls` where the template renders them, else as the family's own call text; an output as
a `tool` message (or the family's role for it, where the template knows no tools). Both are
probed once, when the renderer is built.

A template that renders an assistant message's `reasoning_content` (Qwen3's) is probed for it
too: a reasoning item then opens the assistant message, `<think>` block and all, and the call
or answer after it continues that message, as the model wrote them, so that the next turn's
prompt begins with the model's own tokens (test_thinking_render). Qwen's template drops an
earlier loop's reasoning once a user speaks again; a conversation only grows, and the engine
holds those tokens, so it is kept (docs/requests.md).

Rendering a message through the template and the tokenizer costs about a millisecond, and a
stateless client resends its whole history every turn: the tokens of the messages rendered
last are kept (`RenderedMessages`, model_renderer.py), so such a turn renders only what is new.

Every rendering is cut at the boundaries the probes found when the
renderer was built (`_base`, `_user_block`, `_thought_probe`), so the probes and the cuts that rely
on them are read together.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from proto_server.core.compaction import summary_of
from proto_server.core.render import ModelTurn, model_turn
from proto_server.engine.families.base import ToolSyntax, object_arguments, too_deep
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.model_renderer import (
    COMPACTION_PREAMBLE,
    PREFIX,
    RENDER_CACHE_BYTES,
    ChatMessage,
    RenderedMessages,
    TemplateError,
    prefix_key,
)
from proto_server.engine.thinking import CLOSE as THINK_CLOSE
from proto_server.engine.thinking import OPEN as THINK_OPEN
from proto_server.engine.thinking import TAGS as THINK_TAGS
from proto_server.wire.items import (
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    UnknownItem,
    content_text,
)
from proto_server.wire.tools import FunctionTool, Tool, function_tools

_PROBE = {"role": "system", "content": "probe system"}
_PROBE_USER = {"role": "user", "content": "probe"}
_PROBE_REPLY = {"role": "assistant", "content": "probe"}
#: What a reasoning item is rendered with, and cut at: an answer no reasoning holds.
_PROBE_ANSWER = "\0probe answer"
_PROBE_THOUGHT = "probe thought"


class ChatTokenizer(Protocol):
    """What the renderer needs from a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: Any, **kwargs: Any) -> list[int]: ...


def item_message(item: Item) -> dict[str, str] | None:
    """The chat message an item other than a call or its output is shown to the model as;
    None for what it cannot read."""
    match item:
        case Message(role=role, content=content):
            return {
                "role": "system" if role == "developer" else role,
                "content": content_text(content),
            }
        case UnknownItem(type="compaction") if (summary := summary_of(item)) is not None:
            # what server-side compaction kept of the history: the model reads it as context
            return {"role": "user", "content": f"{COMPACTION_PREAMBLE}\n{summary}"}
        case Reasoning():
            return None  # a template that renders no reasoning (SmolLM2's) has no place for it
        case UnknownItem():
            return None  # opaque to another model
    raise TypeError(f"not an item: {item!r}")


def _thought_message(thought: str, content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "reasoning_content": thought}


def _template_tool(tool: FunctionTool) -> dict[str, Any]:
    """A tool as chat templates read `tools=` (the Chat Completions shape)."""
    function: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description or "",
        "parameters": tool.parameters or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


_PROBE_TOOL = FunctionTool(name="probe_tool", parameters={"type": "object", "properties": {}})


def _check_one_message_at_a_time(user_block: str, reply: Callable[[], str]) -> None:
    """A message is rendered after a system message alone (`render_item`): a template that
    holds the system message back for a later one, or refuses a reply that no user message
    comes before (Mistral's, as mistral-common writes them: they put the system message and
    the tools in the last user message and check that roles alternate) would put the probe in
    the prompt, or fail on the model's first reply in the middle of a rollout."""
    refusal = (
        "so it cannot be rendered one message at a time, as a rollout's prompt only grows; "
        "serve this model through vLLM's own API, or give it a chat template (its "
        "tokenizer_config.json's `chat_template`) that renders each message on its own (a "
        "Mistral model: put its tekken.json beside it, and mistral-common renders it)"
    )
    if _PROBE["content"] in user_block:
        raise TemplateError(
            "the model's chat template moves the system message into a later message, " + refusal
        )
    try:
        reply()
    except Exception as exc:
        raise TemplateError(
            f"the model's chat template refuses a reply right after a system message ({exc}), "
            + refusal
        ) from exc


class ChatTemplateRenderer:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        cache_bytes: int = RENDER_CACHE_BYTES,
        syntax: ToolSyntax = HERMES,
    ) -> None:
        self._tokenizer = tokenizer
        self.syntax = syntax
        #: What `render_item` rendered lately (`--render-cache-mb`).
        self.rendered = RenderedMessages(cache_bytes)
        try:
            self._base = self._text([_PROBE])
            probed = self._text([_PROBE, _PROBE_USER])
            prompted = self._text([_PROBE], add_generation_prompt=True)
            default = self._text([_PROBE_USER])
        except Exception as exc:
            raise TemplateError(
                f"the model's chat template failed on a plain system and user message ({exc}); "
                "use a chat (instruct) model whose template renders them"
            ) from exc
        if not (probed.startswith(self._base) and prompted.startswith(self._base)):
            raise TemplateError(
                "the model's chat template does not render a conversation one message at a time, "
                "so it cannot be extended incrementally; use a model with a ChatML-like template"
            )
        self._user_block = probed[len(self._base) :]
        _check_one_message_at_a_time(self._user_block, lambda: self._text([_PROBE, _PROBE_REPLY]))
        #: What opens the model's turn (`<|im_start|>assistant\n` in ChatML).
        self.generation_prompt = self._encode(prompted[len(self._base) :])
        #: The model thinks in `<think>` blocks (Qwen3, DeepSeek R1: both are in its vocabulary),
        #: and whether its turn opens inside one (DeepSeek R1's prompt ends in `<think>\n`).
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.thinks = THINK_OPEN in vocabulary and THINK_CLOSE in vocabulary
        self.think_tags = THINK_TAGS
        self.opens_thinking = self.thinks and prompted.rstrip().endswith(THINK_OPEN)
        # What the template says before the first message when there is no system message.
        self._default_prefix = (
            default[: -len(self._user_block)] if default.endswith(self._user_block) else ""
        )
        #: The template offers tools itself (`tools=`) and renders calls (`tool_calls`).
        self.takes_tools = self._probe_tools()
        self.renders_calls = self._probe_calls()
        #: The template renders an assistant message's `reasoning_content` (Qwen3's, in the
        #: turn after the last user message): the rendering of the probe's thought, and what
        #: closes a message holding only reasoning (`<|im_end|>\n`); None where it does not.
        self._base_user = default
        self._thought_probe = self._probe_reasoning() if self.thinks else None

    def _probe_tools(self) -> bool:
        try:
            offered = self._text([_PROBE_USER], tools=[_template_tool(_PROBE_TOOL)])
        except Exception:
            return False
        return _PROBE_TOOL.name in offered and offered.endswith(self._user_block)

    def _probe_calls(self) -> bool:
        try:
            text = self._text([_PROBE, self._call_message("probe_tool", "{}")])
        except Exception:
            return False
        return text.startswith(self._base) and "probe_tool" in text[len(self._base) :]

    def _thought_text(self, thought: str) -> str | None:
        """What the template renders for an assistant message holding only `thought` as its
        reasoning, up to where its content would begin (None: it renders no reasoning)."""
        text = self._text([_PROBE_USER, _thought_message(thought, _PROBE_ANSWER)])
        user = self._base_user
        end = text.rfind(_PROBE_ANSWER)
        if not text.startswith(user) or end < 0:
            return None
        return text[len(user) : end]

    def _probe_reasoning(self) -> tuple[str, str] | None:
        """(what the template renders for the probe's thought, what closes a message of only
        reasoning), or None where the template renders no reasoning."""
        try:
            head = self._thought_text(_PROBE_THOUGHT)
            empty = self._text([_PROBE_USER, _thought_message(_PROBE_THOUGHT, "")])
        except Exception:
            return None
        if head is None or _PROBE_THOUGHT not in head:
            return None
        whole = empty[len(self._base_user) :]
        if not whole.startswith(head):
            return None
        return head, whole[len(head) :]

    def _text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        options: dict[str, Any] = {"tools": tools} if tools else {}
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **options
        )
        assert isinstance(text, str)
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def prefix_effort(self, effort: str | None) -> str | None:
        return None

    def render_prefix(
        self, instructions: str | None, tools: Sequence[Tool], *, effort: str | None = None
    ) -> list[int]:
        """`effort` is not said: these templates take no reasoning effort (docs/engines.md)."""
        offered = function_tools(tools)
        if offered and self.takes_tools:
            return self._template_prefix(instructions, offered)
        parts = [instructions] if instructions else []
        if offered:
            parts.append(self.syntax.describe_tools(offered))
        if not parts:
            return self._encode(self._default_prefix)
        system = "\n\n".join(parts)
        key = (PREFIX, system)
        tokens = self.rendered.get(key)
        if tokens is None:
            tokens = array("I", self._encode(self._text([{"role": "system", "content": system}])))
            self.rendered.put(key, tokens)
        return list(tokens)

    def _template_prefix(
        self, instructions: str | None, tools: Sequence[FunctionTool]
    ) -> list[int]:
        """The conversation's start as the template offers `tools`: what it renders before a
        user message, with the instructions as the system message if there are any."""
        specs = [_template_tool(tool) for tool in tools]
        key = prefix_key(instructions, specs=specs)
        tokens = self.rendered.get(key)
        if tokens is None:
            system = [{"role": "system", "content": instructions}] if instructions else []
            text = self._text([*system, _PROBE_USER], tools=specs)
            tokens = array("I", self._encode(text.removesuffix(self._user_block)))
            self.rendered.put(key, tokens)
        return list(tokens)

    def _call_message(self, name: str, arguments: str) -> dict[str, Any]:
        """An assistant message holding a call, as templates read `tool_calls`."""
        if self.syntax.template_arguments_text:  # as written; a custom tool's input as a string
            given: Any = object_arguments(arguments)
        else:  # as an object, unless it is no JSON or too deep to decode (then as written)
            try:
                given = arguments if too_deep(arguments) else json.loads(arguments)
            except ValueError:
                given = arguments
        call = {"type": "function", "function": {"name": name, "arguments": given}}
        return {"role": "assistant", "content": self.syntax.call_content, "tool_calls": [call]}

    def _message(self, item: Item) -> tuple[ChatMessage, dict[str, Any]] | None:
        """The message `item` is shown as, and the key its rendering is kept under."""
        match item:
            case FunctionCall(name=name, arguments=text) | CustomToolCall(name=name, input=text):
                if self.renders_calls:
                    return ("\0call", json.dumps([name, text])), self._call_message(name, text)
                message = {"role": "assistant", "content": self.syntax.call_text(name, text)}
            case FunctionCallOutput(output=output) | CustomToolCallOutput(output=output):
                role = "tool" if self.renders_calls else self.syntax.output_role
                message = {"role": role, "content": content_text(output)}
            case _:
                found = item_message(item)
                if found is None:
                    return None
                message = found
        return (message["role"], message["content"]), message

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        """Where the template renders reasoning (Qwen3's), a reasoning item opens the assistant
        message, `<think>` block and all, and what the model wrote after it (its text, its
        call) continues that message rather than opening one of its own, as the model wrote
        them; anything else after it closes the message first."""
        if self._thought_probe is not None:
            if isinstance(item, Reasoning):
                thought = self._render_thought(item.text)
                if isinstance(previous, Reasoning):  # the message before holds only reasoning
                    return [*self._encode(self._thought_probe[1]), *thought]
                return thought
            if isinstance(previous, Reasoning):
                return self._render_after_thought(item)
        found = self._message(item)
        if found is None:
            return ()
        key, message = found
        tokens = self.rendered.get(key)
        if tokens is None:
            tokens = array("I", self._encode(self._text([_PROBE, message])[len(self._base) :]))
            self.rendered.put(key, tokens)
        return tokens

    def render_run(self, outputs: Sequence[Item], previous: Item | None) -> Sequence[int] | None:
        """Consecutive tool outputs as the template renders them together, where that is not
        their renderings one after another (Qwen3 puts them in one user message, whose close
        depends on what comes next); None where it is, or after reasoning (`render_item`)."""
        if self._thought_probe is not None and isinstance(previous, Reasoning):
            return None
        found = [self._message(item) for item in outputs]
        if any(message is None for message in found):
            return None
        messages = [message for _, message in found]  # type: ignore[misc]
        key = ("\0outputs", json.dumps([[m["role"], m["content"]] for m in messages]))
        tokens = self.rendered.get(key)
        if tokens is None:
            text = self._text([_PROBE, *messages])
            if not text.startswith(self._base):  # not rendered one message at a time: apart
                return None
            tokens = array("I", self._encode(text[len(self._base) :]))
            self.rendered.put(key, tokens)
        return tokens

    def closing(self, last: Item | None) -> Sequence[int]:
        """What closes the message `last` left open, where a new message follows it that no
        item renders (the model's next turn): a turn that ended in its reasoning, whose
        message `render_item` leaves open for the answer or call that usually follows."""
        if self._thought_probe is None or not isinstance(last, Reasoning):
            return ()
        return self._encode(self._thought_probe[1])

    def render_turn(self, items: Sequence[Item], previous: Item | None) -> Sequence[int] | None:
        """A model turn's items (its reasoning, its text, then its calls) as one assistant
        message, as the template renders them together: Qwen3's renders a text and the calls
        after it, or several calls, in one message; DeepSeek V3's several calls in one
        `tool_calls` block. None where the items are no such turn (`model_turn`), the template
        renders calls as the family's text (`renders_calls` false), or it would drop a part
        (DeepSeek V3's drops the calls of a message with text): rendered apart, each is seen."""
        turn = model_turn(items)
        if turn is None or (self._thought_probe is not None and isinstance(previous, Reasoning)):
            return None  # after a message of only reasoning: `render_item` closes it
        if not self.renders_calls:
            return self._turn_as_text(turn)
        thought = turn.thought if self._thought_probe is not None else None
        content = self.syntax.call_content if turn.text is None else turn.text
        key = ("\0turn", json.dumps([thought, content, turn.calls]))
        tokens = self.rendered.get(key)
        if tokens is None:
            text = self._turn_text(thought, content, turn.calls)
            # kept either way: a turn rendered apart (kept empty, as no message renders to
            # nothing) is not probed again for each call the model adds to it
            tokens = array("I", self._encode(text) if text is not None else ())
            self.rendered.put(key, tokens)
        return tokens or None

    def _turn_as_text(self, turn: ModelTurn) -> Sequence[int] | None:
        """A turn as one assistant message whose content is the text and then the calls in the
        family's own block, as the model wrote them (a template that knows no calls, SmolLM2's);
        None where the family writes a block alone in its message (Llama's bare JSON) or one
        call a block. Its reasoning is not shown, as such a template shows none."""
        frame = self.syntax.frame
        block = self.syntax.calls_text(turn.calls)
        if block is None or (frame.bare and turn.text is not None):
            return None
        message = {"role": "assistant", "content": (turn.text or "") + block}
        key = ("\0turn text", message["content"])
        tokens = self.rendered.get(key)
        if tokens is None:
            text = self._text([_PROBE, message])
            if not text.startswith(self._base):
                return None
            tokens = array("I", self._encode(text[len(self._base) :]))
            self.rendered.put(key, tokens)
        return tokens

    def _turn_text(
        self, thought: str | None, content: str | None, calls: Sequence[tuple[str, str]]
    ) -> str | None:
        """What the template renders for one assistant message of a turn; None where it drops
        its last call, or (with text) all of its calls, or cannot render it."""
        specs = [self._call_message(name, text)["tool_calls"][0] for name, text in calls]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        # after a user message, as `_thought_text` renders reasoning (the turn's own)
        base, probe = (self._base, _PROBE) if thought is None else (self._base_user, _PROBE_USER)
        try:
            text = self._text([probe, {**message, "tool_calls": specs}])
            fewer = [{**message, "tool_calls": specs[:-1]}] if content is None else [message]
            if text == self._text([probe, *fewer]) or not text.startswith(base):
                return None
        except Exception:
            return None
        return text[len(base) :]

    def _render_thought(self, thought: str) -> Sequence[int]:
        key = ("\0reasoning", thought)
        tokens = self.rendered.get(key)
        if tokens is None:
            text = self._thought_text(thought)
            tokens = array("I", self._encode(text or ""))
            self.rendered.put(key, tokens)
        return tokens

    def _render_after_thought(self, item: Item) -> Sequence[int]:
        """`item` as the rest of the message the reasoning before it opened: what the template
        renders for them together, less what it renders for the reasoning alone."""
        assert self._thought_probe is not None
        head, close = self._thought_probe
        found = self._message(item)
        if found is None:
            return ()
        key, message = found
        if message["role"] != "assistant":  # the model's turn ended with its reasoning
            return [*self._encode(close), *self.render_item(item)]
        kept_key = ("\0after reasoning", json.dumps(key))
        tokens = self.rendered.get(kept_key)
        if tokens is None:
            joined = {**message, "reasoning_content": _PROBE_THOUGHT}
            text = self._text([_PROBE_USER, joined])[len(self._base_user) :]
            if not text.startswith(head):
                raise TemplateError("the template renders a reasoning's message differently")
            tokens = array("I", self._encode(text[len(head) :]))
            self.rendered.put(kept_key, tokens)
        return tokens
