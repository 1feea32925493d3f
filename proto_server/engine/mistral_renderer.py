"""Mistral's conversations as `mistral-common` renders them, one item at a time.

Mistral and Devstral are rendered by Mistral's own library, `mistral-common`, not by a chat
template: vLLM does the same (`--tokenizer-mode mistral`), and the Jinja templates generated
from it put the system message and the tools in the last user message, which no prompt that
only grows can follow (chat_template.py refuses them). Where the model's folder holds its
`tekken.json`, each item is that library's rendering of the message it is: a user's
`[INST]...[/INST]`, a call as an assistant message's `tool_calls`, an output as a tool message,
an instruction in the middle as `[SYSTEM_PROMPT]`, earlier thinking (Magistral's) as the
`[THINK]` block that opens the model's message. The tokens are the library's; the tokenizer
the server decodes with is checked to number them alike when the renderer is built.

Where things go follows tokenizer version 13 (Devstral 2, Mistral 3): the system prompt first,
the tools before the first user message, each later message in its place. Versions 7 and 11
render the tools before the *last* user message; within a tool loop (one user message, then
calls and outputs) that is the same place, and a new user message leaves them where they were
(vLLM's own rendering moves them, so its engine prefills the whole conversation again).
Before version 7 the system prompt is part of the last user message's text: refused, saying so.

Call ids: Mistral's are nine letters or digits; a call's is its `call_id`'s last nine where
those are such (as vLLM's own rendering cuts them), else nine from a hash of it.
"""

from __future__ import annotations

import hashlib
import json
import string
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

from cachetools import LRUCache
from mistral_common.protocol.instruct.chunk import ThinkChunk
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.tool_calls import Function, Tool, ToolCall
from mistral_common.protocol.instruct.tool_calls import FunctionCall as MistralCall
from mistral_common.tokens.tokenizers.base import TokenizerVersion
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from proto_server.core.compaction import summary_of
from proto_server.core.render import turn_end
from proto_server.engine.families.base import too_deep
from proto_server.engine.model_files import PROBE
from proto_server.engine.model_renderer import (
    COMPACTION_PREAMBLE,
    RENDER_CACHE_BYTES,
    RenderedMessages,
    TemplateError,
    prefix_key,
)
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
from proto_server.wire.tools import Tool as WireTool
from proto_server.wire.tools import function_tools

#: The file mistral-common reads a model's tokenizer from (Tekken, every model since 2024).
TEKKEN = "tekken.json"
#: Magistral's thinking block (thinking.py reads it as it streams).
THINK_TAGS = ("[THINK]", "[/THINK]")
#: Whatever request and message types a version's tokenizer takes.
AnyMistralTokenizer: TypeAlias = "MistralTokenizer[Any, Any, Any, Any, Any]"
#: How many calls' places are remembered, so outputs are shown in their calls' order.
CALL_ORDER = 65536
_ALPHABET = string.ascii_letters + string.digits
_PROBE_USER = "probe"


def _is_json(text: str) -> bool:
    """`text` is JSON, and shallow enough to decode (as mistral-common will)."""
    if too_deep(text):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's format takes one: nine letters or digits (module docstring)."""
    tail = call_id[-9:]
    if len(tail) == 9 and all(c in _ALPHABET for c in tail):
        return tail
    number = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "big")
    digits = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        digits.append(_ALPHABET[digit])
    return "".join(digits)


def mistral_tokenizer(directory: Path) -> AnyMistralTokenizer | None:
    """The model's own mistral-common tokenizer, where its folder holds one (None: it does
    not, and its chat template renders it)."""
    path = directory / TEKKEN
    if not path.is_file():
        return None
    try:
        return MistralTokenizer.from_file(str(path))
    except Exception as exc:  # mistral-common raises ValueError, AssertionError, its own
        raise TemplateError(f"mistral-common cannot read {path}: {exc}") from exc


