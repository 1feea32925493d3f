"""Bad bytes, bad frames, bad handshakes, slow clients: each gets a clear error or a clean
refusal, the server never crashes, and other connections do not notice.

The decoder and the request-head reader are fuzzed directly with hypothesis; the rest runs
against a real server on 127.0.0.1, with a bystander client finishing a checked rollout while
the hostile one does its worst. Time-outs run on trio's autojump clock.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import orjson
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, ConnectionRejected

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.request import input_items, response_template
from proto_server.core.tool_schema import MAX_SCHEMA_DEPTH
from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.listener import overflow
from proto_server.server.listener.app import BoundAddress, ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.transport.handshake import (
    BadRequestHead,
    RequestHead,
    read_request_head,
    upgrade_refusal,
)
from proto_server.testing import WireClient, connect_checked
from proto_server.wire.converter import decode_client_event, encode_server_event
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate, ResponseCreated
from proto_server.wire.json_text import MAX_JSON_DEPTH

from ..support.clients import connect, read_all
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS, answers, create, json_values
from ..support.servers import FAST, quiet
from ..support.stores import CheckpointStore

DECODER_CODES = {"invalid_json", "invalid_field", "unknown_event_type"}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIVE_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "custom_tool_call"]
items = st.fixed_dictionaries(
    {"type": st.sampled_from(ITEM_TYPES)},
    optional={
        "role": st.sampled_from(["user", "assistant", "developer", "system"]) | json_values,
        "content": json_values,
        "call_id": json_values,
        "name": json_values,
        "arguments": json_values,
        "output": json_values,
        "summary": json_values,
    },
)
client_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["response.create", "response.append", "response.cancel"])},
    optional={
        "model": json_values,
        "input": st.text(max_size=10) | st.lists(items | json_values, max_size=3) | json_values,
        "instructions": json_values,
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["function", "web_search", "custom"])},
                optional={"name": json_values, "parameters": json_values},
            )
            | json_values,
            max_size=3,
        ),
        "metadata": json_values,
        "parallel_tool_calls": json_values,
        "store": json_values,
        "max_output_tokens": json_values,
        "stream": json_values,
        "extra": json_values,
    },
)


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


# -- the frame decoder ---------------------------------------------------------------------------


def decode_or_refusal(frame: str | bytes) -> ResponseCreate | ProtocolError | Any:
    try:
        return decode_client_event(frame)
    except ProtocolError as exc:
        assert exc.detail.code in DECODER_CODES, exc.detail
        assert exc.status == 400 and exc.detail.message
        return exc


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=300))
def test_any_bytes_decode_to_an_event_or_a_precise_refusal(frame: str | bytes) -> None:
    decode_or_refusal(frame)


@FUZZ
@given(client_frames)
def test_any_json_frame_is_refused_with_a_path_or_is_safe_to_serve(frame: dict[str, Any]) -> None:
    """Whatever decodes can be served: rendered, and echoed back in a Response object."""
    outcome = decode_or_refusal(orjson.dumps(frame))
    if isinstance(outcome, ProtocolError):
        if outcome.detail.code == "invalid_field":
            assert outcome.detail.param is not None
            assert f"`{outcome.detail.param}`" in outcome.detail.message
        return
    if isinstance(outcome, ResponseCreate):
        conversation = Conversation(
            O200kRenderer(), instructions=outcome.instructions, tools=outcome.tools
        )
        conversation.extend(input_items(outcome))
        template = response_template(outcome, response_id="resp_1", created_at=0, default_model="m")
        orjson.loads(encode_server_event(ResponseCreated(response=template), 0))


@FUZZ
@given(frame=client_frames, cut=st.floats(0, 1, exclude_max=True))
def test_a_truncated_frame_is_invalid_json(frame: dict[str, Any], cut: float) -> None:
    text = orjson.dumps(frame)
    outcome = decode_or_refusal(text[: int(len(text) * cut)])
    assert isinstance(outcome, ProtocolError) and outcome.detail.code == "invalid_json"


WRONG = {"a string": "x", "a number": 1.5, "a boolean": True, "an array": [1], "an object": {}}


@pytest.mark.parametrize(
    ("field", "right"),
    [
        ("model", "a string"),
        ("instructions", "a string"),
        ("input", "a string"),
        ("tools", "an array"),
        ("parallel_tool_calls", "a boolean"),
        ("store", "a boolean"),
        ("max_output_tokens", "a number"),
        ("metadata", "an object"),
    ],
)
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_field_of_the_wrong_type_is_named(field: str, right: str, wrong: str) -> None:
    if wrong == right or (field == "input" and wrong == "an array"):
        return  # not wrong
    frame = {"type": "response.create", field: WRONG[wrong]}
    outcome = decode_or_refusal(orjson.dumps(frame))
    assert isinstance(outcome, ProtocolError), frame
    assert (outcome.detail.code, outcome.detail.param) == ("invalid_field", field)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200, 254, 300, 1_000, 100_000])
@pytest.mark.parametrize("field", ["metadata", "input", "tools", "unknown_field"])
def test_deep_nesting_is_refused_before_it_can_hurt(depth: int, field: str) -> None:
    deep = "[" * depth + "]" * depth  # orjson cannot even write these
    value = {
        "metadata": f'{{"k": {deep}}}',
        "input": f'[{{"type": "reasoning", "x": {deep}}}]',
        "tools": f'[{{"type": "custom", "x": {deep}}}]',
        "unknown_field": deep,
    }[field]
    text = f'{{"type": "response.create", "{field}": {value}}}'
    outcome = decode_or_refusal(text)
    assert isinstance(outcome, ProtocolError) and outcome.detail.code == "invalid_json"
    assert "deep" in outcome.detail.message or "depth" in outcome.detail.message


def test_the_deepest_accepted_frame_is_served() -> None:
    frame = {"type": "response.create", "metadata": {"k": nested(MAX_JSON_DEPTH - 2)}}
    event = decode_client_event(orjson.dumps(frame))
    assert isinstance(event, ResponseCreate)
    template = response_template(event, response_id="r", created_at=0, default_model="m")
    assert encode_server_event(ResponseCreated(response=template), 0)


# -- the request-head reader ---------------------------------------------------------------------


class Chunks(trio.abc.ReceiveStream):
    """Hands out fixed chunks, then the end of the stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        pass


