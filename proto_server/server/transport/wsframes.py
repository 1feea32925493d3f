"""Several WebSocket messages in one socket write: the one module that reaches into trio-websocket.

trio-websocket (0.12) sends one message per `send_message`: it frames it with the connection's
wsproto and awaits one `send_all` for it. The writer drains every event that is ready, so it
frames them all at once and writes the bytes with one `send_all`, under the lock trio-websocket's
own reader takes to write pongs and close frames; a write that fails aborts the connection as
trio-websocket's own `_send` does.

Framing: a text message without extensions is a 2-10 byte header and the payload as it is
(RFC 6455 section 5.2; a server's frames are not masked), built here from the encoded bytes, as
wsproto would; wsproto keeps no state across whole messages, so that is safe while its
connection is open. With permessage-deflate the connection's wsproto frames each message (its
compressor's state must see every message, in order).

There is no public API for this, so the private attributes it needs are named here and nowhere
else; `batched(ws)` is False when a trio-websocket release lacks them, and the writer then sends
message by message (`tests/unit/test_wsframes.py` fails loudly if that happens with the version this
project pins).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, TextMessage

from proto_server.server.transport.pieces import WHOLE_PIECE_BYTES, send_pieces
from proto_server.server.transport.sendtimeout import SendTimeout

_NEEDED = (
    "_wsproto", "_stream", "_stream_lock", "_close_reason", "_abort_web_socket",
    "_close_web_socket", "_close_stream", "_close_handshake",
)  # fmt: skip
_TEXT_FIN = 0x81  # FIN, opcode 1 (text)
_SHORT = struct.Struct("!BB")
_MEDIUM = struct.Struct("!BBH")
_LONG = struct.Struct("!BBQ")


def batched(ws: WebSocketConnection) -> bool:
    """Whether `send_messages` can write several messages at once on this connection."""
    return all(hasattr(ws, name) for name in _NEEDED)


def text_frame(payload: bytes) -> bytes:
    """One unfragmented, unmasked text frame carrying `payload` (UTF-8), as a server sends it."""
    return frame_header(len(payload)) + payload


def frame_header(size: int) -> bytes:
    """The header of an unfragmented, unmasked text frame of `size` bytes."""
    if size < 126:
        return _SHORT.pack(_TEXT_FIN, size)
    if size < 65536:
        return _MEDIUM.pack(_TEXT_FIN, 126, size)
    return _LONG.pack(_TEXT_FIN, 127, size)


class FrameWriter:
    """`add` each message as it is encoded, then `flush` them with one write.

    A message is framed as it is added, so its payload can go at once: orjson's bytes keep a
    4 KiB buffer each however short they are, and a frame is a right-sized copy. `compressed`:
    permessage-deflate was negotiated, so wsproto frames (and compresses) each message."""

    def __init__(self, ws: WebSocketConnection, *, compressed: bool) -> None:
        self._ws = ws
        self._inner: Any = ws  # the private side of trio-websocket's connection
        self._compressed = compressed
        self._batched = batched(ws)
        self._frames: list[bytes] = []
        self._texts: list[str] = []  # without batching: messages for `send_message`

    def add(self, payload: bytes) -> None:
        if not self._batched:
            self._texts.append(payload.decode())
        elif self._inner._close_reason:
            pass  # `flush` raises ConnectionClosed
        elif self._compressed or self._inner._wsproto.state is not ConnectionState.OPEN:
            # wsproto raises as trio-websocket's own send would on a closing connection
            self._frames.append(self._inner._wsproto.send(TextMessage(data=payload.decode())))
        elif len(payload) < WHOLE_PIECE_BYTES:
            self._frames.append(text_frame(payload))
        else:  # written as it is, not copied behind its header (`pieces`)
            self._frames += (frame_header(len(payload)), payload)

    async def flush(self) -> None:
        """Write what was added, in order; `ConnectionClosed` as `ws.send_message` raises it."""
        if not self._batched:
            texts, self._texts = self._texts, []
            for text in texts:
                await self._ws.send_message(text)
            return
        inner = self._inner
        frames, self._frames = self._frames, []
        if inner._close_reason:
            raise ConnectionClosed(inner._close_reason)
        lock: trio.StrictFIFOLock = inner._stream_lock
        try:  # `async with lock` yields to the scheduler even when the lock is free
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await send_pieces(inner._stream, frames)
        except SendTimeout:
            raise  # the socket is still open: the connection ends it, and says why
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await inner._abort_web_socket()
            raise ConnectionClosed(inner._close_reason) from None
        finally:
            lock.release()


async def close_stalled(
    ws: WebSocketConnection, unsent: bytes, *, code: int, reason: str, wait_s: float
) -> None:
    """Close a connection whose client stopped taking bytes: mark it closed with `code` and
    `reason` (what `ws.closed` says), give the client `wait_s` to take the rest of the frame a
    timed-out write left (a frame cut short would garble all after it) and the close frame,
    then close the socket, with or without them."""
    inner: Any = ws
    data = unsent
    if inner._wsproto.state is ConnectionState.OPEN:
        data += inner._wsproto.send(CloseConnection(code=code, reason=reason))
    if inner._close_reason is None:
        await inner._close_web_socket(code, reason)
    with trio.move_on_after(wait_s):
        try:
            async with inner._stream_lock:
                await inner._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await inner._close_stream()
    inner._close_handshake.set()  # whoever awaits `ws.aclose()` is done too


async def send_messages(
    ws: WebSocketConnection, payloads: Sequence[bytes], *, compressed: bool
) -> None:
    """Send `payloads` (UTF-8 JSON) as text messages, in order, with one write."""
    writer = FrameWriter(ws, compressed=compressed)
    for payload in payloads:
        writer.add(payload)
    await writer.flush()
