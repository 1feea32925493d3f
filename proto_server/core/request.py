"""What a `response.create` asks for, in the core's terms."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from proto_server.core.compaction import CompactionKey, compact, is_compaction
from proto_server.core.conversation import (
    TOKEN_BYTES,
    RenderedItems,
    counted,
    item_bytes,
    prefix_bytes,
    render_items,
)
from proto_server.core.reasoning import check_reasoning, echoed_reasoning
from proto_server.core.render import Renderer, requested_effort
from proto_server.core.text_format import parse_text_format
from proto_server.core.tool_choice import check_tool_choice
from proto_server.core.tool_schema import check_tool_schemas
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import ResponseCreate
from proto_server.wire.items import (
    CustomToolCall,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    ToolOutput,
    UnknownItem,
)
from proto_server.wire.options import PromptCacheOptions
from proto_server.wire.response import Response
from proto_server.wire.tools import FunctionTool, Tool, UnknownTool


def check_create(create: ResponseCreate) -> None:
    """What decoding cannot see: tool schemas within budget, a `text.format` this server
    honours (text_format.py), `tool_choice` naming an offered function, the values of
    `prompt_cache_options`, `reasoning` and `context_management`, `conversation` (refused), a
    `top_logprobs` in range, a `metadata.rollout_id`, a `truncation` the Response can echo.
    Run when a create is accepted, before anything is built for it."""
    if create.background and create.store is False:  # it is polled from the store
        raise ProtocolError(
            "invalid_field",
            "`background: true` needs `store: true`: a background Response is retrieved from "
            "the store once it ends. Remove `store: false`, or `background`.",
            param="store",
        )
    check_tool_schemas(create.tools)
    parse_text_format(create.text)
    check_tool_choice(create.tool_choice, create.tools)
    check_prompt_cache_options(create.prompt_cache_options)
    check_reasoning(create.reasoning)
    compaction_threshold(create)
    check_conversation(create)
    check_top_logprobs(create.top_logprobs)
    rollout_id(create)
    if create.truncation not in (None, "auto", "disabled"):
        raise ProtocolError(
            "invalid_field",
            f'`truncation` is {quoted(create.truncation)}; send "auto" or "disabled".',
            param="truncation",
        )


#: The `metadata` key a client names its rollout by (as ThunderAgent's `program_id` and
#: Dynamo's `session_id`): every Response that carries the same one goes to the engine replica
#: the last one went to, whatever connection it comes on.
ROLLOUT_ID = "rollout_id"
#: OpenAI's bound on a `metadata` value.
MAX_ROLLOUT_ID_CHARS = 512


def rollout_id(create: ResponseCreate) -> str | None:
    """The rollout id `create` names in its `metadata` (None: none); refused unless a
    non-empty string of at most 512 characters."""
    value = (create.metadata or {}).get(ROLLOUT_ID)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ROLLOUT_ID_CHARS:
        raise ProtocolError(
            "invalid_field",
            f"`metadata.{ROLLOUT_ID}` must be a string of 1 to {MAX_ROLLOUT_ID_CHARS} "
            "characters naming the rollout (the same on each of its requests).",
            param=f"metadata.{ROLLOUT_ID}",
        )
    return value


def refuse_background(create: ResponseCreate) -> None:
    """Over a WebSocket, as on OpenAI's WebSocket mode, there is no background mode: a
    socket's Response streams to its socket (a dropped one is reattached instead)."""
    if create.background:
        raise ProtocolError(
            "invalid_field",
            "`background: true` is served over HTTP only (POST /v1/responses), as OpenAI's "
            "WebSocket mode refuses it; remove it: this socket streams the Response.",
            param="background",
        )


#: What `include` names to get the logprobs of the model's text (`top_logprobs` says how many
#: of the likeliest tokens each lists).
LOGPROBS = "message.output_text.logprobs"
#: The most `top_logprobs` a request may ask for, as OpenAI's API (and vLLM, by default) allow.
MAX_TOP_LOGPROBS = 20


