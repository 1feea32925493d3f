"""The one cattrs converter, and the functions that turn frames into events and back.

Structuring is strict (a number is not a string) and every failure becomes a `ProtocolError`
whose `param` is the path of the offending field, e.g. `input[2].call_id`.

The hooks are registrations on the one global `converter`, made when this module is imported,
and the decoders and their refusals (`_locate`, `_structure_or_refuse`) rely on the
`InvalidValue`s those hooks raise: kept together, whoever decodes a frame has every hook in
place. Reading the JSON text itself (its depth, a large text's parse) is json_text.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, get_args, get_origin

import attrs
import orjson
from cattrs import BaseValidationError
from cattrs.gen import make_dict_structure_fn
from cattrs.preconf.orjson import make_converter

from proto_server.wire.carried import wire_fields
from proto_server.wire.errors import ProtocolError, SteerRefused, quoted
from proto_server.wire.events import (
    CLIENT_EVENT_TYPES,
    SERVER_EVENT_TYPES,
    ClientEvent,
    FailedSteer,
    ResponseInject,
    ServerEvent,
)
from proto_server.wire.items import (
    ITEM_TYPES,
    TOKEN_FIELDS,
    Content,
    ContentPart,
    FunctionCall,
    InputText,
    Item,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
    StreamedPart,
    UnknownItem,
    UnknownPart,
)
from proto_server.wire.json_text import (
    in_pieces,
    let_go,
    list_in_pieces,
    load,
    long_list,
    opened,
    refuse_deep,
)
from proto_server.wire.options import ContextManagement, PromptCacheOptions
from proto_server.wire.refusals import InvalidStreamId, InvalidValue, locate, refusal
from proto_server.wire.scalars import NonNegativeInt, PositiveInt, StreamId
from proto_server.wire.tools import FunctionTool, Tool, UnknownTool

T = TypeVar("T")

converter = make_converter(forbid_extra_keys=False)


#: What a lane may be called (the SDK's session helper checks the same before it sends).
STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")


def _stream_id(value: Any, _: Any) -> str:
    if not isinstance(value, str) or STREAM_ID.fullmatch(value) is None:
        shown = quoted(value) if isinstance(value, str) else _json_kind(value)
        raise InvalidStreamId(
            f"must be 1-256 ASCII letters, digits, underscores, hyphens or periods, got {shown}"
        )
    return value


def lane_of(obj: Any) -> str | None:
    """The lane a frame names, if it names a valid one: where its refusal is sent."""
    value = obj.get("stream_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) and STREAM_ID.fullmatch(value) else None


def _strict(kind: type[T], name: str) -> Callable[[Any, Any], T]:
    # an integer is a number on the wire; a boolean is never an integer (as it is in Python)
    accepted: tuple[type, ...] = (int, float) if kind is float else (kind,)

    def structure(value: Any, _: Any) -> T:
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise InvalidValue(f"expected {name}, got {_json_kind(value)}")
        checked: Any = value
        return float(checked) if kind is float else checked  # type: ignore[return-value]

    return structure


def _at_least(least: int, name: str) -> Callable[[Any, Any], int]:
    integer = _strict(int, "an integer")

    def structure(value: Any, kind: Any) -> int:
        number = integer(value, kind)
        if number < least:
            raise InvalidValue(f"expected {name}, got {number}")
        return number

    return structure


def _json_kind(value: Any) -> str:
    kinds = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    kinds.update({type(None): "null", list: "an array", dict: "an object"})
    return kinds.get(type(value), type(value).__name__)


def _object(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidValue(f"expected an object, got {_json_kind(value)}")
    return value


def _tagged(value: Any) -> tuple[Mapping[str, Any], str]:
    obj = _object(value)
    tag = obj.get("type")
    if not isinstance(tag, str):
        raise InvalidValue("expected an object with a string `type`")
    return obj, tag


def _structure_part(value: Any, _: Any) -> ContentPart:
    obj, tag = _tagged(value)
    if tag == "input_text":
        return converter.structure(obj, InputText)
    if tag == "output_text":
        return converter.structure(obj, OutputText)
    return UnknownPart(obj)


def _structure_streamed_part(value: Any, _: Any) -> StreamedPart:
    obj, tag = _tagged(value)
    if tag == "reasoning_text":
        return converter.structure(obj, ReasoningText)
    return converter.structure(obj, OutputText)


def _structure_content(value: Any, _: Any) -> Content:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return tuple(converter.structure(value, list[ContentPart]))  # type: ignore[arg-type,unused-ignore]
    raise InvalidValue(f"expected a string or an array of content parts, got {_json_kind(value)}")


def _structure_item(value: Any, _: Any) -> Item:
    obj = _object(value)
    if "type" not in obj and "role" in obj:
        # the "easy input message" of the Responses API: {"role": ..., "content": ...}
        obj = {"type": "message", **obj}
    obj, tag = _tagged(obj)
    cls = ITEM_TYPES.get(tag)
    if cls is None:
        return UnknownItem(obj)
    return converter.structure(obj, cls)


def _structure_items(value: Any, _: Any) -> tuple[Item, ...]:
    if not isinstance(value, list):
        raise InvalidValue(f"expected an array of items, got {_json_kind(value)}")
    return tuple(converter.structure(value, list[Item]))  # type: ignore[arg-type,unused-ignore]


def _is_array_type(kind: Any) -> bool:
    """`tuple[X, ...]`: what the wire types use for a JSON array."""
    args = get_args(kind)
    return get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_array(value: Any, kind: Any) -> tuple[Any, ...]:
    # a string is iterable, but `"tools": "abc"` is not three tools
    if not isinstance(value, list):
        raise InvalidValue(f"expected an array, got {_json_kind(value)}")
    element: Any = get_args(kind)[0]
    items: list[Any] = converter.structure(value, list[element])
    return tuple(items)


def _structure_numbers(value: Any, kind: Any) -> tuple[Any, ...]:
    """An array of integers (token ids, bytes) or numbers (logprobs): a long one, as a client
    sends token fields back, checked in one pass; one with a wrong element, element by
    element (`_structure_array`), to say which."""
    accepted = (int,) if get_args(kind)[0] is int else (int, float)
    if isinstance(value, list) and all(type(element) in accepted for element in value):
        return tuple(value) if accepted == (int,) else tuple(map(float, value))
    return _structure_array(value, kind)


def _structure_input(value: Any, _: Any) -> str | tuple[Item, ...]:
    if isinstance(value, str):
        return value
    return _structure_items(value, None)


def _of_object(structure: Callable[[Any, Any], T]) -> Callable[[Any, Any], T]:
    """`structure`, for a JSON object only (cattrs would read any value without the keys)."""
    return lambda value, kind: structure(_object(value), kind)


def _structure_tool(value: Any, _: Any) -> Tool:
    if isinstance(value, str):
        return UnknownTool(value)  # a tool named only, as some clients and captures abbreviate
    obj, tag = _tagged(value)
    if tag == "function":
        return converter.structure(obj, FunctionTool)
    return UnknownTool(obj)


converter.register_structure_hook(str, _strict(str, "a string"))
converter.register_structure_hook(int, _strict(int, "an integer"))
converter.register_structure_hook(bool, _strict(bool, "a boolean"))
converter.register_structure_hook(float, _strict(float, "a number"))
converter.register_structure_hook(PositiveInt, _at_least(1, "a positive integer"))
converter.register_structure_hook(NonNegativeInt, _at_least(0, "an integer of 0 or more"))
converter.register_structure_hook(StreamId, _stream_id)
converter.register_structure_hook_func(lambda t: t == Mapping[str, Any], lambda v, _: _object(v))
converter.register_structure_hook_func(lambda t: t == ContentPart, _structure_part)
converter.register_structure_hook_func(lambda t: t == StreamedPart, _structure_streamed_part)
converter.register_structure_hook_func(lambda t: t == Content, _structure_content)
converter.register_structure_hook_func(lambda t: t == Item, _structure_item)
converter.register_structure_hook_func(_is_array_type, _structure_array)
converter.register_structure_hook_func(
    lambda t: t in (tuple[int, ...], tuple[float, ...]), _structure_numbers
)
converter.register_structure_hook_func(lambda t: t == tuple[Item, ...], _structure_items)
converter.register_structure_hook_func(lambda t: t == str | tuple[Item, ...], _structure_input)
converter.register_structure_hook_func(lambda t: t == Tool, _structure_tool)
for options in (PromptCacheOptions, ContextManagement):  # all-optional: "yes" is no object
    converter.register_structure_hook(
        options, _of_object(make_dict_structure_fn(options, converter))
    )
for carried in (UnknownItem, UnknownPart, UnknownTool):
    converter.register_unstructure_hook(carried, lambda obj: wire_fields(obj.raw))
converter.register_unstructure_hook_func(lambda t: t == Mapping[str, Any], lambda obj: obj)
_failed_steer = converter.gen_unstructure_attrs_fromdict(FailedSteer)
_reasoning = converter.gen_unstructure_attrs_fromdict(Reasoning)
_output_text = converter.gen_unstructure_attrs_fromdict(OutputText)


def _unstructure_output_text(part: OutputText) -> dict[str, Any]:
    """An output text part carries `logprobs` only when they were asked for (`include`)."""
    obj: dict[str, Any] = _output_text(part)
    if obj["logprobs"] is None:
        del obj["logprobs"]
    return obj


converter.register_unstructure_hook(OutputText, _unstructure_output_text)
_message = converter.gen_unstructure_attrs_fromdict(Message)
_function_call = converter.gen_unstructure_attrs_fromdict(FunctionCall)


def _without_token_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """An item carries its token fields only when they were asked for (`include`), and its
    weight version only where one was set."""
    if obj["generation_token_ids"] is None:
        for name in TOKEN_FIELDS:
            del obj[name]
    if obj["weight_version"] is None:
        del obj["weight_version"]
    return obj


converter.register_unstructure_hook(Message, lambda item: _without_token_fields(_message(item)))
converter.register_unstructure_hook(
    FunctionCall, lambda item: _without_token_fields(_function_call(item))
)


def _unstructure_reasoning(item: Reasoning) -> dict[str, Any]:
    """A reasoning item omits what it lacks (`encrypted_content` is a string or absent)."""
    return {key: value for key, value in _reasoning(item).items() if value is not None}


converter.register_unstructure_hook(Reasoning, _unstructure_reasoning)


def _unstructure_failed_steer(steer: FailedSteer) -> dict[str, Any]:
    """A steer refused before it was given an id omits `id`, as OpenAI's does."""
    obj: dict[str, Any] = _failed_steer(steer)
    if obj.get("id") is None:
        obj.pop("id", None)
    return obj


