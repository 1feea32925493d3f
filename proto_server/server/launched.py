"""The launched dialect: every turn is a `response.create`, chained by `previous_response_id`.

The connection keeps its most recent Response's rollout warm (conversation, rendered tokens,
generator session). A follow-up that names it and sends only the new items extends that state:
the same warm rollout as the prototype dialect, with a new Response id per turn. A miss is served
from the persisted store when the request has `store: true` (cold: re-rendered, re-prefilled),
else refused with `previous_response_not_found`. A failed turn evicts what it chained from.
The store serves only the responses of the connection's owner (its API key); a store that cannot
answer is an `error` event (`store_unavailable`), and the connection lives on.

Turns run one at a time, in order; further creates wait in a bounded queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from proto_server.core.request import is_warmup
from proto_server.core.response import Status
from proto_server.server.logs import log
from proto_server.server.rollout import Rollout
from proto_server.server.sampling import SamplingLoop
from proto_server.server.store import ANONYMOUS, StoreUnavailable, chain_items
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import (
    ClientEvent,
    ErrorEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
)

if TYPE_CHECKING:
    from proto_server.server.app import ProtoServer
    from proto_server.server.connection import Connection


def previous_response_not_found(response_id: str, store: bool) -> ProtocolError:
    hint = (
        "it is neither this connection's most recent response nor in the store"
        if store
        else "with store: false only this connection's most recent response can be continued"
    )
    return ProtocolError(
        "previous_response_not_found",
        f"Previous response {quoted(response_id)} not found: {hint}. Resend the full history "
        "without previous_response_id.",
        param="previous_response_id",
    )


class LaunchedDialect:
    def __init__(
        self,
        server: ProtoServer,
        connection: Connection,
        nursery: trio.Nursery,
        *,
        owner: str = ANONYMOUS,
    ) -> None:
        self._server = server
        self._connection = connection
        self._owner = owner
        queued = server.config.max_queued_requests  # at least 1 (ServerConfig)
        #: creates waiting for their turn, each with the bytes it is charged and its frame's size
        self._queue, self._queued = trio.open_memory_channel[tuple[ResponseCreate, int, int]](
            queued
        )
        self._nursery = nursery
        self.cached: tuple[str, Rollout] | None = None
        self.current: SamplingLoop | None = None
        self._finished = trio.Event()
        self._expired: str | None = None
        nursery.start_soon(self._serve_turns)

    async def handle(self, event: ClientEvent, frame_bytes: int) -> None:
        match event:
            case ResponseCreate():
                if event.background:
                    raise ProtocolError(
                        "invalid_field",
                        "`background: true` is not supported over a WebSocket; remove it, or "
                        "POST /v1/responses over HTTP.",
                        param="background",
                    )
                waiting = await self._server.offload.run(
                    self._server.checked_bytes, event, size=frame_bytes
                )
                self._connection.budget.admit(waiting, "This response.create")
                try:
                    self._queue.send_nowait((event, waiting, frame_bytes))
                except trio.WouldBlock:
                    self._connection.budget.charge(-waiting)
                    raise ProtocolError(
                        "concurrent_request",
                        f"{self._server.config.max_queued_requests} response.create frames are "
                        "already waiting behind the one in flight; wait for a response.completed "
                        "before sending more.",
                    ) from None
            case ResponseAppend():
                raise ProtocolError(
                    "unknown_event_type",
                    "response.append belongs to the prototype dialect; on this connection send "
                    "response.create with previous_response_id and only the new items, or "
                    "reconnect with the prototype opt-in.",
                    param="type",
                )
            case ResponseCancel():
                current = self.current
                if current is None or current.machine.status.terminal:
                    raise ProtocolError(
                        "no_open_response", "No response is in flight on this connection."
                    )
                current.cancel()

    async def drain(self) -> None:
        """Serve what is already queued, accept nothing more."""
        self._queue.close()
        await self._finished.wait()

    async def expire(self, reason: str) -> None:
        """Start no queued turn; end the one in flight with `response.incomplete`."""
        self._expired = reason
        self._queue.close()
        if self.current is not None:
            self.current.expire(reason)
        await self._finished.wait()

    async def _serve_turns(self) -> None:
        try:
            async for create, waiting, size in self._queued:
                self._connection.budget.charge(-waiting)  # the rollout is charged instead
                if self._expired is None:  # else the connection is closing: queued turns end
                    await self._serve_turn(create, size)
                del create  # an idle connection holds no request: only its cache, if any
        finally:
            await self.close()
            self._finished.set()

    async def _serve_turn(self, create: ResponseCreate, size: int) -> None:
        """One turn; the rollout goes to the cache if it completed. Nothing of the turn is
        kept once it returns but the cache, which a memory budget can let go."""
        try:
            loop = await self._begin(create, size)
        except (ProtocolError, StoreUnavailable) as exc:
            await self._connection.events.send(ErrorEvent(status=exc.status, error=exc.detail))
            return
        if self._expired is not None:  # the server began stopping while it prepared
            await loop.rollout.aclose()
            return
        self.current = loop
        completed = False
        try:
            if is_warmup(create):
                await loop.run_warmup()
            else:
                await loop.run()
            completed = loop.machine.status is Status.COMPLETED
        finally:
            self.current = None
            if completed:
                self.cached = (loop.machine.id, loop.rollout)
                self._connection.budget.idle(self)
            else:
                log.info("cache.evicted", extra={"response": loop.machine.id})
                await loop.rollout.aclose()

    def evict(self, reason: str) -> None:
        """A memory budget lets the cached rollout go; a follow-up that names it is served from
        the store, or refused with `previous_response_not_found`."""
        cached, self.cached = self.cached, None
        if cached is not None:
            log.info("cache.evicted", extra={"response": cached[0], "reason": reason})
            cached[1].release_budget()
            self._nursery.start_soon(cached[1].aclose)

    async def _begin(self, create: ResponseCreate, size: int) -> SamplingLoop:
        server = self._server
        events = self._connection.events
        budget = self._connection.budget
        owner = self._owner
        previous = create.previous_response_id
        self._connection.budget.busy(self)
        cached, self.cached = self.cached, None  # whatever happens, this turn takes it
        if previous is None:
            if cached is not None:
                await cached[1].aclose()
            return await server.begin_response(
                create, events, budget=budget, source="fresh", size=size, owner=owner
            )
        if cached is not None and cached[0] == previous:
            rollout = cached[1]
            if rollout.serves(create.instructions, create.tools):
                try:
                    return await server.begin_response(
                        create,
                        events,
                        budget=budget,
                        rollout=rollout,
                        source="cache",
                        size=size,
                        owner=owner,
                    )
                except BaseException:
                    await rollout.aclose()  # refused (or cancelled): the state goes with it
                    raise
            # new instructions or tools: the rendered prefix changed, so re-render everything
            history = list(rollout.conversation.items)
            await rollout.aclose()
            return await server.begin_response(
                create,
                events,
                budget=budget,
                history=history,
                source="rebuilt",
                size=size,
                owner=owner,
            )
        self.cached = cached  # a miss leaves the cache as it was
        if cached is not None:
            self._connection.budget.idle(self)
        store = True if create.store is None else create.store
        chain = await server.store.chain(previous, owner=owner) if store else None
        if chain is None:
            raise previous_response_not_found(previous, store)
        return await server.begin_response(
            create,
            events,
            budget=budget,
            history=chain_items(chain),
            source="store",
            size=size,
            owner=owner,
        )

    async def close(self) -> None:
        self._connection.budget.busy(self)
        cached, self.cached = self.cached, None
        if cached is not None:
            await cached[1].aclose()
