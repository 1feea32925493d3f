"""Background Responses (`background: true` on `POST /v1/responses`): run by the process, not
by the connection that created them, so that no client leaving cuts one short.

A background Response runs in this process's own nursery (`serve`, started by the server) to
its end, at the engine's pace. Every event it says is numbered and kept as a detached stream's
are (kept.py: bounded by `--reattach-keep-bytes`, charged to `--max-memory`), so that the
stream of its create and every `GET /v1/responses/{id}?stream=true&starting_after=N` are
readers of the same kept events, none of which holds the Response back. Once it ended, its
events stay kept for `--reattach-grace` (a late reader replays them), then only the store has
it. Its rollout is charged to a budget of its own, as a connection's would be, inside the
process's; at most `--max-background` run at once.

Only in this process: a client that asks another process of the same store for it finds it
once it is stored, not before.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from proto_server.server.process.logs import log
from proto_server.server.process.memory import MemoryBudget
from proto_server.server.rollouts.kept import Detached, KeptEvents, pump
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.transport.outbox import Outbox, Outgoing
from proto_server.wire.errors import ProtocolError

#: How long Responses expired by a stopping server may take to say their end.
END_WAIT_S = 2.0


class Background:
    """This process's background Responses: where they run, and how many do."""

    def __init__(self, detached: Detached, *, limit: int, keep_s: float) -> None:
        self._detached = detached
        self._limit = limit
        #: How long a Response's events stay kept once it ended.
        self._keep_s = keep_s
        self._nursery: trio.Nursery | None = None
        self._loops: set[SamplingLoop] = set()
        self._changed = trio.Event()
        self._stopping = False
        self._stopped = trio.Event()

    @property
    def running(self) -> int:
        return len(self._loops)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run background Responses until `stop` (the server's own tasks start this); then
        what is still kept of them goes with the server."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
            finally:
                self._nursery = None

    def check_room(self) -> None:
        """Refuse one more when `--max-background` run already, or when none can run here."""
        if self._nursery is None or self._stopping:
            raise ProtocolError(
                "server_shutting_down",
                "This server runs no background Responses now (it is stopping); retry on "
                "another, or without `background`.",
                error_type="server_error",
                status=503,
            )
        if len(self._loops) >= self._limit:
            raise ProtocolError(
                "too_many_background_responses",
                f"{self._limit} background Responses run already (--max-background); wait for "
                "one to end, cancel one, or send this one without `background`.",
                param="background",
                status=429,
            )

    def start(
        self,
        loop: SamplingLoop,
        kept: KeptEvents,
        send: trio.MemorySendChannel[Outgoing],
        receive: trio.MemoryReceiveChannel[Outgoing],
        budget: MemoryBudget,
    ) -> None:
        """Run `loop` (its events sent into `send`) to its end here, each event kept; then
        close `budget`, its own (what it still counts is no longer counted)."""
        self.check_room()
        assert self._nursery is not None
        self._loops.add(loop)
        self._nursery.start_soon(self._run, loop, kept, send, receive, budget)

    async def _run(
        self,
        loop: SamplingLoop,
        kept: KeptEvents,
        send: trio.MemorySendChannel[Outgoing],
        receive: trio.MemoryReceiveChannel[Outgoing],
        budget: MemoryBudget,
    ) -> None:
        log.info("response.background", extra={"response": loop.machine.id})
        async with self._detached.keeping(kept):
            try:
                async with trio.open_nursery() as nursery, receive:
                    nursery.start_soon(_run_and_close, loop, send)
                    await pump(Outbox(receive, merge=False), kept)
            finally:
                budget.close()
                self._loops.discard(loop)
                self._changed_now()
            await trio.sleep(self._keep_s)  # a late reader replays what it missed

    async def stop(self, deadline: float, reason: str) -> None:
        """Start no more; let what runs end by `deadline`, then end the rest `incomplete`
        (`reason`)."""
        self._stopping = True
        with trio.move_on_at(deadline):
            await self._until(lambda: not self._loops)
        for loop in list(self._loops):
            loop.expire(reason)
        with trio.move_on_after(END_WAIT_S):
            await self._until(lambda: not self._loops)
        self._stopped.set()

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self._changed.wait()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


async def _run_and_close(loop: SamplingLoop, send: trio.MemorySendChannel[Outgoing]) -> None:
    """The Response, then the end of its channel: its pump stops even if it said no end."""
    async with send:
        await loop.run_and_close()
