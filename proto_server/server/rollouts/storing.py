"""The sampling loop's store step: what the client hears once the store has what it must.

A `store: true` Response is durable before the client hears that it is done, and a stored
suspension before its `response.done`, so whatever the client sends next can be served from the
store, on any process. A store that cannot take the Response turns its end into
`response.failed` (with a `response.steer.failed` for each steer still queued): the event the
client hears is always the truth about what was kept. `persister` says how an ended one is
written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs

from proto_server.core.conversation import ITEM_OVERHEAD_BYTES
from proto_server.core.references import with_ids
from proto_server.core.response import ResponseMachine
from proto_server.core.response.status import TERMINAL_EVENTS
from proto_server.server.process.logs import log
from proto_server.server.process.offload import Offload
from proto_server.server.store import StoredResponse, StoreUnavailable, SuspensionLost
from proto_server.wire.events import (
    ResponseDone,
    ResponseFailed,
    ServerEvent,
)

if TYPE_CHECKING:
    from proto_server.server.process.metrics import TimedStore
    from proto_server.server.rollouts.resume import Durable


def persister(
    store: TimedStore, offload: Offload, first_item: int, owner: str, durable: Durable | None
) -> Callable[[ResponseMachine], Awaitable[None]]:
    """How an ended `store: true` Response is written: its items from `first_item` on, its
    stored suspension (if any) deleted in the same transaction. Giving each item its id takes a
    few microseconds an item: for the 100,000 items of a 4 MB request it runs on a preparation
    thread, not on the event loop."""

    async def persist(machine: ResponseMachine) -> None:
        ended = machine.conversation.items[first_item:]
        size = ITEM_OVERHEAD_BYTES * len(ended)
        items = await offload.run(with_ids, ended, size=size)
        stored = StoredResponse(response=machine.snapshot(), items=items, owner=owner)
        ends = durable.ends if durable is not None else None
        await store.put(stored, ends_suspension=ends)

    return persist


@attrs.frozen
class StoreStep:
    """Where one Response is kept: `persist` writes it when it ends (None: `store: false`);
    `durable` keeps a prototype Response's suspensions (None: they live on this connection)."""

    persist: Callable[[ResponseMachine], Awaitable[None]] | None = None
    durable: Durable | None = None

    async def kept(self, machine: ResponseMachine, event: ServerEvent) -> list[ServerEvent]:
        """What the client hears instead of `event` once the store has what it must: the event
        itself, or the failure (and failed steers) that replace it."""
        if isinstance(event, TERMINAL_EVENTS) and self.persist is not None:
            return await self._stored(machine, event)
        if isinstance(event, ResponseDone) and self.durable is not None:
            events = await self._suspension_stored(machine, event)
            if isinstance(events[0], ResponseFailed):
                return [*await self._stored(machine, events[0]), *events[1:]]
            return events
        return [event]

    async def _suspension_stored(
        self, machine: ResponseMachine, event: ResponseDone
    ) -> list[ServerEvent]:
        """A store that fails leaves the suspension resumable on this connection only (logged);
        a copy that another connection resumed meanwhile ends here."""
        assert self.durable is not None
        try:
            await self.durable.suspended(machine)
        except StoreUnavailable as exc:
            why = {"response": machine.id, "reason": str(exc)}
            log.warning("response.suspension_unstored", extra=why)
        except SuspensionLost as exc:
            log.warning("response.fenced", extra={"response": machine.id})
            return machine.fail(exc.detail)
        return [event]

    async def _stored(self, machine: ResponseMachine, event: ServerEvent) -> list[ServerEvent]:
        """One the store cannot take fails instead (a failed one keeps its own error)."""
        assert self.persist is not None
        try:
            await self.persist(machine)
        except (StoreUnavailable, SuspensionLost) as exc:
            log.warning("response.unstored", extra={"response": machine.id, "reason": str(exc)})
            if not isinstance(event, ResponseFailed):
                return machine.fail_unstored(exc.detail)
        return [event]
