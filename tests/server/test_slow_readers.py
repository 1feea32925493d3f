"""`--send-timeout`: a client that stops reading while a long answer streams is let go, its
Response ended `incomplete` (`slow_reader`) and its rollout released; one that reads slowly but
steadily is not. The clients are raw sockets speaking WebSocket through wsproto, so what the
server sees is a kernel buffer that fills; time runs on trio's autojump clock."""

from __future__ import annotations

import socket
from typing import Any

import orjson
import pytest
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from proto_server.server.process import metrics

from ..support.servers import Running, StartServer
from ..support.stores import CheckpointStore

TIMEOUT_S = 30.0
#: Far more than the kernel buffers of both ends hold, so a client that stops reading stalls it.
LONG = {"segments": [{"text": "word " * 300_000}]}


class RawClient:
    """A WebSocket client on a raw socket with a small receive buffer: it reads only when told."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.messages: list[dict[str, Any]] = []
        self.closed: CloseConnection | None = None
        self.eof = False
        self._text = ""

    @classmethod
    async def connect(cls, running: Running) -> RawClient:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        await sock.connect((running.address.host, running.address.port))
        client = cls(trio.SocketStream(sock))
        await client.stream.send_all(client.ws.send(Request(host="x", target="/v1/responses")))
        while not any(isinstance(event, AcceptConnection) for event in await client.read()):
            pass
        return client

    async def send(self, body: dict[str, Any]) -> None:
        await self.stream.send_all(self.ws.send(TextMessage(data=orjson.dumps(body).decode())))

    async def read(self, max_bytes: int = 65536) -> list[Any]:
        """One read of the socket; the events it completes."""
        data = await self.stream.receive_some(max_bytes)
        if not data:
            self.eof = True
        self.ws.receive_data(data or None)
        events = list(self.ws.events())
        for event in events:
            if isinstance(event, TextMessage):
                self._text += event.data
                if event.message_finished:
                    self.messages.append(orjson.loads(self._text))
                    self._text = ""
            elif isinstance(event, CloseConnection) and self.closed is None:
                self.closed = event  # the close frame (the end of the socket says 1006 after it)
        return events

    def types(self) -> list[str]:
        return [message["type"] for message in self.messages]


async def until_stored(store: CheckpointStore) -> None:
    """The client reads no more: the kernel buffers fill and the server's writes stall, until
    the server ends its Response and stores it (polled: the client must not read meanwhile)."""
    for _ in range(int(10 * TIMEOUT_S / 0.1)):
        if store.responses:
            return
        await trio.sleep(0.1)


def stored_reason(store: CheckpointStore) -> list[tuple[str, Any]]:
    return [
        (stored.response.status, stored.response.incomplete_details)
        for stored in store.responses.values()
    ]


async def test_a_client_that_stops_reading_is_cut_and_its_response_ends_incomplete(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    store = CheckpointStore()
    running = await start_server(LONG, store=store, send_timeout_s=TIMEOUT_S)
    cut_before = metrics.SEND_TIMEOUTS.labels("websocket")._value.get()
    client = await RawClient.connect(running)
    async with client.stream:
        await client.send({"type": "response.create", "model": "m", "input": "hi"})
        while "response.created" not in client.types():
            await client.read()
        stopped = trio.current_time()
        await until_stored(store)
        assert trio.current_time() - stopped >= TIMEOUT_S  # not before the timeout
        assert stored_reason(store) == [("incomplete", {"reason": "slow_reader"})]
        assert running.server.open_rollouts == 0  # released at once
        # reading again at once (real I/O waits do not jump the clock meanwhile), it gets the
        # rest of the frame it was cut in and the close frame
        autojump_clock.autojump_threshold = 1.0
        while not client.eof:
            await client.read()
    assert client.closed is not None and client.closed.code == 1008
    assert "--send-timeout" in client.closed.reason
    assert metrics.SEND_TIMEOUTS.labels("websocket")._value.get() == cut_before + 1
    await running.server.wait_idle()


@pytest.mark.slow
async def test_a_client_that_reads_slowly_but_steadily_is_not_cut(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    store = CheckpointStore()
    running = await start_server(LONG, store=store, send_timeout_s=TIMEOUT_S)
    # the clock jumps only once the sockets are still for a moment of real time: the kernel
    # moves what a read freed in its own time, and a jump before it would look like a stall
    autojump_clock.autojump_threshold = 0.01
    client = await RawClient.connect(running)
    async with client.stream:
        await client.send({"type": "response.create", "model": "m", "input": "hi"})
        started = trio.current_time()
        while "response.completed" not in client.types():
            assert not client.eof, client.types()[-1]
            await client.read(16 * 1024)
            await trio.sleep(TIMEOUT_S / 3)  # a third of the timeout between reads
        took = trio.current_time() - started
    assert took > 3 * TIMEOUT_S  # it streamed for longer than the timeout, several times over
    assert stored_reason(store) == [("completed", None)]
    text = "".join(m["delta"] for m in client.messages if m["type"] == "response.output_text.delta")
    assert text == LONG["segments"][0]["text"]  # type: ignore[index]
    await running.server.wait_idle()


async def test_an_sse_client_that_stops_reading_is_cut_and_its_response_ends_incomplete(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    store = CheckpointStore()
    running = await start_server(LONG, store=store, send_timeout_s=TIMEOUT_S)
    cut_before = metrics.SEND_TIMEOUTS.labels("http")._value.get()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    await sock.connect((running.address.host, running.address.port))
    body = orjson.dumps({"model": "m", "input": "hi", "stream": True})
    head = (
        b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    async with trio.SocketStream(sock) as stream:
        await stream.send_all(head + body)
        received = b""
        while b"response.created" not in received:
            received += await stream.receive_some(4096)
        await until_stored(store)
        assert stored_reason(store) == [("incomplete", {"reason": "slow_reader"})]
        assert running.server.open_rollouts == 0
        autojump_clock.autojump_threshold = 1.0
        while await stream.receive_some(65536):  # the server closed the connection
            pass
    assert metrics.SEND_TIMEOUTS.labels("http")._value.get() == cut_before + 1
    await running.server.wait_idle()
