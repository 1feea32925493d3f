"""What the upgrade says and takes: Codex 0.171's beta value, the announced frame limit, and
permessage-deflate when the server allows it and the client offers it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import orjson
import pytest
import trio
from proto_server_bench.transports import CountingStream, open_websocket
from trio_websocket import ConnectionClosed, ConnectionRejected, WebSocketConnection

from proto_server.server.dialects.registry import LAUNCHED_BETA, PROTOTYPE_BETA
from proto_server.server.listener.app import MAX_MESSAGE_BYTES_HEADER

from ..support.clients import connect, types
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.servers import Running, StartServer

LONG_TEXT = {"segments": [{"text": "the same words again " * 400}]}


def headers(ws: WebSocketConnection) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in ws.handshake_headers}


@asynccontextmanager
async def client(
    running: Running, *, deflate: bool, resource: str = "/v1/responses"
) -> AsyncIterator[tuple[WebSocketConnection, CountingStream]]:
    """A WebSocket that offers permessage-deflate (as Codex 0.171 does) or not, counting bytes."""
    address = running.address
    async with trio.open_nursery() as nursery:
        stream = CountingStream(await trio.open_tcp_stream(address.host, address.port))
        ws = await open_websocket(nursery, stream, address.host, resource, deflate=deflate)
        yield ws, stream
        with trio.move_on_after(2):
            await ws.aclose()
        nursery.cancel_scope.cancel()


async def rollout(ws: WebSocketConnection) -> list[dict[str, Any]]:
    frame = {"type": "response.create", "model": "m", "input": "go", "tools": [EXEC_COMMAND]}
    await ws.send_message(orjson.dumps(frame).decode())
    events = []
    while not events or events[-1]["type"] != "response.completed":
        events.append(orjson.loads(await ws.get_message()))
    return events


@pytest.mark.parametrize(
    ("beta", "dialect"),
    [
        (LAUNCHED_BETA, "launched"),  # Codex 0.171
        (PROTOTYPE_BETA, "prototype"),  # Codex 0.100-0.107
        (f"{LAUNCHED_BETA}, {PROTOTYPE_BETA}", "prototype"),  # an explicit opt-in wins
        ("responses_websockets=2099-01-01", "launched"),
    ],
)
async def test_codex_0171_beta_value_is_the_launched_dialect(
    start_server: StartServer, beta: str, dialect: str
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(20):
        async with connect(running.address.ws_url, **{"OpenAI-Beta": beta}) as ws:
            frame = {"type": "response.create", "input": "go", "tools": [EXEC_COMMAND]}
            await ws.send(frame)
            ends = "response.done" if dialect == "prototype" else "response.completed"
            events = await ws.until(ends)
            assert types(events)[-1] == ends.removeprefix("response.")


@pytest.mark.parametrize("limit", [16 * 1024 * 1024, 4096])
async def test_the_upgrade_announces_the_largest_frame_the_server_takes(
    start_server: StartServer, limit: int
) -> None:
    running = await start_server(THREE_SEGMENTS, max_message_bytes=limit)
    with trio.fail_after(20):
        async with client(running, deflate=False) as (ws, _):
            assert headers(ws)[MAX_MESSAGE_BYTES_HEADER] == str(limit).encode()
            if limit > 4096:
                return
            # what it announces is what it enforces: one byte more is refused with 1009
            frame = {"type": "response.create", "model": "m", "input": "x" * limit}
            await ws.send_message(orjson.dumps(frame).decode())
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009


@pytest.mark.parametrize(("allowed", "offered"), [(True, True), (True, False), (False, True)])
async def test_permessage_deflate_is_used_when_allowed_and_offered(
    start_server: StartServer, caplog: pytest.LogCaptureFixture, allowed: bool, offered: bool
) -> None:
    caplog.set_level(logging.INFO, logger="proto_server")
    running = await start_server(LONG_TEXT, permessage_deflate=allowed)
    with trio.fail_after(20):
        async with client(running, deflate=offered) as (ws, stream):
            (opened,) = [r for r in caplog.records if r.getMessage() == "connection.opened"]
            assert opened.deflate == (allowed and offered)  # type: ignore[attr-defined]
            events = await rollout(ws)
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == LONG_TEXT["segments"][0]["text"]
            sent = sum(len(orjson.dumps(e)) for e in events)
            if allowed and offered:  # the repetitive text and Response objects shrink a lot
                assert stream.received < sent / 4
            else:
                assert stream.received > sent


async def test_a_compressed_frame_is_limited_by_its_inflated_size(
    start_server: StartServer,
) -> None:
    """A few KB on the wire that inflate past `--max-message-bytes` close with 1009, and the
    server goes on serving others: compression does not get a frame around the limit."""
    running = await start_server(THREE_SEGMENTS, permessage_deflate=True, max_message_bytes=65536)
    with trio.fail_after(20):
        async with client(running, deflate=True) as (ws, stream):
            bomb = {"type": "response.create", "model": "m", "input": "a" * 4 * 1024 * 1024}
            await ws.send_message(orjson.dumps(bomb).decode())
            assert stream.sent < 64 * 1024  # it left this client small
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009
        async with client(running, deflate=True) as (ws, _):
            assert (await rollout(ws))[-1]["response"]["status"] == "completed"


async def _get_kept_alive(stream: trio.abc.Stream, host: str, target: str) -> h11.Response:
    """One HTTP/1.1 GET answered on `stream`, which stays open for what comes next."""
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=target, headers=[("host", host)])
    await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
    response = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some())
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            assert (b"connection", b"close") not in response.headers
            return response


@pytest.mark.parametrize("first", ["/healthz", "/v1/models"])
async def test_an_upgrade_on_a_connection_that_already_served_http_is_a_websocket(
    start_server: StartServer, first: str
) -> None:
    # what Node 22's built-in WebSocket (undici) does with a pooled connection: the SDKs that
    # need Node 22 send their WebSocket upgrade after an HTTP call on the same socket
    running = await start_server(THREE_SEGMENTS)
    address = running.address
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            stream = await trio.open_tcp_stream(address.host, address.port)
            assert (await _get_kept_alive(stream, address.host, first)).status_code == 200
            assert (await _get_kept_alive(stream, address.host, "/healthz")).status_code == 200
            ws = await open_websocket(nursery, stream, address.host, "/v1/responses")
            events = await rollout(ws)
            assert events[-1]["response"]["status"] == "completed"
            await ws.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("how", "name"),
    [("query", "prototype"), ("header", "Prototype"), ("query", "launched"), ("header", "nope")],
)
async def test_a_dialect_is_picked_by_its_registered_name_and_an_unknown_one_is_refused(
    start_server: StartServer, how: str, name: str
) -> None:
    running = await start_server(THREE_SEGMENTS)
    url, headers = running.address.ws_url, {}
    if how == "query":
        url += f"?dialect={name}"
    else:
        headers["X-Proto-Dialect"] = name
    with trio.fail_after(20):
        if name == "nope":
            with pytest.raises(ConnectionRejected) as refused:
                async with connect(url, **headers):
                    pass
            assert refused.value.status_code == 400
            assert b"launched, prototype" in (refused.value.body or b"")
            return
        async with connect(url, **headers) as ws:
            await ws.send({"type": "response.create", "input": "go", "tools": [EXEC_COMMAND]})
            ends = "response.done" if name.lower() == "prototype" else "response.completed"
            assert types(await ws.until(ends))[-1] == ends.removeprefix("response.")