def read_head(data: bytes, cuts: list[int]) -> RequestHead | BadRequestHead | None:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points) if b > a]

    async def read() -> RequestHead | BadRequestHead | None:
        try:
            return await read_request_head(Chunks(chunks), max_bytes=4096)  # type: ignore[arg-type]
        except BadRequestHead as exc:
            return exc

    return trio.run(read)


def summary(outcome: RequestHead | BadRequestHead | None) -> Any:
    if isinstance(outcome, RequestHead):
        return ("head", outcome.request.method, outcome.target, outcome.request.headers)
    return type(outcome).__name__


@FUZZ
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=6))
def test_any_bytes_give_a_head_the_end_or_a_refusal_however_they_are_cut(
    data: bytes, cuts: list[int]
) -> None:
    assert summary(read_head(data, cuts)) == summary(read_head(data, []))


#: Header names; `host` is the one header a request may not repeat (h11 refuses a second).
tokens = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda name: name != "host"
)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126)).map(str.strip)
request_heads = st.builds(
    lambda method, target, headers: (
        f"{method} {target} HTTP/1.1\r\nHost: x\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers)
        + "\r\n"
    ).encode(),
    st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    st.from_regex(r"/[a-z0-9/?=&%._-]{0,30}", fullmatch=True),
    st.lists(st.tuples(tokens, header_values), max_size=5),
)


@FUZZ
@given(head=request_heads, tail=st.binary(max_size=50), cuts=st.lists(st.integers(0, 600)))
def test_a_well_formed_head_is_read_whole_and_what_follows_is_kept(
    head: bytes, tail: bytes, cuts: list[int]
) -> None:
    outcome = read_head(head + tail, cuts)
    assert isinstance(outcome, RequestHead), outcome
    assert outcome.raw.startswith(head)
    assert (head + tail).startswith(outcome.raw)


