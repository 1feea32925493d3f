"""The wire layer: every frame real clients were seen to send decodes; bad ones say where."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proto_server.wire.converter import (
    as_json,
    converter,
    decode_client_event,
    decode_server_event,
    encode_server_event,
)
from proto_server.wire.errors import ErrorDetail, ProtocolError
from proto_server.wire.events import ErrorEvent, ResponseAppend, ResponseCreate
from proto_server.wire.items import FunctionCallOutput, Message, UnknownItem
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
