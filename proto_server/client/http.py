"""The HTTP side of the client: `POST /v1/responses` with `stream: true`, read as SSE.

One keep-alive HTTP/1.1 connection (h11 over a trio stream), reopened when the server closes it.
A non-2xx answer becomes the same `error` event the WebSocket would have sent.
"""

from __future__ import annotations

import select
from collections.abc import Iterator, Mapping
from typing import Any

import h11
import orjson
import trio

from proto_server.wire.converter import converter, decode_server_event
from proto_server.wire.events import ErrorEvent, ServerEvent

MAX_BODY_BYTES = 64 * 1024 * 1024


class StreamEnded(Exception):
    """The server closed the stream before the segment ended."""


class SseParser:
    """Server-Sent Events from bytes: each block's `data:` lines joined, and its size in bytes."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[tuple[str, int]]:
        self._buffer += data.replace(b"\r\n", b"\n")
        while (end := self._buffer.find(b"\n\n")) >= 0:
            block, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            lines = block.decode().split("\n")
            payload = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
            if payload:
                yield "\n".join(payload), len(block) + 2


class HttpWire:
    def __init__(self, host: str, port: int, path: str, headers: Mapping[str, str]) -> None:
        self._host = host
        self._port = port
        self._path = path
        self._headers = [(name, value) for name, value in headers.items()]
        self._stream: trio.SocketStream | None = None
        self._http = h11.Connection(h11.CLIENT)
        self._parser = SseParser()
        self._ready: list[tuple[int | None, ServerEvent, int]] = []

    async def send(self, body: Mapping[str, Any]) -> int:
        """POST one request; its events are then read with `receive`. Returns the bytes sent."""
        await self._next_cycle()
        data = orjson.dumps(body)
        request = h11.Request(
            method="POST",
            target=self._path,
            headers=[
                ("host", f"{self._host}:{self._port}"),
                ("content-type", "application/json"),
                ("accept", "text/event-stream"),
                ("content-length", str(len(data))),
                *self._headers,
            ],
        )
        out = b"".join(
            self._http.send(event) or b"" for event in (request, h11.Data(data=data))
        ) + (self._http.send(h11.EndOfMessage()) or b"")
        assert self._stream is not None
        await self._stream.send_all(out)
        self._parser = SseParser()
        return len(out)

    async def receive(self) -> tuple[int | None, ServerEvent, int]:
        while not self._ready:
            event = await self._next_event()
            if isinstance(event, h11.Response) and event.status_code != 200:
                self._ready.append(await self._refusal(event.status_code))
            elif isinstance(event, h11.Data):
                for payload, size in self._parser.feed(bytes(event.data)):
                    sequence_number, server_event = decode_server_event(payload)
                    self._ready.append((sequence_number, server_event, size))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                raise StreamEnded(
                    "the server ended the HTTP response before the segment ended; check the "
                    "server's log, and retry the request."
                )
        return self._ready.pop(0)

    async def _refusal(self, status: int) -> tuple[None, ServerEvent, int]:
        body = b""
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise StreamEnded(f"an error body over {MAX_BODY_BYTES} bytes")
        try:
            error = orjson.loads(body)["error"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = body.decode(errors="replace")
            error = {"type": "invalid_request_error", "code": "http_error", "message": message}
        refused = converter.structure({"status": status, "error": error}, ErrorEvent)
        return None, refused, len(body)

    async def _next_event(self) -> h11.Event:
        while True:
            event = self._http.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            assert self._stream is not None
            self._http.receive_data(await self._stream.receive_some(65536))

    async def _next_cycle(self) -> None:
        """Finish reading the previous exchange; reuse the connection if the server keeps it."""
        if self._stream is not None:
            http = self._http
            if http.our_state is h11.IDLE:
                return  # a fresh connection
            while http.their_state is h11.SEND_BODY:
                if isinstance(await self._next_event(), h11.ConnectionClosed):
                    break
            if (http.our_state, http.their_state) == (h11.DONE, h11.DONE) and not _readable(
                self._stream
            ):
                http.start_next_cycle()
                return
            await self.aclose()  # not reusable, or closed by the server while it was idle
        self._stream = await trio.open_tcp_stream(self._host, self._port)
        self._http = h11.Connection(h11.CLIENT)

    async def abort(self) -> None:
        """Stop reading the current stream: close the connection (the next send reopens one)."""
        await self.aclose()
        self._ready.clear()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None


def _readable(stream: trio.SocketStream) -> bool:
    """Whether an idle kept-alive connection has something to read: the server closed it (its
    idle timeout) or broke the protocol. A request sent on it would meet the close instead of
    an answer, so it is not reused (as httpcore checks its pool's connections)."""
    poll = select.poll()  # not select(): it refuses a descriptor past 1023
    poll.register(stream.socket.fileno(), select.POLLIN)
    return bool(poll.poll(0))