def upgrade(*lines: str, method: str = "GET", version: str = "1.1") -> bytes:
    base = {
        "host": "x",
        "upgrade": "websocket",
        "connection": "Upgrade",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version": "13",
    }
    for line in lines:
        name, _, value = line.partition(":")
        if value:
            base[name] = value.strip()
        else:
            base.pop(name)
    headers = "".join(f"{k}: {v}\r\n" for k, v in base.items())
    return f"{method} /v1/responses?dialect=prototype HTTP/{version}\r\n{headers}\r\n".encode()


BAD_UPGRADES = [
    (upgrade("sec-websocket-key"), 400, "Sec-WebSocket-Key"),
    (upgrade("sec-websocket-version: 8"), 426, "Version: 13"),
    (upgrade("sec-websocket-version"), 426, "Version: 13"),
    (upgrade("connection: keep-alive"), 400, "Connection: Upgrade"),
    (upgrade(method="POST"), 400, "must be GET over HTTP/1.1"),
    (upgrade(version="1.0"), 400, "must be GET over HTTP/1.1"),
]


@pytest.mark.parametrize(("request_bytes", "status", "hint"), BAD_UPGRADES)
def test_a_bad_upgrade_is_named(request_bytes: bytes, status: int, hint: str) -> None:
    head = read_head(request_bytes, [])
    assert isinstance(head, RequestHead) and head.is_websocket
    refusal = upgrade_refusal(head)
    assert refusal is not None and refusal.status == status and hint in refusal.detail.message
    assert upgrade_refusal(read_head(upgrade(), [])) is None  # type: ignore[arg-type]


async def test_a_refused_upgrade_is_a_whole_http_response_with_what_its_status_needs() -> None:
    """Refusals before any HTTP exchange go out through h11 as every other HTTP error does: a
    426 says the version spoken, a 503 when to retry, and each closes the connection."""
    async with serving(max_connections=1) as (_, address):
        with trio.fail_after(10):
            answers_ = {
                426: await exchange_raw(address, upgrade("sec-websocket-version: 8")),
                400: await exchange_raw(address, b"NOT HTTP\r\n\r\n"),
            }
            async with connect(f"{address.ws_url}?dialect=prototype"):  # the one allowed
                answers_[503] = await exchange_raw(address, upgrade())
    said = {}
    for status, raw in answers_.items():
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.receive_data(raw)
        response, body = client.next_event(), client.next_event()
        assert isinstance(response, h11.Response) and response.status_code == status, raw
        assert isinstance(body, h11.Data) and "error" in orjson.loads(body.data)
        said[status] = dict(response.headers)
        assert said[status][b"content-type"] == b"application/json"
        assert said[status][b"connection"] == b"close"
    assert said[426][b"sec-websocket-version"] == b"13"
    assert said[503][b"retry-after"] == b"1"


# -- live: a hostile client beside a good one ------------------------------------------------------


@asynccontextmanager
async def serving(**config: Any) -> AsyncIterator[tuple[ProtoServer, BoundAddress]]:
    server = ProtoServer(
        SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST),
        ServerConfig(port=0, **config),
        store=CheckpointStore(),
    )
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        yield server, address
        nursery.cancel_scope.cancel()
    assert server.crashed_connections == 0


async def full_rollout(client: WireClient) -> None:
    await client.send(create())
    events = await client.segment()
    while events[-1]["type"] == "response.done":
        await client.send({"type": "response.append", "input": answers(events)})
        events = await client.segment()
    assert events[-1]["type"] == "response.completed", events[-1]


