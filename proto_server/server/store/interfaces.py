"""What the server asks of a store: small protocols, so a test's dict, SQLite and
PostgreSQL serve the same callers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from proto_server.core.shared_capacity import Load
from proto_server.server.store.records import ANONYMOUS, StoredResponse, SuspendedResponse
from proto_server.wire.items import Item


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        """Store an ended Response; `ends_suspension`: the version of its suspension this
        writer holds, deleted in the same transaction (`SuspensionLost` if it is not the
        latest: another connection resumed it, and nothing is written)."""
        ...

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None: ...

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        """The stored responses from the first of the chain to `response_id`, or None if any
        link is missing (expired, never stored, or another owner's)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ItemStore(Protocol):
    """A store that finds stored items by their ids (what `item_reference` names) and deletes
    stored responses (`DELETE /v1/responses/{id}`); both stores do, a test's dict may not."""

    async def items(
        self, item_ids: Sequence[str], *, owner: str, max_bytes: int | None = None
    ) -> dict[str, Item]:
        """Those of the ids that name an item of a response `owner` stored, with the item (from
        the newest such response, if several hold it).

        An item is read with the response that holds it: if those responses hold more than
        `max_bytes` of stored JSON in all (each once), a `ProtocolError` `message_too_large`
        (`check_stored`) is raised before any of them is read or decoded."""
        ...

    async def delete(self, response_id: str, *, owner: str) -> bool:
        """Delete `owner`'s stored response; whether there was one. A chain through it breaks
        there: a later response that continues it can no longer be continued from the store."""
        ...


@runtime_checkable
class SuspensionStore(Protocol):
    """A store that keeps suspended prototype Responses, so they survive their process.

    Versions fence writers off: each write names the version it last saw and raises
    `SuspensionLost` if the stored one moved on; `claim` is the atomic step that makes exactly
    one of several connections the Response's holder."""

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        """Write `suspended` (version `expected + 1`, unclaimed), its items from `since` on
        appended to those stored; `expected` 0: its first suspension."""
        ...

    async def suspended(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> SuspendedResponse | None: ...

    async def claim(
        self, response_id: str, *, owner: str, version: int, lapsed_before: float = -math.inf
    ) -> bool:
        """Take the suspension at `version` (it becomes `version + 1`, claimed, stamped now)
        if it is unclaimed, or its claim is older than `lapsed_before` (its holder neither
        suspended again nor ended in time: its process died; if it lives after all, its next
        write is fenced off); False if another connection holds it or it changed."""
        ...

    async def release(self, response_id: str, *, version: int) -> None:
        """Let a claim go (its connection went away before the Response suspended again)."""
        ...


@runtime_checkable
class LoadStore(Protocol):
    """A store the server processes that share the engines publish their loads to, so each
    admits against its part of the room (`--admission-shared`, core/shared_capacity.py)."""

    async def publish_load(self, peer: str, load: Load, *, stale_s: float) -> list[Load]:
        """Write `peer`'s load and return the other processes' (those heard from within
        `stale_s`; the rest are gone, and forgotten)."""
        ...

    async def withdraw(self, peer: str) -> None:
        """`peer` stops: its load is forgotten at once."""
        ...


@runtime_checkable
class ProbedStore(Protocol):
    """A store that may be unusable while the server is up: `/readyz` asks it. A database
    server may be down; an embedded SQLite file may have been deleted or replaced."""

    async def readiness(self) -> str | None:
        """None when the store answers now, within a short timeout; otherwise why not."""
        ...


@runtime_checkable
class FileStore(Protocol):
    """A store kept in a file on this machine, which can be deleted or replaced under it."""

    @property
    def file_lost(self) -> str | None:
        """Why the file at its path is no longer the one open (as the last check saw it)."""
        ...
