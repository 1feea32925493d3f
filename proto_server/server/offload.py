"""Work that grows with what a client sent runs off the event loop.

Decoding a large frame and rendering (tokenizing) a large input take time in proportion to their
size: seconds for a 16 MiB request. Done in the event loop, that would stall every other client.
Above `INLINE_BYTES` such work runs on a worker thread, a few at a time (`--prepare-threads`),
while the loop goes on serving; tiktoken releases the GIL while it encodes. Small inputs, the
common case, stay inline: a thread hop costs more than the work.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

#: Inputs up to this size are prepared in the event loop (well under a millisecond of work).
INLINE_BYTES = 64 * 1024

T = TypeVar("T")


class Offload:
    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"preparation needs at least one worker thread, got {threads}")
        self._limiter = trio.CapacityLimiter(threads)

    async def run(self, fn: Callable[..., T], *args: object, size: int) -> T:
        """`fn(*args)`, on a worker thread if `size` (bytes of input) is over `INLINE_BYTES`.

        A cancelled caller returns at once (a stopping server does not wait for it); the thread
        finishes on its own and only then frees its place."""
        if size <= INLINE_BYTES:
            return fn(*args)
        return await trio.to_thread.run_sync(
            _without_cyclic_gc, fn, *args, limiter=self._limiter, abandon_on_cancel=True
        )


_paused = 0
_paused_lock = threading.Lock()


def _without_cyclic_gc(fn: Callable[..., T], *args: object) -> T:
    """Run `fn` with the cyclic garbage collector paused (reference counting goes on).

    Decoding a large request allocates a million objects, none in a cycle. Meanwhile the
    collector would scan the whole heap again each time it grew by a quarter, holding the GIL
    for 100-300 ms a time: a stall for every client that a thread cannot hide.
    """
    global _paused
    with _paused_lock:
        _paused += 1
        gc.disable()
    try:
        return fn(*args)
    finally:
        with _paused_lock:
            _paused -= 1
            if not _paused:
                gc.enable()