class MistralRenderer:
    """A conversation as mistral-common's messages, one item at a time (module docstring)."""

    def __init__(
        self,
        mistral: AnyMistralTokenizer,
        tokenizer: Any,
        *,
        cache_bytes: int = RENDER_CACHE_BYTES,
    ) -> None:
        self._instruct: Any = mistral.instruct_tokenizer
        version = mistral.instruct_tokenizer.tokenizer.version
        if version < TokenizerVersion.v7:
            raise TemplateError(
                f"Mistral's tokenizer {version.value} puts the instructions in the last user "
                "message's text, so its conversations cannot be rendered one message at a "
                "time, as a rollout's prompt only grows; serve this model through vLLM's own "
                "API (tokenizers from version 7 on are rendered here)"
            )
        ours = list(tokenizer.encode(PROBE, add_special_tokens=False))
        theirs = self._instruct.tokenizer.encode(PROBE, bos=False, eos=False)
        if ours != theirs:
            raise TemplateError(
                "the model's tokenizer.json numbers text differently from its tekken.json; "
                "give the model a tokenizer.json converted from its tekken.json "
                "(transformers.integrations.mistral.convert_tekken_tokenizer)"
            )
        self.version = version
        self.rendered = RenderedMessages(cache_bytes)
        #: The model's turn opens right after `[/INST]` or `[/TOOL_RESULTS]`: nothing to add.
        self.generation_prompt: list[int] = []
        #: Magistral thinks in a `[THINK]` block first, where the vocabulary has its tags.
        self.thinks = getattr(self._instruct, "BEGIN_THINK", None) is not None
        self.opens_thinking = False
        self.think_tags = THINK_TAGS
        #: Where each call rendered lately came, by call_id: from version 11 on, outputs are
        #: shown in their calls' order. Large inputs render on
        #: worker threads, hence the lock.
        self._called: LRUCache[str, int] = LRUCache(CALL_ORDER)
        self._called_lock = threading.Lock()
        self._calls_seen = 0

    def prefix_effort(self, effort: str | None) -> str | None:
        return None

    def _user(self, text: str, tools: list[Tool] | None = None) -> list[int]:
        tokens, _, _ = self._instruct.encode_user_message(
            UserMessage(content=text), tools, is_last=tools is not None, is_first=True
        )
        return list(tokens)

    def render_prefix(
        self, instructions: str | None, tools: Sequence[WireTool], *, effort: str | None = None
    ) -> list[int]:
        """The start of the sequence, the instructions as the system prompt, then the tools
        as mistral-common writes them before a user message (`effort` is not said)."""
        offered = function_tools(tools)
        specs = [
            (tool.name, tool.description or "", dict(tool.parameters or {"type": "object"}))
            for tool in offered
        ]
        key = prefix_key(instructions, specs=specs)
        tokens = self.rendered.get(key)
        if tokens is None:
            opening = list(self._instruct.start())
            if instructions:
                system = SystemMessage(content=instructions)
                opening += self._instruct.encode_system_message(system)[0]
            if offered:
                described = [
                    Tool(function=Function(name=n, description=d, parameters=p))
                    for n, d, p in specs
                ]
                plain = self._user(_PROBE_USER)
                with_tools = self._user(_PROBE_USER, described)
                if with_tools[-len(plain) :] != plain:
                    raise TemplateError("mistral-common renders the tools inside a user message")
                opening += with_tools[: -len(plain)]
            tokens = array("I", opening)
            self.rendered.put(key, tokens)
        return list(tokens)

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        """A reasoning item is the `[THINK]` block that opens the assistant message, and the
        text or call after it continues that message, as the model wrote them; anything else
        after it closes the message first (`closing`). Other messages are rendered whole."""
        if isinstance(item, Reasoning):
            return self._thought(item)
        found = self._message(item)
        if found is None:
            return ()
        key, message = found
        tokens = self.rendered.rendered(key, lambda: self._encode(message))
        if isinstance(message, UserMessage | ToolMessage | SystemMessage):
            return [*self.closing(previous), *tokens]
        return tokens

    def closing(self, last: Item | None) -> Sequence[int]:
        """The end of a message that held only reasoning (the model stopped after its
        `[/THINK]`), where a message that is not the model's follows it."""
        if isinstance(last, Reasoning) and self._thought(last):
            return [self._instruct.tokenizer.eos_id]
        return ()

    def _thought(self, item: Reasoning) -> Sequence[int]:
        """Its `[THINK]` block, where the model thinks in one and the item holds text."""
        if not self.thinks or not item.text:
            return ()
        chunk = ThinkChunk(thinking=item.text, closed=True)
        return self.rendered.rendered(
            ("\0reasoning", item.text), lambda: self._instruct.encode_think(chunk)
        )

    def render_turn(self, items: Sequence[Item], previous: Item | None) -> Sequence[int] | None:
        """A text and the calls after it, or several calls, as one assistant message, as the
        model writes them (`[TOOL_CALLS]` after the text, the calls together)."""
        if len(items) < 2 or turn_end(items, 0) != len(items):
            return None
        text = None
        thought: Sequence[int] = ()
        calls: list[ToolCall] = []
        for item in items:
            match item:
                case Message(role="assistant", content=content):
                    text = content_text(content)
                case FunctionCall() | CustomToolCall():
                    calls.append(self._call(item))
                case Reasoning():
                    thought = self._thought(item)
        if not calls or (text is None and len(calls) < 2):
            return None
        message = AssistantMessage(content=text or None, tool_calls=calls)
        key = ("\0turn", message.model_dump_json())
        return [*thought, *self.rendered.rendered(key, lambda: self._encode(message))]

    def render_run(self, outputs: Sequence[Item], previous: Item | None) -> Sequence[int] | None:
        """Outputs that arrive together, in their calls' order (from version 11 on
        mistral-common sorts them so); None where that is the order they came in, or where a
        call's place is no longer known (then they are shown as they came)."""
        if self.version < TokenizerVersion.v11:
            return None
        with self._called_lock:
            order = [self._called.get(getattr(item, "call_id", "")) for item in outputs]
        if None in order:
            return None
        ranked = sorted(range(len(outputs)), key=lambda i: (order[i], i))
        if ranked == sorted(ranked):
            return None
        tokens: list[int] = []
        before = previous
        for index in ranked:
            tokens += self.render_item(outputs[index], before)
            before = outputs[index]
        return tokens

    def _call(self, item: FunctionCall | CustomToolCall) -> ToolCall:
        # as mistral-common reads a request's: JSON as it is (an object or not), none as {};
        # a custom tool's free-form input as a JSON string
        if isinstance(item, FunctionCall):
            text = item.arguments or "{}"
            arguments = text if _is_json(text) else json.dumps(text)
        else:
            arguments = json.dumps(item.input)
        with self._called_lock:
            self._calls_seen += 1
            self._called[item.call_id] = self._calls_seen
        return ToolCall(
            id=mistral_call_id(item.call_id),
            function=MistralCall(name=item.name, arguments=arguments),
        )

    def _message(self, item: Item) -> tuple[tuple[str, str], Any] | None:
        match item:
            case FunctionCall() | CustomToolCall():
                message: Any = AssistantMessage(content=None, tool_calls=[self._call(item)])
            case (
                FunctionCallOutput(call_id=call_id, output=output)
                | CustomToolCallOutput(call_id=call_id, output=output)
            ):
                message = ToolMessage(
                    content=content_text(output), tool_call_id=mistral_call_id(call_id)
                )
            case Message(role="assistant", content=content):
                message = AssistantMessage(content=content_text(content))
            case Message(role="user", content=content):
                message = UserMessage(content=content_text(content))
            case Message(content=content):  # system, developer
                message = SystemMessage(content=content_text(content))
            case UnknownItem(type="compaction") if (summary := summary_of(item)) is not None:
                message = UserMessage(content=f"{COMPACTION_PREAMBLE}\n{summary}")
            case Reasoning() | UnknownItem():
                return None
            case _:
                raise TypeError(f"not an item: {item!r}")
        return (type(message).__name__, message.model_dump_json()), message

    def _encode(self, message: Any) -> list[int]:
        instruct = self._instruct
        match message:
            case UserMessage():
                tokens, _, _ = instruct.encode_user_message(
                    message, None, is_last=False, is_first=False
                )
            case SystemMessage():
                tokens, _ = instruct.encode_system_message(message)
            case ToolMessage():
                tokens, _, _ = instruct.encode_tool_message(message, False)
            case AssistantMessage(content=None | "", tool_calls=None | []):
                tokens = [instruct.tokenizer.eos_id]  # the model ended its turn at once
            case _:
                tokens = instruct.encode_assistant_message(message, False)
        return list(tokens)
