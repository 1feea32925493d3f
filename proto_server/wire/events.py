"""Every event on the wire: what clients send, and what the server streams back.

Server events carry no `sequence_number`: the connection's writer stamps it as it encodes, so the
numbers follow the order in which frames really leave, whoever produced the events.

The events are one closed set, and `CLIENT_EVENT_TYPES`,
`SERVER_EVENT_TYPES` and the unions list every class the converter decodes and the writer encodes.
Beside the classes, a new event and its entry are written together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from proto_server.wire.errors import ErrorDetail
from proto_server.wire.items import Item, Logprob, StreamedPart
from proto_server.wire.options import ContextManagement, PromptCacheOptions
from proto_server.wire.reattach import ResponseReattach
from proto_server.wire.response import Response
from proto_server.wire.scalars import NonNegativeInt, PositiveInt, StreamId
from proto_server.wire.tools import Tool

# -- client events ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreate:
    """Start a Response. Unknown fields are accepted and ignored: real clients send many."""

    type: str = "response.create"
    model: str | None = None
    input: str | tuple[Item, ...] = ()
    instructions: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    stream: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    generate: bool | None = None
    max_output_tokens: PositiveInt | None = None
    metadata: Mapping[str, Any] | None = None
    # carried through to the Response object, not interpreted
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: Objects, as the Response echoes them (a string or a number here is refused).
    reasoning: Mapping[str, Any] | None = None
    text: Mapping[str, Any] | None = None
    #: `auto` or `disabled` (checked by `check_create`).
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: NonNegativeInt | None = None
    #: How many of the likeliest tokens each logprob lists (0-20; `check_create`); echoed.
    top_logprobs: int | None = None
    #: What the Response should carry besides: `reasoning.encrypted_content` and
    #: `message.output_text.logprobs` are honoured.
    include: tuple[str, ...] | None = None
    #: Sampling seed, passed to an engine that takes one (the vLLM generator); carried.
    seed: int | None = None
    # read by core/request.py: a warm-up, server-side compaction, and a refused `conversation`
    prompt_cache_options: PromptCacheOptions | None = None
    context_management: tuple[ContextManagement, ...] | None = None
    conversation: Any = None
    #: WebSocket: the lane this Response runs on (None: the default lane). Creates on one lane
    #: are served in order, lanes run concurrently, and every event of the Response echoes it.
    stream_id: StreamId | None = None
    #: The multi-agent beta: `{"enabled": true}` makes a Response that calls client tools wait,
    #: still `in_progress`, for their outputs by `response.inject` (one Response per rollout).
    multi_agent: Mapping[str, Any] | None = None

    @property
    def waits_for_injects(self) -> bool:
        return isinstance(self.multi_agent, Mapping) and self.multi_agent.get("enabled") is True


@attrs.frozen(kw_only=True)
class ResponseAppend:
    """Answer the suspended Response's tool calls (and/or add a user message) and resume it.

    `tool_choice` (this project's extension): a new `tool_choice` for the rest of the Response,
    e.g. `"required"` while the agent must act and `"none"` once it must answer; absent: as
    before."""

    type: str = "response.append"
    input: tuple[Item, ...]
    tool_choice: Any = None
    #: The lane whose open Response this answers (None: the default lane).
    stream_id: StreamId | None = None
    #: This project's extension: the Response it answers, by id. Where the lane has no open
    #: Response, a suspended one is resumed from the store onto it (another connection's or
    #: another process's, rebuilt cold).
    response_id: str | None = None


@attrs.frozen(kw_only=True)
class ResponseCancel:
    """This project's extension: end the open Response with status `cancelled`."""

    type: str = "response.cancel"
    response_id: str | None = None
    #: The lane whose open Response to cancel (None: the default lane).
    stream_id: StreamId | None = None


@attrs.frozen(kw_only=True)
class ResponseInject:
    """The multi-agent beta (`OpenAI-Beta: responses_multi_agent=v1`): tool outputs for the
    named Response, which waits on them; committed atomically or refused with the input back.

    `raw_input` is the input as the client sent it, for `response.inject.failed` to return."""

    type: str = "response.inject"
    response_id: str
    input: tuple[Item, ...]
    raw_input: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen(kw_only=True)
class ResponseSteer:
    """User input for the Response `previous_response_id` names, while it streams: it ends at
    the next safe point and a successor continues with `input` (the prototype dialect: the
    same Response resumes with it). Never with `stream_id`: the target decides the lane.

    `input` is the JSON value as sent (a string or user messages): it is checked by the
    dialect (`steer_input`), so a steer that is not valid still gets `response.steer.failed`
    with its input back, rather than an `error` that would drop it."""

    type: str = "response.steer"
    previous_response_id: str
    input: Any = None
    #: Sent, though the SDKs never do: the steer is refused with `invalid_input`.
    stream_id: Any = None


#: This project's own client events: the prototype dialect's, and a cancel.
ProjectEvent = ResponseAppend | ResponseCancel | ResponseReattach
ClientEvent = ResponseCreate | ProjectEvent | ResponseInject | ResponseSteer

CLIENT_EVENT_TYPES: Mapping[str, type[ClientEvent]] = {
    "response.create": ResponseCreate,
    "response.append": ResponseAppend,
    "response.cancel": ResponseCancel,
    "response.inject": ResponseInject,
    "response.steer": ResponseSteer,
    "response.reattach": ResponseReattach,
}

# -- server events: the Response's life ------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreated:
    type: str = "response.created"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseQueued:
    """A create waits behind another Response on its lane; its `response.created` follows,
    with the same id, when its turn comes."""

    type: str = "response.queued"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseInProgress:
    type: str = "response.in_progress"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseDone:
    """Prototype dialect: this segment is over, the Response is still open, append to resume."""

    type: str = "response.done"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseCompleted:
    type: str = "response.completed"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseFailed:
    type: str = "response.failed"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseIncomplete:
    type: str = "response.incomplete"
    response: Response


@attrs.frozen(kw_only=True)
class ResponseCancelled:
    """This project's extension, the answer to `response.cancel`."""

    type: str = "response.cancelled"
    response: Response


# -- server events: the multi-agent beta's answers to response.inject --------------------------


@attrs.frozen(kw_only=True)
class ResponseInjectCreated:
    """Every injected item was validated and committed to the Response."""

    type: str = "response.inject.created"
    response_id: str


@attrs.frozen(kw_only=True)
class InjectError:
    code: str  # response_not_found | response_already_completed
    message: str


@attrs.frozen(kw_only=True)
class ResponseInjectFailed:
    """Nothing was committed; `input` is what the client sent, to retry elsewhere."""

    type: str = "response.inject.failed"
    response_id: str
    error: InjectError
    input: tuple[Any, ...]


# -- server events: the answers to response.steer ------------------------------------------------


@attrs.frozen(kw_only=True)
class SteerRef:
    """An accepted steer: its id, and the Response it steers."""

    id: str
    previous_response_id: str


@attrs.frozen(kw_only=True)
class ResponseSteerAccepted:
    """The server owns the steer's input (not yet committed: the successor's
    `response.created`, or the prototype Response's `response.in_progress`, commits it)."""

    type: str = "response.steer.accepted"
    steer: SteerRef


@attrs.frozen(kw_only=True)
class RequiredInput:
    """A stub of an output the steered Response waits for: fill it and send it."""

    type: str = "function_call_output"
    call_id: str
    name: str


@attrs.frozen(kw_only=True)
class ResponseSteerPending:
    """The steer waits until the outputs in `required_input` arrive, then it is applied."""

    type: str = "response.steer.pending"
    reason: str = "waiting_for_required_input"
    required_input: tuple[RequiredInput, ...]
    steer: SteerRef


@attrs.frozen(kw_only=True)
class SteerError:
    code: str
    message: str
    type: str = "invalid_request_error"


@attrs.frozen(kw_only=True)
class FailedSteer:
    """The steer as it was sent (`input` as the client sent it); `id` once one was given."""

    input: Any
    previous_response_id: str
    id: str | None = None


@attrs.frozen(kw_only=True)
class ResponseSteerFailed:
    """Nothing of the steer was committed; its input comes back to carry elsewhere."""

    type: str = "response.steer.failed"
    error: SteerError
    steer: FailedSteer


# -- server events: items and their deltas ---------------------------------------------------


@attrs.frozen(kw_only=True)
class OutputItemAdded:
    type: str = "response.output_item.added"
    output_index: int
    item: Item


@attrs.frozen(kw_only=True)
class OutputItemDone:
    type: str = "response.output_item.done"
    output_index: int
    item: Item


@attrs.frozen(kw_only=True)
class ContentPartAdded:
    type: str = "response.content_part.added"
    item_id: str
    output_index: int
    content_index: int
    part: StreamedPart


@attrs.frozen(kw_only=True)
class ContentPartDone:
    type: str = "response.content_part.done"
    item_id: str
    output_index: int
    content_index: int
    part: StreamedPart


@attrs.frozen(kw_only=True)
class OutputTextDelta:
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    #: The logprobs of the tokens `delta` holds (empty unless `include` asked for them).
    logprobs: tuple[Logprob, ...] = ()


@attrs.frozen(kw_only=True)
class OutputTextDone:
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    #: The logprobs of every token of `text` (empty unless `include` asked for them).
    logprobs: tuple[Logprob, ...] = ()


@attrs.frozen(kw_only=True)
class ReasoningTextDelta:
    """OpenAI's name; the Open Responses document calls it `response.reasoning.delta`."""

    type: str = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


@attrs.frozen(kw_only=True)
class ReasoningTextDone:
    type: str = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDelta:
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDone:
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class CustomToolCallInputDelta:
    type: str = "response.custom_tool_call_input.delta"
    item_id: str
    output_index: int
    delta: str


@attrs.frozen(kw_only=True)
class CustomToolCallInputDone:
    type: str = "response.custom_tool_call_input.done"
    item_id: str
    output_index: int
    input: str


@attrs.frozen(kw_only=True)
class CompactionCompacting:
    """Server-side compaction (`context_management`) is making the `compaction` item at
    `output_index`, between its `output_item.added` and `.done`; it carries no summary."""

    type: str = "response.compaction.compacting"
    item_id: str
    output_index: int


@attrs.frozen(kw_only=True)
class ErrorEvent:
    """A client frame was refused; `status` is HTTP-like. The connection stays open."""

    type: str = "error"
    status: int
    error: ErrorDetail


ResponseEvent = (
    ResponseCreated
    | ResponseQueued
    | ResponseInProgress
    | ResponseDone
    | ResponseCompleted
    | ResponseFailed
    | ResponseIncomplete
    | ResponseCancelled
)
ItemEvent = (
    OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | CustomToolCallInputDelta
    | CustomToolCallInputDone
    | CompactionCompacting
)
InjectEvent = ResponseInjectCreated | ResponseInjectFailed
SteerEvent = ResponseSteerAccepted | ResponseSteerPending | ResponseSteerFailed
ServerEvent = ResponseEvent | ItemEvent | InjectEvent | SteerEvent | ErrorEvent

SERVER_EVENT_TYPES: Mapping[str, type[ServerEvent]] = {
    attrs.fields(cls).type.default: cls
    for cls in (
        ResponseCreated,
        ResponseQueued,
        ResponseInProgress,
        ResponseDone,
        ResponseCompleted,
        ResponseFailed,
        ResponseIncomplete,
        ResponseCancelled,
        OutputItemAdded,
        OutputItemDone,
        ContentPartAdded,
        ContentPartDone,
        OutputTextDelta,
        OutputTextDone,
        ReasoningTextDelta,
        ReasoningTextDone,
        FunctionCallArgumentsDelta,
        FunctionCallArgumentsDone,
        CustomToolCallInputDelta,
        CustomToolCallInputDone,
        CompactionCompacting,
        ResponseInjectCreated,
        ResponseInjectFailed,
        ResponseSteerAccepted,
        ResponseSteerPending,
        ResponseSteerFailed,
        ErrorEvent,
    )
}
