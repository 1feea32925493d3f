"""Server-Sent Events: a Response's events as HTTP chunks, `event: TYPE` and `data: JSON`."""

from __future__ import annotations

from typing import ClassVar

import attrs
import h11
import trio

from proto_server.wire.events import ServerEvent


@attrs.define
class SSETransport:
    """Events as Server-Sent Events (`event: TYPE`, `data: JSON`), each in its own h11 chunk;
    `/metrics` counts each event's block."""

    stream: trio.abc.Stream
    conn: h11.Connection
    chunks: list[bytes] = attrs.Factory(list)
    name: ClassVar[str] = "sse"

    def add(self, event: ServerEvent, payload: bytes) -> int:
        block = b"event: %s\ndata: %s\n\n" % (event.type.encode(), payload)
        self.chunks.append(self.conn.send(h11.Data(data=block)) or b"")
        return len(block)

    async def flush(self) -> None:
        data = b"".join(self.chunks)
        self.chunks.clear()
        await self.stream.send_all(data)
