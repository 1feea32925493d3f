"""Writing framed events with few copies of a large payload.

A framed event is pieces: a short header, the encoded payload, a short trailer. Joined, a 15 MB
payload is copied on the event loop at each join (25 ms for an SSE block, as long again for its
HTTP chunk). Kept as pieces, short runs are joined into one write and a large payload is
written as the object it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from proto_server.server.transport.sendtimeout import SendTimeout

#: A piece of at least this many bytes is written as it is, not copied into a joined write.
WHOLE_PIECE_BYTES = 64 * 1024


async def send_pieces(stream: trio.abc.SendStream, pieces: Sequence[bytes]) -> None:
    """Write `pieces`, in order: a run of short ones joined into one write, a long one alone. A
    `SendTimeout` carries all that was left unsent, of this write and the ones after it."""
    writes: list[bytes] = []
    run: list[bytes] = []
    for piece in pieces:
        if len(piece) < WHOLE_PIECE_BYTES:
            run.append(piece)
            continue
        if run:
            writes.append(b"".join(run))
            run = []
        writes.append(piece)
    if run:
        writes.append(b"".join(run))
    for done, data in enumerate(writes, 1):
        try:
            await stream.send_all(data)
        except SendTimeout as stall:
            stall.unsent += b"".join(writes[done:])
            raise