converter.register_unstructure_hook(FailedSteer, _unstructure_failed_steer)


def steer_items(value: Any) -> tuple[Item, ...]:
    """The input of a `response.steer` as items: a non-empty string (one user message) or a
    non-empty array of user messages, all OpenAI takes for steering; anything else raises
    `SteerRefused` (`invalid_input`), so its `response.steer.failed` returns it."""
    if isinstance(value, str):
        if not value:
            raise SteerRefused("invalid_input", "`input` is an empty string; steer with some text.")
        return (Message(role="user", content=value),)
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else _json_kind(value)
        raise SteerRefused(
            "invalid_input",
            f"`input` must be a string or a non-empty array of messages, got {got}.",
        )
    try:
        items = _structure_items(value, None)
    except (BaseValidationError, InvalidValue) as exc:
        path, leaf = locate(exc) if isinstance(exc, BaseValidationError) else ("", exc)
        where = f"`input{path}`" if path.startswith("[") else "`input`"
        raise SteerRefused("invalid_input", f"{where} is not a valid item ({leaf}).") from None
    for index, item in enumerate(items):
        if not isinstance(item, Message) or item.role != "user":
            kind = item.type if not isinstance(item, Message) else f"{item.role} message"
            raise SteerRefused(
                "invalid_input",
                f"`input[{index}]` is {kind!r}; steering takes only user messages (send tool "
                "outputs with response.create or response.append).",
            )
    return items