async def beside_a_bystander(address: BoundAddress, attack: Callable[[], Awaitable[None]]) -> None:
    """Run `attack` while another client holds a suspended rollout, then let that one finish:
    its stream must be whole (the checker) and complete."""
    async with connect_checked(f"{address.ws_url}?dialect=prototype") as bystander:
        await bystander.send(create())
        first = await bystander.segment()
        with trio.fail_after(30):
            await attack()
        await bystander.send({"type": "response.append", "input": answers(first)})
        events = await bystander.segment()
        while events[-1]["type"] == "response.done":
            await bystander.send({"type": "response.append", "input": answers(events)})
            events = await bystander.segment()
        assert events[-1]["type"] == "response.completed"


async def exchange_raw(address: BoundAddress, data: bytes) -> bytes:
    """Send `data` on a fresh TCP connection, end it, and read until the server closes."""
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        with trio.fail_after(5):
            received = b""
            while chunk := await stream.receive_some():
                received += chunk
            return received


async def received(stream: trio.SocketStream) -> bytes:
    """All `stream` brings until the server closes it."""
    data = b""
    while chunk := await stream.receive_some():
        data += chunk
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@LIVE_FUZZ
@given(garbage=st.binary(min_size=1, max_size=300))
@example(garbage=b"GET /healthz HTTP/1.1\nhost:\n\n")  # bytes that are a request, found so
async def test_random_bytes_for_a_request_are_refused_and_hurt_no_one(garbage: bytes) -> None:
    """Refused with a 4xx, or, where the bytes happen to be a request, answered: never a
    server error, and the bystander is served throughout."""
    async with serving(handshake_timeout_s=1) as (server, address):

        async def attack() -> None:
            response = await exchange_raw(address, garbage)
            assert response == b"" or status_of(response) < 500, response[:200]

        await beside_a_bystander(address, attack)
        await server.wait_idle()


async def test_a_request_of_an_http_version_not_spoken_is_refused() -> None:
    """h11 reads any `HTTP/d.d`: a `GET /healthz HTTP/0.0` was answered 200 as if it were 1.1."""
    async with serving(handshake_timeout_s=1) as (_, address):
        response = await exchange_raw(address, b"GET /healthz HTTP/0.0\r\nhost: x\r\n\r\n")
    assert status_of(response) == 400
    assert b"HTTP/0.0 is not spoken here" in response


@LIVE_FUZZ
@given(garbage=st.binary(min_size=1, max_size=200))
async def test_random_bytes_after_a_good_request_hurt_no_one(garbage: bytes) -> None:
    good = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    async with serving(handshake_timeout_s=1) as (server, address):

        async def attack() -> None:
            stream = await trio.open_tcp_stream(address.host, address.port)
            async with stream:
                await stream.send_all(good + garbage)
                await stream.send_eof()
                with trio.fail_after(5):
                    received = b""
                    while chunk := await stream.receive_some():
                        received += chunk
            assert received.startswith(b"HTTP/1.1 200 ")

        await beside_a_bystander(address, attack)
        await server.wait_idle()


@pytest.mark.parametrize(("request_bytes", "status", "hint"), BAD_UPGRADES)
async def test_a_bad_upgrade_is_refused_with_a_reason_and_closed(
    request_bytes: bytes, status: int, hint: str
) -> None:
    async with serving() as (server, address):

        async def attack() -> None:
            response = await exchange_raw(address, request_bytes)
            head, _, body = response.partition(b"\r\n\r\n")
            assert status_of(response) == status
            assert hint in orjson.loads(body)["error"]["message"]
            assert b"connection: close" in head.lower()

        await beside_a_bystander(address, attack)
        await server.wait_idle()


async def test_a_request_head_over_the_limit_is_refused() -> None:
    async with serving() as (server, address):
        huge = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 70_000 + b"\r\n\r\n"
        response = await exchange_raw(address, huge)
        assert status_of(response) == 400 and b"Malformed HTTP request" in response
        await server.wait_idle()


