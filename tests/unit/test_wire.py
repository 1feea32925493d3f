"""The wire layer: every frame real clients were seen to send decodes; bad ones say where."""

from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from proto_server.core.request import response_template
from proto_server.wire import converter as wire_converter
from proto_server.wire import json_text
from proto_server.wire.converter import (
    as_json,
    converter,
    decode_client_event,
    decode_server_event,
    encode_json_bytes,
    encode_server_event,
    encode_server_event_bytes,
)
from proto_server.wire.errors import ErrorDetail, ProtocolError
from proto_server.wire.events import (
    ErrorEvent,
    ResponseAppend,
    ResponseCompleted,
    ResponseCreate,
    ResponseCreated,
    ResponseInject,
)
from proto_server.wire.items import FunctionCallOutput, Message, UnknownItem
from proto_server.wire.json_text import MAX_JSON_DEPTH
from proto_server.wire.tools import FunctionTool, UnknownTool

CAPTURES = Path(__file__).resolve().parents[3] / "shared" / "captures"


def captured_client_frames() -> list[tuple[str, dict[str, Any]]]:
    frames = []
    for path in sorted(CAPTURES.glob("*.json")):
        capture = json.loads(path.read_text())
        if "frames" in capture:
            frames += [(path.name, frame) for frame in capture["frames"]]
        for entry in capture.get("log", []) if isinstance(capture.get("log"), list) else []:
            if "client->server" in entry:
                frames.append((path.name, entry["client->server"]))
            elif entry.get("kind") == "ws_frame_in" and isinstance(entry.get("json"), dict):
                frames.append((path.name, entry["json"]))
    return frames


FRAMES = captured_client_frames()


def test_the_captures_are_there() -> None:
    assert {name for name, _ in FRAMES} >= {
        "codex-0.107-prototype.json",
        "codex-0.171-websocket.json",
        "codex-0.171-websocket-custom-tool.json",
        "openai-python-websocket.json",
        "agents-sdk-websocket.json",
    }


@pytest.mark.parametrize(("capture", "frame"), FRAMES, ids=[n for n, _ in FRAMES])
def test_every_captured_client_frame_decodes(capture: str, frame: dict[str, Any]) -> None:
    event = decode_client_event(orjson.dumps(frame))
    assert event.type == frame["type"]
    if isinstance(event, ResponseCreate):
        # tools are carried whole: what comes back out is what went in
        assert as_json(event.tools) == frame.get("tools", [])
        if isinstance(frame["input"], list):
            assert len(event.input) == len(frame["input"])


def test_codex_0107_appends_are_function_call_outputs() -> None:
    appends = [
        decode_client_event(orjson.dumps(f))
        for n, f in FRAMES
        if n == "codex-0.107-prototype.json" and f["type"] == "response.append"
    ]
    assert len(appends) == 2
    for append in appends:
        assert isinstance(append, ResponseAppend)
        assert [type(i) for i in append.input] == [FunctionCallOutput, FunctionCallOutput]


def test_an_easy_input_message_needs_no_type() -> None:
    event = decode_client_event(
        '{"type":"response.create","input":[{"role":"user","content":"hi"}]}'
    )
    assert isinstance(event, ResponseCreate)
    assert event.input == (Message(role="user", content="hi"),)


def test_unknown_items_and_tools_are_carried_untouched() -> None:
    listing = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "s", "tools": []}
    namespace = {"type": "namespace", "name": "mcp", "tools": [{"name": "a"}]}
    event = decode_client_event(
        orjson.dumps({"type": "response.create", "input": [listing], "tools": [namespace]})
    )
    assert isinstance(event, ResponseCreate)
    assert event.input == (UnknownItem(listing),)
    assert as_json(event.input[0]) == listing
    assert event.tools == (UnknownTool(namespace),)
    assert as_json(event.tools[0]) == namespace


def test_what_nests_in_a_carried_item_is_kept_encoded_not_as_objects_the_collector_scans() -> None:
    # 200 items of 121 nested containers each: decoded and kept, 24,200 objects that the cyclic
    # collector would scan for as long as the Response lives
    deep: object = 1
    for _ in range(60):
        deep = {"a": [deep]}
    listing = {"type": "mcp_list_tools", "id": "mcpl_1", "tools": [deep]}
    frame = orjson.dumps({"type": "response.create", "input": [listing] * 200})
    gc.collect()
    before = len(gc.get_objects())
    event = decode_client_event(frame)
    kept = len(gc.get_objects()) - before
    assert kept < 200 * 4, kept
    assert isinstance(event, ResponseCreate)
    assert as_json(event.input[0]) == listing  # and every byte of it goes back out
    assert orjson.dumps(converter.unstructure(event.input)) == orjson.dumps([listing] * 200)