def _structure_or_refuse(obj: Mapping[str, Any], cls: type[T]) -> T:
    try:
        return converter.structure(obj, cls)
    except BaseValidationError as exc:
        path, code, message = refusal(exc)
    # raised here, not in the `except`: cattrs' error and its traceback (whose frames hold the
    # parsed request) would be this one's context, and this frame's locals hold them: a cycle
    # that only a full collection frees
    error = ProtocolError(
        code, f"`{path}` {message}; fix the field and resend the frame.", param=path or None
    )
    error.stream_id = lane_of(obj)
    try:
        raise error
    finally:
        del error


def decode_client_event(frame: str | bytes) -> ClientEvent:
    """A text frame from a client, as a typed event; a `ProtocolError` says what is wrong."""
    try:
        obj = load(frame)
    except ValueError as exc:
        raise ProtocolError(
            "invalid_json",
            f"The frame is not valid JSON ({exc}); send one JSON object per text frame.",
        ) from None
    containers = opened(frame)
    try:
        return _client_event(containers, obj)
    finally:
        let_go(obj, containers)


def _client_event(containers: int, obj: Any) -> ClientEvent:
    refuse_deep(containers, obj, "The frame")
    if not isinstance(obj, dict):
        raise ProtocolError(
            "invalid_json",
            f"The frame is JSON {_json_kind(obj)}, not an object; send one event object per frame.",
        )
    tag = obj.get("type")
    if not isinstance(tag, str):
        raise ProtocolError(
            "invalid_field",
            'The event has no string `type`; set it, e.g. "response.create".',
            param="type",
        )
    cls = CLIENT_EVENT_TYPES.get(tag)
    if cls is None:
        known = ", ".join(CLIENT_EVENT_TYPES)
        raise ProtocolError(
            "unknown_event_type",
            f"Unknown event type {quoted(tag)}; this server accepts {known}.",
            param="type",
        )
    event = _structure_or_refuse(obj, cls)
    if isinstance(event, ResponseInject):  # refused, it is returned as the client sent it
        event = attrs.evolve(event, raw_input=tuple(obj["input"]))
    return event