async def test_a_slow_loris_is_cut_off_at_the_handshake_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving(handshake_timeout_s=10) as (server, address):

        async def attack() -> None:
            stream = await trio.open_tcp_stream(address.host, address.port)
            async with stream:
                start = trio.current_time()
                for piece in (b"GET /v1/responses", b" HTTP/1.1\r\n", b"Host: x\r\n"):
                    await stream.send_all(piece)
                    await trio.sleep(3)  # a byte now and then does not buy more time
                received = b""
                while chunk := await stream.receive_some():
                    received += chunk
                assert trio.current_time() - start == pytest.approx(10)
            assert status_of(received) == 408
            assert b"within 10 s" in received

        await beside_a_bystander(address, attack)
        await server.wait_idle()


async def test_http_clients_that_stall_or_idle_are_let_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving(handshake_timeout_s=10) as (server, address):
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            await stream.send_all(
                b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 90\r\n\r\n{"
            )
            start = trio.current_time()
            received = b""
            while chunk := await stream.receive_some():
                received += chunk
            assert status_of(received) == 408 and b"stalled for 10 s" in received
            assert trio.current_time() - start == pytest.approx(10)
        idle = await trio.open_tcp_stream(address.host, address.port)
        async with idle:
            await idle.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            start = trio.current_time()
            received = b""
            while chunk := await idle.receive_some():
                received += chunk
            assert status_of(received) == 200  # then kept alive, idle, and closed at 10 s
            assert trio.current_time() - start == pytest.approx(10)
        await server.wait_idle()


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(client_frames.map(lambda f: orjson.dumps(f).decode()) | st.binary(max_size=50)))
async def test_hostile_frames_each_get_one_answer_and_the_connection_lives(
    frames: list[str | bytes],
) -> None:
    """Any frames: every one is answered (the checker counts), then a rollout still works."""
    async with serving() as (server, address):
        async with connect_checked(f"{address.ws_url}?dialect=prototype") as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all, client)
                for frame in frames:
                    await client.send(frame)
                await client.send({"type": "response.cancel"})  # whatever they opened
                await quiet()
                nursery.cancel_scope.cancel()
            await full_rollout(client)
        await server.wait_idle()


async def test_huge_deep_and_broken_frames_beside_a_bystander() -> None:
    async with serving(max_message_bytes=2 * 1024 * 1024) as (server, address):

        async def attack() -> None:
            url = f"{address.ws_url}?dialect=prototype"
            # the server echoes instructions in its Response objects: let those through
            async with connect_checked(url, max_message_size=8 * 1024 * 1024) as client:
                nest = "[" * 300 + "]" * 300
                await client.send(f'{{"type": "response.create", "metadata": {{"a": {nest}}}}}')
                assert (await client.receive())["error"]["code"] == "invalid_json"
                await client.send(create(instructions="x" * (1024 * 1024)))  # big, under the limit
                assert (await client.segment())[-1]["type"] == "response.done"
                await client.send({"type": "response.cancel"})
                assert (await client.receive())["type"] == "response.cancelled"
            async with connect_checked(url) as client:
                with pytest.raises(ConnectionClosed) as closed:
                    await client.send(create(instructions="x" * (3 * 1024 * 1024)))
                    await client.receive()
                assert closed.value.reason.code == 1009
            async with connect_checked(url) as client:
                await client.send_raw(masked_text_frame(b"\xff\xfe not utf-8"))
                with pytest.raises(ConnectionClosed) as closed:
                    await client.receive()
                # wsproto drops the TCP at once (1006) rather than saying 1007 in a close frame
                assert closed.value.reason.code in (1006, 1007)

        await beside_a_bystander(address, attack)
        await server.wait_idle()


def masked_text_frame(payload: bytes) -> bytes:
    """A client's text frame, by hand: the payload is sent as is, valid UTF-8 or not."""
    assert len(payload) < 126
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x81, 0x80 | len(payload)]) + mask + masked


async def test_tools_with_any_schema_are_carried() -> None:
    """Strange but legal tools (deep schemas under the limit, unknown types) are served."""
    async with serving() as (_, address):
        schema: Any = {"type": "object"}
        for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):  # as deep as the tool schema budget allows
            schema = {"type": "object", "properties": {"inner": schema}}
        tools = [{**EXEC_COMMAND, "parameters": schema}, {"type": "web_search"}, "bare_name"]
        async with connect_checked(f"{address.ws_url}?dialect=prototype") as client:
            await client.send(create(tools=tools))
            events = await client.segment()
            echoed = events[0]["response"]["tools"]
            assert echoed[1] == {"type": "web_search"}
            assert len(echoed) == 2  # a bare name is served, but no schema echoes it


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


