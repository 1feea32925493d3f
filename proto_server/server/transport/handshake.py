"""The first bytes of a connection: read the request head once, then hand the stream on.

One port serves plain HTTP and WebSocket. We read the head with h11 to see which it is; an
upgrade goes to trio-websocket over a stream that first replays the bytes we already read.
"""

from __future__ import annotations

import attrs
import h11
import trio
from trio_websocket import WebSocketConnection, WebSocketRequest
from wsproto.events import AcceptConnection
from wsproto.extensions import PerMessageDeflate

from proto_server.wire.errors import ProtocolError


class ReplayStream(trio.abc.Stream):
    """A stream that yields `already_read` before reading on from `stream`."""

    def __init__(self, stream: trio.abc.Stream, already_read: bytes) -> None:
        self._stream = stream
        self._buffer = already_read

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._buffer:
            size = len(self._buffer) if max_bytes is None else max_bytes
            data, self._buffer = self._buffer[:size], self._buffer[size:]
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self._stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


@attrs.frozen
class RequestHead:
    request: h11.Request
    raw: bytes  # every byte read so far, head and anything after it
    connection: h11.Connection  # for plain HTTP, already past the head

    @property
    def target(self) -> str:
        return self.request.target.decode("latin-1")

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header(self, name: bytes) -> str | None:
        for key, value in self.request.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    @property
    def is_websocket(self) -> bool:
        upgrade = self.header(b"upgrade") or ""
        return upgrade.lower() == "websocket"


class BadRequestHead(Exception):
    pass


async def read_request_head(stream: trio.abc.Stream, *, max_bytes: int) -> RequestHead | None:
    """The request head, or None if the peer closed first; `BadRequestHead` if it is not HTTP."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
    raw = bytearray()
    while True:
        try:
            event = connection.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadRequestHead(str(exc)) from None
        if isinstance(event, h11.Request):
            # h11 bounds a head only while it is incomplete: one that arrives whole is measured
            head_bytes = len(raw) - len(connection.trailing_data[0])
            if head_bytes > max_bytes:
                raise BadRequestHead(
                    f"the request head is {head_bytes} bytes, over the limit of {max_bytes}; "
                    "send fewer or shorter headers"
                )
            return RequestHead(event, bytes(raw), connection)
        if event is h11.NEED_DATA:
            data = bytes(await stream.receive_some())
            if not data:
                return None
            raw += data
            connection.receive_data(data)
            continue
        raise BadRequestHead(f"unexpected {type(event).__name__} before a request")


def later_head(request: h11.Request, connection: h11.Connection) -> RequestHead:
    """A later request of a kept-alive connection, as if it had been the connection's first:
    clients that pool connections (Node's built-in `WebSocket`, undici) send an upgrade on one
    that has already served HTTP. h11 keeps no bytes of a head it parsed, so they are written
    again from what it read (the headers as they were spelled), with what followed them."""
    lines = [b"%s %s HTTP/%s" % (request.method, request.target, request.http_version)]
    lines += [name + b": " + value for name, value in request.headers.raw_items()]
    raw = b"\r\n".join(lines) + b"\r\n\r\n" + connection.trailing_data[0]
    return RequestHead(request, raw, connection)


def upgrade_refusal(head: RequestHead) -> ProtocolError | None:
    """What is wrong with a WebSocket upgrade request (RFC 6455, 4.2.1), or None if nothing.

    Checked before trio-websocket sees the request, so a bad upgrade gets a refusal that says
    what to fix, and its connection is closed rather than left waiting.
    """
    request = head.request

    def refuse(what: str, status: int = 400) -> ProtocolError:
        return ProtocolError("bad_request", f"Bad WebSocket upgrade: {what}.", status=status)

    if request.method != b"GET" or request.http_version != b"1.1":
        method, version = request.method.decode(), request.http_version.decode()
        return refuse(f"it must be GET over HTTP/1.1, not {method} over HTTP/{version}")
    tokens = {t.strip().lower() for t in (head.header(b"connection") or "").split(",")}
    if "upgrade" not in tokens:
        return refuse("send the header `Connection: Upgrade`")
    if not (head.header(b"sec-websocket-key") or "").strip():
        return refuse("send a `Sec-WebSocket-Key` header (16 random bytes, base64)")
    if (head.header(b"sec-websocket-version") or "").strip() != "13":
        return refuse("this server speaks `Sec-WebSocket-Version: 13` only", status=426)
    return None


async def accept_upgrade(
    request: WebSocketRequest,
    *,
    extra_headers: list[tuple[bytes, bytes]],
    deflate: bool,
) -> tuple[WebSocketConnection, bool]:
    """Accept a WebSocket upgrade, with permessage-deflate (RFC 7692) if `deflate` and the
    client offers it (wsproto negotiates it; a client that does not offer it gets none).
    Returns the connection and whether its frames are compressed.

    trio-websocket 0.12 takes no extensions on accept, so with `deflate` this does what its
    `WebSocketRequest.accept` does, with wsproto's `PerMessageDeflate` added to the answer.
    """
    if not deflate:
        return await request.accept(extra_headers=extra_headers), False
    extension = PerMessageDeflate()
    connection = request._connection
    connection._subprotocol = None
    connection._path = request._event.target
    await connection._send(AcceptConnection(extra_headers=extra_headers, extensions=[extension]))
    connection._open_handshake.set()
    return connection, extension.enabled()