def decode_request_body(body: bytes, cls: type[T]) -> T:
    """An HTTP request body (a create without `type`) as `cls`; errors as for frames."""
    try:
        obj = load(body)
    except ValueError as exc:
        raise ProtocolError(
            "invalid_json", f"The request body is not valid JSON ({exc}); send a JSON object."
        ) from None
    containers = opened(body)
    try:
        refuse_deep(containers, obj, "The request body")
        if not isinstance(obj, dict):
            raise ProtocolError(
                "invalid_json", f"The request body is JSON {_json_kind(obj)}; send a JSON object."
            )
        obj.pop("type", None)
        return _structure_or_refuse(obj, cls)
    finally:
        let_go(obj, containers)


def encode_server_event(
    event: ServerEvent, sequence_number: int, stream_id: str | None = None
) -> str:
    """One server event as the text of one WebSocket frame (or one SSE `data:` line); an
    event of a named lane carries its `stream_id` (the default lane's carry none)."""
    return encode_server_event_bytes(event, sequence_number, stream_id).decode()


def encode_server_event_bytes(
    event: ServerEvent, sequence_number: int, stream_id: str | None = None
) -> bytes:
    """`encode_server_event` as the UTF-8 bytes a frame carries: encoded once, straight to bytes."""
    obj = converter.unstructure(event)
    obj["sequence_number"] = sequence_number
    if stream_id is not None:
        obj["stream_id"] = stream_id
    in_pieces(obj, levels=2)
    return orjson.dumps(obj)


def decode_stored(data: bytes, cls: Any, **fields: Any) -> Any:
    """What the server stored, as `cls` (with `fields` set): a large text parsed so that the
    GIL changes hands, and its parse tree let go of a piece at a time (`let_go`)."""
    obj = load(data)
    try:
        return converter.structure(obj | fields if fields else obj, cls)
    finally:
        let_go(obj, opened(data))


def encode_json_bytes(value: Any) -> bytes:
    """A wire value (a Response, a list of items) as UTF-8 JSON, its long lists encoded an
    entry at a time (`in_pieces`)."""
    obj = converter.unstructure(value)
    if isinstance(obj, list | tuple):
        return list_in_pieces(obj) if long_list(obj) else orjson.dumps(obj)
    in_pieces(obj, levels=1)
    return orjson.dumps(obj)


def decode_server_event(frame: str | bytes) -> tuple[int, ServerEvent]:
    """A frame the server sent, for clients and tests: its sequence number and its event."""
    obj = orjson.loads(frame)
    cls = SERVER_EVENT_TYPES[obj["type"]]
    return obj["sequence_number"], converter.structure(obj, cls)


def unstructure(value: Any) -> Any:
    return converter.unstructure(value)


def as_json(value: Any) -> Any:
    """`value` as the JSON a client decodes, carried values (`wire.carried`) included: for
    comparing and showing (`unstructure` keeps them encoded, for orjson to write out)."""
    return orjson.loads(orjson.dumps(converter.unstructure(value)))
