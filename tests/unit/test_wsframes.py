"""`server/transport/wsframes.py`: several messages in one write, through trio-websocket's
own wsproto.

It is the one module that reaches into trio-websocket's private attributes; these tests fail
loudly if the pinned trio-websocket no longer has them (the writer would fall back to a write
per message, correct but slow)."""

from __future__ import annotations

import contextlib

import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)
from wsproto.connection import Connection, ConnectionType
from wsproto.events import TextMessage

from proto_server.server.transport.wsframes import batched, send_messages, text_frame


async def _pair(
    nursery: trio.Nursery, messages: list[str]
) -> tuple[WebSocketConnection, trio.Event]:
    """A server that sends `messages` with one `send_messages`; returns its connection."""
    sent = trio.Event()
    box: list[WebSocketConnection] = []

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        assert batched(ws)
        box.append(ws)
        await send_messages(ws, [m.encode() for m in messages], compressed=False)
        sent.set()
        await ws.get_message()  # until the client goes

    server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
    return server, sent


async def test_the_pinned_trio_websocket_allows_batched_writes() -> None:
    messages = ['{"n":0}', "é" * 3, "x" * 70_000, '{"n":3}']  # a long one: 64-bit length
    with trio.fail_after(10):  # waits: the handshake and the four messages
        async with trio.open_nursery() as nursery:
            server, sent = await _pair(nursery, messages)
            port = server.port
            async with open_websocket_url(f"ws://127.0.0.1:{port}/") as client:
                got = [await client.get_message() for _ in messages]
                await sent.wait()
            nursery.cancel_scope.cancel()
    assert got == messages


async def test_a_write_to_a_closed_connection_raises_connection_closed() -> None:
    outcome: list[BaseException | None] = []
    answered = trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        assert batched(ws)
        with contextlib.suppress(ConnectionClosed):
            await ws.get_message()  # the client closes: trio-websocket's reader sees it
        try:
            await send_messages(ws, [b"a", b"b"], compressed=False)
            outcome.append(None)
        except ConnectionClosed as exc:
            outcome.append(exc)
        answered.set()

    with trio.fail_after(10):  # waits: the handshake, the close and the handler's answer
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            async with open_websocket_url(f"ws://127.0.0.1:{server.port}/"):
                pass
            await answered.wait()
            nursery.cancel_scope.cancel()
    assert isinstance(outcome[0], ConnectionClosed)


def test_a_text_frame_is_what_wsproto_makes() -> None:
    """Every length encoding (7-bit, 16-bit, 64-bit), byte for byte."""
    wsproto = Connection(ConnectionType.SERVER)
    for size in (0, 1, 125, 126, 127, 65535, 65536, 70_000):
        text = "é" * (size // 2) + "x" * (size % 2)
        assert text_frame(text.encode()) == wsproto.send(TextMessage(data=text))
