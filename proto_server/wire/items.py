"""Conversation items and content parts, as the Responses API spells them.

Known items are typed; anything else a client sends (compaction, future types) is kept
whole as an `UnknownItem` and carried through untouched, so no client is refused for being newer
than this server (what nests in it is kept encoded: `wire.carried`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from proto_server.wire.carried import carried

ROLES = frozenset({"user", "system", "developer", "assistant"})


@attrs.frozen(kw_only=True)
class InputText:
    type: str = "input_text"
    text: str


@attrs.frozen(kw_only=True)
class TopLogprob:
    """One of the likeliest tokens at a position, as the API spells it: its text, its log
    probability and its UTF-8 bytes (a token may hold part of a character)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Logprob:
    """A sampled token's log probability, with the likeliest tokens at its position (as many
    as `top_logprobs` asked, likeliest first)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


@attrs.frozen(kw_only=True)
class OutputText:
    type: str = "output_text"
    text: str
    annotations: tuple[Any, ...] = ()
    #: The logprob of each token of `text`, when the request's `include` named
    #: `message.output_text.logprobs`; None (absent on the wire) otherwise.
    logprobs: tuple[Logprob, ...] | None = None


@attrs.frozen(kw_only=True)
class ReasoningText:
    """What a model thought, as it wrote it (a `reasoning` item's content)."""

    type: str = "reasoning_text"
    text: str


@attrs.frozen(kw_only=True)
class SummaryText:
    type: str = "summary_text"
    text: str


#: The parts a streamed item's `content_part.added` and `.done` carry.
StreamedPart = OutputText | ReasoningText


@attrs.frozen
class UnknownPart:
    """A content part this server does not interpret (an image, a file, a refusal...)."""

    raw: Mapping[str, Any] = attrs.field(converter=carried)


ContentPart = InputText | OutputText | UnknownPart
Content = str | tuple[ContentPart, ...]


#: The names of the token fields an output item carries when `include` asks for them (NeMo
#: Gym's): `TOKEN_FIELDS` of the item classes below, absent on the wire while None.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@attrs.frozen(kw_only=True)
class Message:
    type: str = "message"
    id: str | None = None
    role: str
    content: Content
    status: str | None = None
    #: What the model had read before this item's first token (the segment's prompt as the
    #: engine was sent it, then what it returned earlier in the segment): `output.token_ids`.
    prompt_token_ids: tuple[int, ...] | None = None
    #: The ids the engine returned for this item, every one, as it returned them.
    generation_token_ids: tuple[int, ...] | None = None
    #: The logprob of each of `generation_token_ids`.
    generation_log_probs: tuple[float, ...] | None = None
    #: This server's extension beside them: the weights' label (a trainer's resume sets it).
    weight_version: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    type: str = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None
    #: As `Message`'s (`output.token_ids`): the call's syntax is its tokens too.
    prompt_token_ids: tuple[int, ...] | None = None
    generation_token_ids: tuple[int, ...] | None = None
    generation_log_probs: tuple[float, ...] | None = None
    weight_version: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutput:
    type: str = "function_call_output"
    id: str | None = None
    call_id: str
    output: Content
    status: str | None = None


@attrs.frozen(kw_only=True)
class CustomToolCall:
    type: str = "custom_tool_call"
    id: str | None = None
    call_id: str
    name: str
    input: str
    status: str | None = None


@attrs.frozen(kw_only=True)
class CustomToolCallOutput:
    type: str = "custom_tool_call_output"
    id: str | None = None
    call_id: str
    output: Content


@attrs.frozen(kw_only=True)
class Reasoning:
    """A model's reasoning before it answered or called. `encrypted_content`: the same,
    sealed by the server that made it (asked for with `include`), so a client that stores
    nothing can send it back for the model to read again."""

    type: str = "reasoning"
    id: str | None = None
    summary: tuple[SummaryText, ...] = ()
    content: tuple[ReasoningText, ...] | None = None
    encrypted_content: str | None = None
    status: str | None = None
    #: As `Message`'s (`output.token_ids`).
    prompt_token_ids: tuple[int, ...] | None = None
    generation_token_ids: tuple[int, ...] | None = None
    generation_log_probs: tuple[float, ...] | None = None
    weight_version: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


@attrs.frozen
class UnknownItem:
    """An item of a type this server carries but does not interpret (compaction...)."""

    raw: Mapping[str, Any] = attrs.field(converter=carried)

    @property
    def type(self) -> str:
        return str(self.raw.get("type"))


Item = (
    Message
    | FunctionCall
    | FunctionCallOutput
    | CustomToolCall
    | CustomToolCallOutput
    | Reasoning
    | UnknownItem
)
ToolCall = FunctionCall | CustomToolCall
ToolOutput = FunctionCallOutput | CustomToolCallOutput

ITEM_TYPES: Mapping[str, type[Item]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "custom_tool_call": CustomToolCall,
    "custom_tool_call_output": CustomToolCallOutput,
    "reasoning": Reasoning,
}


#: The id prefix of each item type, as OpenAI spells it (`item` for types it names otherwise).
ID_PREFIXES: Mapping[str, str] = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "compaction": "cmp",
}


def item_id(item: Item) -> str | None:
    """The id an item carries (a client's own, or the server's), if it has one."""
    if isinstance(item, UnknownItem):
        found = item.raw.get("id")
        return found if isinstance(found, str) else None
    return item.id


def with_id(item: Item, new: str) -> Item:
    """`item` carrying the id `new`."""
    if isinstance(item, UnknownItem):
        return UnknownItem({**item.raw, "id": new})
    return attrs.evolve(item, id=new)


def listed(item: Item) -> Item:
    """`item` as OpenAI lists a stored one (`input_items`): a message's text always a list of
    parts (`input_text`, or `output_text` for the assistant's), a status on every item."""
    match item:
        case Message(content=str(text), role=role):
            part: ContentPart = (
                OutputText(text=text) if role == "assistant" else InputText(text=text)
            )
            return attrs.evolve(item, content=(part,), status=item.status or "completed")
        case Message() | FunctionCall() | FunctionCallOutput() | CustomToolCall():
            return attrs.evolve(item, status=item.status or "completed")
    return item


def content_text(content: Content) -> str:
    """The plain text of a message or tool output, parts joined; parts without text are skipped."""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if not isinstance(part, UnknownPart))
