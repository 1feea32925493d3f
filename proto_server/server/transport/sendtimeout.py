"""`--send-timeout`: a client that accepts no bytes for that long while the server has some for
it is let go, as nginx's `send_timeout`.

Every connection's socket is wrapped once (app.py), so every write on it is watched: a
WebSocket's frames and trio-websocket's own pongs and close frames, an SSE stream, a JSON body.
The clock is not on the whole write but on its progress: it restarts each time the kernel takes
some of the bytes, and each time the peer acknowledges some of those already queued (Linux's
SIOCOUTQ: a reader that drains slowly frees less than a wake-up's worth of the send buffer at a
time, and is still reading). So a client reading slowly but steadily is never cut; one that
stopped is cut at most a quarter of the timeout past it. What is left unsent goes with the
error, so the writer can still finish its frame and say why before it closes.
"""

from __future__ import annotations

import errno
import fcntl
import struct
import termios

import trio

#: How often a blocked write asks the kernel whether the peer took any of what is queued.
_CHECKS_PER_TIMEOUT = 4


#: `incomplete_details.reason` of the Responses of a client cut for `--send-timeout`.
SLOW_READER = "slow_reader"


class SendTimeout(trio.BrokenResourceError):
    """The peer accepted no bytes for `timeout_s`; `unsent` is what this write had left."""

    def __init__(self, timeout_s: float, unsent: bytes) -> None:
        super().__init__(f"the client accepted no bytes for {timeout_s:g} s")
        self.timeout_s = timeout_s
        self.unsent = unsent


def _queued(sock: trio.socket.SocketType) -> int | None:
    """Bytes the kernel still holds for the peer (sent but not acknowledged, or not sent yet);
    None where it cannot say (not Linux, not TCP)."""
    try:
        answer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    queued: int = struct.unpack("i", answer)[0]
    return queued


class SendTimeoutStream(trio.abc.HalfCloseableStream):
    """`stream`, whose writes raise `SendTimeout` once the peer takes nothing for `timeout_s`."""

    def __init__(self, stream: trio.abc.HalfCloseableStream, timeout_s: float) -> None:
        self.stream = stream
        self.timeout_s = timeout_s
        #: None for a stream with no socket of its own (a test's wrapper): written unwatched.
        self._socket: trio.socket.SocketType | None = getattr(stream, "socket", None)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        sock = self._socket
        if sock is None:
            await self.stream.send_all(data)
            return
        with memoryview(data) as view:
            if not view:
                await trio.lowlevel.checkpoint()
                return
            sent = 0
            last_progress = trio.current_time()
            queued = None
            while sent < len(view):
                with trio.move_on_after(self.timeout_s / _CHECKS_PER_TIMEOUT) as waiting:
                    try:
                        sent += await sock.send(view[sent:])
                    except OSError as exc:
                        if exc.errno == errno.EBADF:
                            raise trio.ClosedResourceError("this socket was closed") from None
                        raise trio.BrokenResourceError(f"the socket broke: {exc}") from exc
                    last_progress, queued = trio.current_time(), None
                if not waiting.cancelled_caught:
                    continue
                now_queued = _queued(sock)
                if now_queued is not None and (queued is None or now_queued < queued):
                    if queued is not None:
                        last_progress = trio.current_time()  # the peer took some
                    queued = now_queued
                if trio.current_time() - last_progress >= self.timeout_s:
                    raise SendTimeout(self.timeout_s, bytes(view[sent:]))

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return bytes(await self.stream.receive_some(max_bytes))

    async def aclose(self) -> None:
        await self.stream.aclose()
