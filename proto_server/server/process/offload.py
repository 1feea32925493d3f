"""Work that grows with what a client sent runs off the event loop.

Decoding a large frame and rendering (tokenizing) a large input take time in proportion to their
size: seconds for a 16 MiB request. Done in the event loop, that would stall every other client.
Above `INLINE_BYTES` such work runs on a worker thread, a few at a time (`--prepare-threads`),
while the loop goes on serving; tiktoken releases the GIL while it encodes. Small inputs, the
common case, stay inline: a thread hop costs more than the work.
"""

from __future__ import annotations

import gc
import sys
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
            _in_background, fn, *args, limiter=self._limiter, abandon_on_cancel=True
        )


#: Objects made while the collector was paused past which they are frozen out of it (below,
#: the young generation's pass is a few milliseconds).
FREEZE_OBJECTS = 50_000

#: How soon a worker thread holding the GIL must let the event loop have it, while any
#: preparation runs (CPython's default is 5 ms, paid again at every socket call of the loop).
SWITCH_INTERVAL_S = 0.0005

_running = 0
#: A preparation raised while the collector was paused: nothing made meanwhile is frozen.
_failed = False
_running_lock = threading.Lock()
_default_interval = sys.getswitchinterval()


def _in_background(fn: Callable[..., T], *args: object) -> T:
    """Run `fn` on a worker thread so that the event loop hardly notices.

    The cyclic garbage collector is paused meanwhile (reference counting goes on): decoding a
    large request allocates a million objects, none in a cycle, and the collector would scan
    the whole heap each time it grew by a quarter, holding the GIL for 100-300 ms a time. Once
    no preparation runs, the heap's young objects (what they made, past `FREEZE_OBJECTS`, and
    the little else made meanwhile) are frozen out of the collector: its first pass over the
    400,000 objects of a 15 MB request held the GIL 50-130 ms, and each older generation's as
    long again. Frozen objects are still freed by reference counting when their Response lets
    them go; only a cycle among them would be kept, and the server makes next to none (its
    collections find tens of objects). Nothing is frozen when a preparation raised: its
    traceback may hold a cycle. And the GIL changes hands every 0.5 ms
    instead of every 5 ms, so the loop waits that long at most each time it wants it back.
    """
    global _running, _failed
    with _running_lock:
        _running += 1
        gc.disable()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    returned = False
    try:
        result = fn(*args)
        returned = True
        return result
    finally:
        with _running_lock:
            _running -= 1
            _failed = _failed or not returned
            if not _running:
                sys.setswitchinterval(_default_interval)
                # a preparation that raised may have left a cycle (a traceback's frames and
                # what they hold): that is the collector's to free, not to freeze
                if not _failed and gc.get_count()[0] > FREEZE_OBJECTS:
                    gc.freeze()
                _failed = False
                gc.enable()
