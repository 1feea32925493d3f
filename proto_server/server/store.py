"""The persisted store: `store: true` responses, so a chain survives a reconnect or a restart.

Behind a small interface (`ResponseStore`) so a shared store can serve several server processes
later. The default is embedded SQLite in WAL mode, one transaction per write, so a crash in the
middle of a write leaves the previous state intact. Its blocking calls run in a worker thread.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import orjson
import trio

from proto_server.wire.converter import converter
from proto_server.wire.items import Item
from proto_server.wire.response import Response


@attrs.frozen(kw_only=True)
class StoredResponse:
    response: Response
    #: What this Response added to the conversation, in order: its input items and its output
    #: (interleaved per segment in the prototype dialect). A chain's items are the concatenation.
    items: tuple[Item, ...]


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def chain(self, response_id: str) -> list[StoredResponse] | None:
        """The stored responses from the first of the chain to `response_id`, or None if any
        link is missing (expired or never stored)."""
        ...

    async def aclose(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    previous_response_id TEXT,
    created_at INTEGER NOT NULL,
    stored_at REAL NOT NULL,
    response BLOB NOT NULL,
    items BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
"""


class SQLiteStore:
    """Responses in one SQLite file (or `:memory:`), pruned to a retention limit."""

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        max_responses: int = 100_000,
        max_age_s: float = 30 * 24 * 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = str(path)
        self._clock = clock
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._limiter = trio.CapacityLimiter(1)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    # -- blocking bodies, run in the worker thread -------------------------------------------

    def _put(self, stored: StoredResponse) -> None:
        response = stored.response
        row = (
            response.id,
            response.previous_response_id,
            response.created_at,
            self._clock(),
            orjson.dumps(converter.unstructure(response)),
            orjson.dumps(converter.unstructure(stored.items)),
        )
        with self._db:  # one transaction: all of it, or none of it
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            self._db.execute(
                "DELETE FROM responses WHERE stored_at < ?", (self._clock() - self.max_age_s,)
            )
            self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                "ORDER BY stored_at DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )

    def _get(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT response, items FROM responses WHERE id = ?", (response_id,)
        ).fetchone()
        if row is None:
            return None
        return StoredResponse(
            response=converter.structure(orjson.loads(row[0]), Response),
            items=tuple(converter.structure(orjson.loads(row[1]), list[Item])),  # type: ignore[arg-type,unused-ignore]
        )

    def _chain(self, response_id: str) -> list[StoredResponse] | None:
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        seen = set()
        while next_id is not None and next_id not in seen:
            seen.add(next_id)
            stored = self._get(next_id)
            if stored is None:
                return None
            chain.append(stored)
            next_id = stored.response.previous_response_id
        chain.reverse()
        return chain

    # -- the interface --------------------------------------------------------------------------

    async def put(self, stored: StoredResponse) -> None:
        await self._run(self._put, stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        result: StoredResponse | None = await self._run(self._get, response_id)
        return result

    async def chain(self, response_id: str) -> list[StoredResponse] | None:
        result: list[StoredResponse] | None = await self._run(self._chain, response_id)
        return result

    def count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM responses").fetchone()[0])

    async def aclose(self) -> None:
        await self._run(self._db.close)


def chain_items(chain: Sequence[StoredResponse]) -> list[Item]:
    return [item for stored in chain for item in stored.items]
