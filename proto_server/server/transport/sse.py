"""Server-Sent Events: a Response's events as HTTP chunks, `event: TYPE` and `data: JSON`."""

from __future__ import annotations

from typing import ClassVar

import attrs
import h11
import trio

from proto_server.server.transport.pieces import WHOLE_PIECE_BYTES, send_pieces
from proto_server.wire.events import ServerEvent


@attrs.define
class SSETransport:
    """Events as Server-Sent Events (`event: TYPE`, `data: JSON`), each in its own h11 chunk (a
    large one in three: its head, its JSON and its end, so the JSON is never copied; SSE does
    not see chunks); `/metrics` counts each event's block."""

    stream: trio.abc.Stream
    conn: h11.Connection
    pieces: list[bytes] = attrs.Factory(list)
    name: ClassVar[str] = "sse"

    def add(self, event: ServerEvent, payload: bytes) -> int:
        head = b"event: %s\ndata: " % event.type.encode()
        small = len(payload) < WHOLE_PIECE_BYTES
        for part in [head + payload + b"\n\n"] if small else [head, payload, b"\n\n"]:
            self.pieces += self.conn.send_with_data_passthrough(h11.Data(data=part)) or ()
        return len(head) + len(payload) + 2

    async def flush(self) -> None:
        pieces, self.pieces = self.pieces, []
        await send_pieces(self.stream, pieces)