def _nested(depth: int) -> Any:
    """A JSON value nesting `depth` containers."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("walked", [False, True])
@pytest.mark.parametrize("wide", [1, 1_000])
def test_depth_is_judged_exactly_however_wide_the_containers_are(
    wide: int, walked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a frame, `input`, an item, `x`: 3 levels above what the item's `x` nests; a frame of
    # millions of containers is walked (so that no one C call spans it), as this one is here
    if walked:
        monkeypatch.setattr(json_text, "LET_GO_CONTAINERS", 0)

    def frame(depth: int) -> bytes:
        items = [{"type": "reasoning_trace", "x": 1}] * (wide - 1)
        last = {"type": "reasoning_trace", "x": _nested(depth)}
        return orjson.dumps({"type": "response.create", "input": [*items, last]})

    assert isinstance(decode_client_event(frame(MAX_JSON_DEPTH - 3)), ResponseCreate)
    with pytest.raises(ProtocolError) as refused:
        decode_client_event(frame(MAX_JSON_DEPTH - 2))
    assert refused.value.detail.code == "invalid_json"
    assert str(MAX_JSON_DEPTH) in refused.value.detail.message


def test_a_large_frame_decodes_to_what_it_said_when_its_parse_tree_is_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame of many containers has its parse tree emptied container by container once it is
    decoded (so that no one C call frees millions of them); what the event kept of it is kept
    whole."""
    monkeypatch.setattr(json_text, "LET_GO_CONTAINERS", 100)  # as if this frame had millions
    parameters = {"type": "object", "properties": {"a": {"type": "array", "items": [{}]}}}
    tools = [{"type": "function", "name": f"f{i}", "parameters": parameters} for i in range(50)]
    schema = {"type": "object", "properties": {"k": {"enum": [[1, {"x": [2]}]]}}}
    body = {
        "model": "m",
        "metadata": {"k": "v"},
        "tools": tools,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
        "input": [
            {"type": "mcp_list_tools", "id": "mcpl_1", "tools": [{"a": [{"b": [1, 2]}]}]},
            *({"role": "user", "content": [{"type": "input_text", "text": "hi"}]},) * 200,
        ],
    }
    frame = orjson.dumps({"type": "response.create", **body})
    inject = orjson.dumps({"type": "response.inject", "response_id": "r", "input": body["input"]})
    event, injected = decode_client_event(frame), decode_client_event(inject)
    assert isinstance(injected, ResponseInject)
    assert list(injected.raw_input) == body["input"]  # returned as sent, were it refused
    monkeypatch.setattr(wire_converter, "let_go", lambda tree, containers: None)
    assert orjson.dumps(converter.unstructure(event)) == orjson.dumps(
        converter.unstructure(decode_client_event(frame))
    )
    assert as_json(event.tools[0])["parameters"] == parameters


def test_an_event_echoing_many_tools_and_items_is_encoded_as_in_one_call() -> None:
    """Long lists are encoded an entry at a time (no one C call over a 15 MB Response), and the
    bytes are those one call writes."""
    create = decode_client_event(
        orjson.dumps(
            {
                "type": "response.create",
                "tools": [
                    {"type": "function", "name": f"f{i}", "parameters": {"type": "object"}}
                    for i in range(200)
                ],
                "metadata": {"k": "v"},
            }
        )
    )
    assert isinstance(create, ResponseCreate)
    template = response_template(create, response_id="r", created_at=0, default_model="m")
    said = tuple(Message(role="assistant", content=f"line {i}") for i in range(100))
    response = attrs.evolve(template, output=said)
    for event in (ResponseCreated(response=template), ResponseCompleted(response=response)):
        whole = converter.unstructure(event) | {"sequence_number": 7, "stream_id": "lane"}
        assert encode_server_event_bytes(event, 7, "lane") == orjson.dumps(whole)
    for value in (response, said, said[:3], ()):  # as a JSON body, and as a store writes them
        assert encode_json_bytes(value) == orjson.dumps(converter.unstructure(value))


def test_a_refused_frame_leaves_no_cycle_holding_what_was_parsed() -> None:
    """Its error's traceback held the frame that held the error: a cycle that kept the whole
    parsed request alive until a full collection."""
    frame = orjson.dumps(
        {"type": "response.create", "input": [{"role": "user", "content": "hi"}] * 100 + [{}]}
    )
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what any collection finds is kept in gc.garbage, to look at
    try:
        with contextlib.suppress(ProtocolError):
            decode_client_event(frame)
        gc.collect()
        kept = [found for found in gc.garbage if isinstance(found, Message)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not kept, f"{len(kept)} structured items were only freed by the collector"


def test_unknown_fields_are_ignored() -> None:
    event = decode_client_event(
        '{"type":"response.create","model":"m","brand_new_field":{"x":1},"input":"hi"}'
    )
    assert isinstance(event, ResponseCreate)
    assert event.model == "m"


@pytest.mark.parametrize(
    ("frame", "param", "words"),
    [
        ('{"type":"response.create","input":[{"type":"function_call_output","output":"x"}]}',
         "input[0].call_id", "missing"),
        ('{"type":"response.create","tools":[{"type":"function","name":"f","strict":1}]}',
         "tools[0].strict", "expected a boolean"),
        ('{"type":"response.create","max_output_tokens":true}', "max_output_tokens",
         "expected an integer"),
        ('{"type":"response.create","input":[{"type":"message","role":"user","content":[7]}]}',
         "input[0].content[0]", "expected an object"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named_by_its_path(frame: str, param: str, words: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode_client_event(frame)
    detail = refused.value.detail
    assert (detail.code, detail.param) == ("invalid_field", param)
    assert words in detail.message


def test_non_utf8_is_invalid_json() -> None:
    with pytest.raises(ProtocolError) as refused:
        decode_client_event(b'{"type": "\xff"}')
    assert refused.value.detail.code == "invalid_json"


def test_server_events_round_trip_with_their_sequence_number() -> None:
    event = ErrorEvent(
        status=400, error=ErrorDetail(type="invalid_request_error", code="x", message="m")
    )
    text = encode_server_event(event, 41)
    assert json.loads(text) == {
        "type": "error",
        "status": 400,
        "error": {"type": "invalid_request_error", "code": "x", "message": "m", "param": None},
        "sequence_number": 41,
    }
    assert decode_server_event(text) == (41, event)


def test_function_tools_are_typed() -> None:
    tool = converter.structure({"type": "function", "name": "f", "parameters": {}}, FunctionTool)
    assert tool.name == "f" and tool.parameters == {}