def wants_logprobs(create: ResponseCreate) -> bool:
    return LOGPROBS in (create.include or ())


#: What `include` names to get each output item's token ids and their logprobs (this server's
#: extension, named as OpenAI names `include` values; the fields are NeMo Gym's).
TOKEN_IDS = "output.token_ids"


def wants_token_ids(create: ResponseCreate) -> bool:
    return TOKEN_IDS in (create.include or ())


def check_top_logprobs(value: int | None) -> None:
    """`top_logprobs` is 0-20, as OpenAI's API takes it."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ProtocolError(
            "invalid_field",
            f"`top_logprobs` is {value}; send a whole number from 0 to {MAX_TOP_LOGPROBS}.",
            param="top_logprobs",
        )


#: What `prompt_cache_options` may say beyond `prewarm` (the API's values).
CACHE_TTLS = ("30m", "12h")
CACHE_MODES = ("implicit", "explicit")


def check_prompt_cache_options(options: PromptCacheOptions | None) -> None:
    """`ttl` and `mode` hold one of the API's values. They ask nothing this server must do (its
    warm state lives as long as the connection, or the store's retention), so they are only
    checked; `prewarm` is read by `warmup_field`."""
    if options is None:
        return
    for name, value, allowed in (
        ("ttl", options.ttl, CACHE_TTLS),
        ("mode", options.mode, CACHE_MODES),
    ):
        if value is not None and value not in allowed:
            raise ProtocolError(
                "invalid_field",
                f"`prompt_cache_options.{name}` is {quoted(value)}; it must be one of "
                f"{', '.join(map(repr, allowed))}.",
                param=f"prompt_cache_options.{name}",
            )


def warmup_field(create: ResponseCreate) -> str | None:
    """The field that makes `create` a warm-up (state built and prefilled, nothing generated),
    or None: `prompt_cache_options.prewarm: true`, which overrides `generate`, or
    `generate: false`."""
    options = create.prompt_cache_options
    if options is not None and options.prewarm:
        return "prompt_cache_options.prewarm"
    return "generate" if create.generate is False else None


def is_warmup(create: ResponseCreate) -> bool:
    return warmup_field(create) is not None


def compaction_threshold(create: ResponseCreate) -> int | None:
    """The prompt size in tokens past which this turn is compacted before the model reads it
    (`context_management: [{"type": "compaction", "compact_threshold": N}]`), or None; raises
    for an entry this server cannot honour, so no request for compaction is silently dropped."""
    threshold = None
    for index, entry in enumerate(create.context_management or ()):
        param = f"context_management[{index}]"
        if entry.type != "compaction":
            raise ProtocolError(
                "invalid_field",
                f"`{param}.type` is {quoted(entry.type)}; the only context management this "
                'server does is "compaction".',
                param=f"{param}.type",
            )
        if threshold is not None:
            raise ProtocolError(
                "invalid_field",
                f"`{param}` is a second compaction entry; send one.",
                param=param,
            )
        if entry.compact_threshold is None or entry.compact_threshold < 1:
            got = "missing" if entry.compact_threshold is None else str(entry.compact_threshold)
            raise ProtocolError(
                "invalid_field",
                f"`{param}.compact_threshold` is {got}; it must be a positive number of tokens "
                "(this server knows no context window to derive one from).",
                param=f"{param}.compact_threshold",
            )
        threshold = entry.compact_threshold
    return threshold


#: Why the prototype dialect refuses `context_management`.
PROTOTYPE_COMPACTION = (
    "its one Response keeps the model's state warm across tool calls, and compacting would "
    "replace that state in the middle of it; compact between Responses with "
    "POST /v1/responses/compact"
)


def check_conversation(create: ResponseCreate) -> None:
    """`conversation` is refused: this server keeps chains of Responses, not Conversation
    objects (there is no /v1/conversations to make one), so an id names nothing here, and a
    create that asked to be added to one must not be served as if it had been."""
    conversation = create.conversation
    if conversation is None:
        return
    valid = isinstance(conversation, str) or (
        isinstance(conversation, dict) and isinstance(conversation.get("id"), str)
    )
    if not valid:
        problem = 'must be a conversation id or {"id": ID}'
    elif create.previous_response_id is not None:
        problem = "cannot be used together with `previous_response_id`"
    else:
        problem = (
            "is not supported by this server: it stores chains of responses, not conversations. "
            "Chain with `previous_response_id` (store: true), or send the history in `input`"
        )
    raise ProtocolError("invalid_field", f"`conversation` {problem}.", param="conversation")


def input_items(create: ResponseCreate) -> tuple[Item, ...]:
    """`input` as items: a bare string is one user message."""
    if isinstance(create.input, str):
        return (Message(role="user", content=create.input),)
    return create.input


def _call_made(item: Item) -> str | None:
    """The call id of a tool call `item` is (a function's, a custom tool's, or a hosted tool's
    carried whole), or None."""
    if isinstance(item, FunctionCall | CustomToolCall):
        return item.call_id
    if isinstance(item, UnknownItem) and not item.type.endswith("_output"):
        call_id = item.raw.get("call_id")
        return call_id if isinstance(call_id, str) else None
    return None


def check_tool_outputs(history: Sequence[Item], items: Sequence[Item]) -> None:
    """Refuse, as OpenAI does, a tool output in `items` (a turn's new input) that answers no
    call of the conversation (`history`, then `items` before it). History is walked from its
    end, only while some output is unanswered; a compaction stops the walk (the calls it
    summarized are not there to be seen), as it does in `items`."""
    made: set[str] = set()
    unanswered: dict[str, tuple[int, ToolOutput]] = {}
    for index, item in enumerate(items):
        if is_compaction(item):
            return
        if (call_id := _call_made(item)) is not None:
            made.add(call_id)
        elif isinstance(item, ToolOutput) and item.call_id not in made:
            unanswered.setdefault(item.call_id, (index, item))
    for item in reversed(history):
        if not unanswered or is_compaction(item):
            return
        if (call_id := _call_made(item)) is not None:
            unanswered.pop(call_id, None)
    if not unanswered:
        return
    index, output = min(unanswered.values(), key=lambda found: found[0])
    kind = "function call" if isinstance(output, FunctionCallOutput) else "custom tool call"
    raise ProtocolError(
        "unknown_call_id",
        f"No tool call found for {kind} output with call_id {output.call_id}.",
        param=f"input[{index}]",
    )


@attrs.frozen
class PreparedInput:
    """A turn's new input, rendered: the prefix and history too when the rollout is cold."""

    prefix: array[int] | None
    history: RenderedItems
    input: RenderedItems
    #: `prefix_bytes` of the prefix's instructions and tools, counted with it (0 when warm):
    #: 0.1 s for 36,000 tools, so not on the event loop.
    prefix_nbytes: int = 0

    @property
    def tokens(self) -> int:
        """The tokens it adds to a conversation."""
        return len(self.prefix or ()) + len(self.history.tokens) + len(self.input.tokens)

    @property
    def nbytes(self) -> int:
        """About how much memory it adds to a conversation (items and tokens)."""
        return self.history.nbytes + self.input.nbytes + TOKEN_BYTES * self.tokens


def request_bytes(create: ResponseCreate) -> int:
    """About how much memory a decoded create holds while it waits to be served."""
    items = sum(item_bytes(item) for item in input_items(create))
    return prefix_bytes(create.instructions, create.tools) + items


def render_create_prefix(renderer: Renderer, create: ResponseCreate) -> array[int]:
    """The prefix a create's conversation opens with: its instructions, tools and effort. An
    array: the conversation takes it as memory copied, where millions of ints from a list
    held the event loop 50 ms."""
    effort = requested_effort(create.reasoning)
    return array("I", renderer.render_prefix(create.instructions, create.tools, effort=effort))


def prepare_input(
    renderer: Renderer, create: ResponseCreate, history: Sequence[Item], *, cold: bool
) -> PreparedInput:
    """Render what a turn adds; pure, so it may run on a worker thread."""
    prefix = render_create_prefix(renderer, create) if cold else None
    after = history[-1] if history else None
    return PreparedInput(
        prefix,
        render_items(renderer, history),
        render_items(renderer, input_items(create), after),
        prefix_bytes(create.instructions, create.tools) if cold else 0,
    )


def prepare_compacted(
    renderer: Renderer, create: ResponseCreate, history: Sequence[Item]
) -> PreparedInput:
    """Render a compacted history, cold (the prompt changed, so nothing of it is warm); the
    create's input is inside it already."""
    prefix = render_create_prefix(renderer, create)
    return PreparedInput(
        prefix,
        render_items(renderer, history),
        render_items(renderer, ()),
        prefix_bytes(create.instructions, create.tools),
    )


def compact_turn(
    renderer: Renderer, create: ResponseCreate, items: Sequence[Item], key: CompactionKey
) -> tuple[PreparedInput, UnknownItem]:
    """Server-side compaction of a turn whose prompt holds `items` (history and new input):
    what /v1/responses/compact would return for them (the user's messages, then a sealed
    compaction item), rendered cold, and that item. Pure, so it may run on a worker thread."""
    turns, outputs = counted(items)
    history, _ = compact(items, key, model_turns=turns, tool_outputs=outputs)
    item = history[-1]
    assert is_compaction(item)
    return prepare_compacted(renderer, create, history), item


def echoed_tool(tool: Tool) -> Tool:
    """Function tools come back complete, as the API echoes them; others exactly as sent."""
    if not isinstance(tool, FunctionTool):
        return tool
    return attrs.evolve(
        tool,
        parameters=tool.parameters if tool.parameters is not None else {"type": "object"},
        strict=True if tool.strict is None else tool.strict,
    )


def echoed_text(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """`text` as the API echoes it: a `format` always (`text` unless one was asked), so a
    create sending only `{"verbosity": "low"}`, as Codex does, gets a complete object back; a
    `json_schema` format with all of its fields."""
    echoed = {"format": {"type": "text"}, **text}
    form = echoed["format"]
    if isinstance(form, Mapping) and form.get("type") == "json_schema":
        # as the API echoes a JSON schema format: every field, null or false when not sent
        echoed["format"] = {"description": None, "schema": None, "strict": False, **form}
    return echoed


def response_template(
    create: ResponseCreate, *, response_id: str, created_at: int, default_model: str
) -> Response:
    """The Response object a create asks for, before anything has been generated."""
    optional = {
        name: value
        for name in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "truncation",
            "service_tier", "top_logprobs", "seed",
        )
        if (value := getattr(create, name)) is not None
    }  # fmt: skip
    return Response(
        id=response_id,
        created_at=created_at,
        status="in_progress",
        model=create.model or default_model,
        instructions=create.instructions,
        # a tool named by a bare string is served, but no schema has such a tool: not echoed
        tools=tuple(
            echoed_tool(tool)
            for tool in create.tools
            if not (isinstance(tool, UnknownTool) and isinstance(tool.raw, str))
        ),
        tool_choice=create.tool_choice,
        parallel_tool_calls=(
            True if create.parallel_tool_calls is None else create.parallel_tool_calls
        ),
        store=True if create.store is None else create.store,
        background=bool(create.background),
        previous_response_id=create.previous_response_id,
        metadata=create.metadata or {},
        max_output_tokens=create.max_output_tokens,
        max_tool_calls=create.max_tool_calls,
        reasoning=echoed_reasoning(create.reasoning),
        text=Response.DEFAULT_TEXT if create.text is None else echoed_text(create.text),
        user=create.user,
        prompt_cache_key=create.prompt_cache_key,
        safety_identifier=create.safety_identifier,
        **optional,
    )