async def test_health_probes_are_answered_past_the_cap_and_nothing_else_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of idle connections fills the server; a liveness probe still hears it is
    alive (an orchestrator would otherwise restart a busy server), the API stays refused."""
    monkeypatch.setattr(overflow, "PROBE_WAIT_S", 30.0)  # however slow a busy machine is
    async with serving(max_connections=2) as (server, address):
        url = f"{address.ws_url}?dialect=prototype"
        with trio.fail_after(20):
            async with connect_checked(url), connect_checked(url):
                healthz = await exchange_raw(address, get("/healthz"))
                readyz = await exchange_raw(address, get("/readyz"))
                api = await exchange_raw(address, get("/v1/models"))
                assert server.open_connections == 2
    assert status_of(healthz) == 200 and b'"ok"' in healthz
    assert status_of(readyz) == 200 and b'"ready"' in readyz
    assert status_of(api) == 503 and b"server_busy" in api


async def test_connections_that_send_nothing_cannot_hold_every_probes_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The longest-waiting of the connections read for a probe gives its place to a new one,
    so a probe is answered while idle connections past the cap keep coming."""
    monkeypatch.setattr(overflow, "PROBE_WAIT_S", 30.0)
    async with serving(max_connections=1, probe_connections=2) as (_, address):
        url = f"{address.ws_url}?dialect=prototype"
        with trio.fail_after(20):
            async with connect_checked(url):
                idle = [await trio.open_tcp_stream(address.host, address.port) for _ in range(3)]
                await trio.testing.wait_all_tasks_blocked(0.05)  # all three are being read
                healthz = await exchange_raw(address, get("/healthz"))
                for stream in idle[:2]:  # the two longest-waiting were let go to make room
                    assert status_of(await received(stream)) == 503
                for stream in idle:
                    await stream.aclose()
    assert status_of(healthz) == 200


async def test_without_probe_connections_a_full_server_answers_every_one_503() -> None:
    async with serving(max_connections=1, probe_connections=0) as (_, address):
        url = f"{address.ws_url}?dialect=prototype"
        with trio.fail_after(20):
            async with connect_checked(url):
                assert status_of(await exchange_raw(address, get("/healthz"))) == 503


async def test_connections_past_the_cap_are_turned_away_at_once_and_others_go_on() -> None:
    async with serving(max_connections=2) as (server, address):
        url = f"{address.ws_url}?dialect=prototype"
        with trio.fail_after(20):
            async with connect_checked(url) as second:
                async with connect_checked(url) as first:
                    with pytest.raises(ConnectionRejected) as rejected:
                        async with connect_checked(url):
                            pass
                    assert rejected.value.status_code == 503
                    error = orjson.loads(rejected.value.body or b"")["error"]
                    assert error["code"] == "server_busy"
                    assert "limit of 2 open connections" in error["message"]
                    assert "retry later" in error["message"]
                    # plain HTTP too, answered 503 when no probe's head came: here none does
                    stream = await trio.open_tcp_stream(address.host, address.port)
                    async with stream:
                        received = b""
                        while chunk := await stream.receive_some():
                            received += chunk
                    head, _, body = received.partition(b"\r\n\r\n")
                    assert status_of(received) == 503 and b"connection: close" in head.lower()
                    assert orjson.loads(body)["error"]["code"] == "server_busy"
                    assert server.open_connections == 2
                    await full_rollout(first)  # those under the cap do not notice
                await trio.testing.wait_all_tasks_blocked(0.05)  # the server saw it go
                assert server.open_connections == 1
                async with connect_checked(url) as third:  # room again
                    await full_rollout(third)
                await full_rollout(second)
        await server.wait_idle()
