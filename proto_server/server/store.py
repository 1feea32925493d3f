"""The persisted store: `store: true` responses, so a chain survives a reconnect or a restart.

Behind a small interface (`ResponseStore`), so that a shared store (postgres.py) can serve
several server processes. The default is embedded SQLite in WAL mode, one transaction per
write, so a crash in the middle of a write leaves the previous state intact. Its blocking calls
run in worker threads.

A stored response belongs to its owner (the API key that created it, as an opaque id; with auth
off, one anonymous owner): a lookup by another owner finds nothing. Every failure of the store,
and every call that takes longer than its timeout, is a `StoreUnavailable`: the Response or the
lookup fails, never the connection. Writes go one at a time through one connection; reads of a
file have connections of their own, so they do not queue behind a write that waits for a lock.
"""

from __future__ import annotations

import hashlib
import math
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import orjson
import trio

from proto_server.core.compaction import compacted_prompt
from proto_server.wire.converter import converter
from proto_server.wire.errors import ServerFault
from proto_server.wire.items import Item
from proto_server.wire.response import Response

T = TypeVar("T")

#: The owner of everything stored while auth is off.
ANONYMOUS = ""

#: Reader connections of a file store (a write never waits for them, nor they for it).
READERS = 4

#: SQLite gives up waiting for a lock this long before the call's deadline, so the call ends
#: by itself and its thread is not left behind holding the connection.
_MARGIN_S = 0.05


def owner_id(key: str) -> str:
    """The owner id stored for an API key: a digest, so the store never holds the key."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


class StoreError(Exception):
    """The store could not be opened at start-up (a database that does not answer, a schema
    from a newer server): the server does not start."""


def is_postgres_url(text: str) -> bool:
    return text.startswith(("postgresql://", "postgres://"))


def redact(location: str) -> str:
    """A store's location as it may be printed: a URL's password left out."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", location)


class StoreUnavailable(ServerFault):
    """The store failed or did not answer within its timeout (locked, full, gone)."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__("store_unavailable", message)


@attrs.frozen(kw_only=True)
class StoredResponse:
    response: Response
    #: What this Response added to the conversation, in order: its input items and its output
    #: (interleaved per segment in the prototype dialect). A chain's items are the concatenation.
    items: tuple[Item, ...]
    #: Who may read it back: `owner_id` of the key that created it, or `ANONYMOUS`.
    owner: str = ANONYMOUS


def encode_row(stored: StoredResponse) -> tuple[bytes, bytes]:
    """The stored form of a response and its items (JSON), the same in every store."""
    return (
        orjson.dumps(converter.unstructure(stored.response)),
        orjson.dumps(converter.unstructure(stored.items)),
    )


def decode_row(response: bytes, items: bytes, owner: str) -> StoredResponse:
    return StoredResponse(
        response=converter.structure(orjson.loads(response), Response),
        items=tuple(converter.structure(orjson.loads(items), list[Item])),  # type: ignore[arg-type,unused-ignore]
        owner=owner,
    )


def check_retention(max_responses: int, max_age_s: float, timeout_s: float) -> None:
    """A store's limits, refused (ValueError) where they would make no sense."""
    # a limit of zero or less would delete each response in the transaction that writes it
    if isinstance(max_responses, bool) or not isinstance(max_responses, int):
        raise ValueError(f"max_responses must be a positive integer, got {max_responses!r}")
    if max_responses <= 0:
        raise ValueError(f"max_responses must be a positive integer, got {max_responses}")
    if not (max_age_s > 0):
        raise ValueError(f"max_age_s must be positive, got {max_age_s}")
    if not (0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")


#: What a failed call of any store could not do, as its `StoreUnavailable` says.
PUT_FAILED = "the response could not be stored; retry, or send it with store: false"


def get_failed(response_id: str) -> str:
    return f"response {response_id!r} could not be looked up; retry shortly"


def chain_failed(response_id: str) -> str:
    return (
        f"previous response {response_id!r} could not be looked up; retry shortly, or resend "
        "the full history without previous_response_id"
    )


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None: ...

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        """The stored responses from the first of the chain to `response_id`, or None if any
        link is missing (expired, never stored, or another owner's)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ProbedStore(Protocol):
    """A store outside the process (a database server) that may be down while the server is
    up: `/readyz` asks it. An embedded SQLite file is as ready as the process holding it."""

    async def readiness(self) -> str | None:
        """None when the store answers now, within a short timeout; otherwise why not."""
        ...


_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        previous_response_id TEXT,
        created_at INTEGER NOT NULL,
        stored_at REAL NOT NULL,
        response BLOB NOT NULL,
        items BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at)",
)

#: Schema changes in order; `PRAGMA user_version` counts those a file has had.
_MIGRATIONS = (
    # 1: API keys are tenants; rows written before belong to the anonymous owner
    "ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
)
SCHEMA_VERSION = len(_MIGRATIONS)


def _migrate(db: sqlite3.Connection) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        for statement in _SCHEMA:
            db.execute(statement)
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"the store has schema version {version}, written by a newer proto-server "
                f"(this one knows {SCHEMA_VERSION})"
            )
        for statement in _MIGRATIONS[version:]:
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


class SQLiteStore:
    """Responses in one SQLite file (or `:memory:`), pruned to a retention limit."""

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        max_responses: int = 100_000,
        max_age_s: float = 30 * 24 * 3600,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_retention(max_responses, max_age_s, timeout_s)
        self.path = str(path)
        self._clock = clock
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._db = self._connect()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        _migrate(self._db)
        self._write_limiter = trio.CapacityLimiter(1)
        self._memory = self.path == ":memory:"
        # one in-memory database is one connection: its reads take turns with its writes
        self._read_limiter = self._write_limiter if self._memory else trio.CapacityLimiter(READERS)
        self._readers: list[sqlite3.Connection] = []
        self._all_readers: list[sqlite3.Connection] = []

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=self.timeout_s
        )

    async def _call(
        self,
        limiter: trio.CapacityLimiter,
        what: str,
        db: sqlite3.Connection | None,
        fn: Callable[..., T],
        *args: Any,
    ) -> T:
        """Run `fn(db, *args)` in a worker thread within `timeout_s`, waiting for a turn
        included; every way it can fail becomes a `StoreUnavailable` here, and only here."""
        deadline = time.monotonic() + self.timeout_s

        def bounded() -> T:
            if db is None:
                return fn(*args)
            left = deadline - time.monotonic() - _MARGIN_S  # after waiting for a turn
            if left <= 0:
                raise trio.TooSlowError
            db.execute(f"PRAGMA busy_timeout = {max(1, int(left * 1000))}")
            return fn(db, *args)

        try:
            with trio.fail_after(self.timeout_s):
                # abandoned only if SQLite hangs past its busy timeout (a stuck disk): the
                # thread keeps its limiter slot until it ends, so no two share a connection
                return await trio.to_thread.run_sync(
                    bounded, limiter=limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            why = ""
        except sqlite3.Error as exc:
            name = getattr(exc, "sqlite_errorname", "")
            if not name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
                raise StoreUnavailable(f"The response store failed ({exc}), so {what}.") from exc
            why = ": another writer holds its lock"
        raise StoreUnavailable(
            f"The response store did not answer within {self.timeout_s:g} s (--store-timeout)"
            f"{why}, so {what}."
        )

    async def _read(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._memory:
            return await self._call(self._read_limiter, what, self._db, fn, *args)
        async with self._read_limiter:  # as many idle readers as free slots
            reader = self._readers.pop() if self._readers else None
            if reader is None:
                reader = await self._call(trio.CapacityLimiter(1), what, None, self._connect)
                self._all_readers.append(reader)
            # a reader whose call failed may still be busy in an abandoned thread: not reused
            result = await self._call(trio.CapacityLimiter(1), what, reader, fn, *args)
            self._readers.append(reader)
            return result

    # -- blocking bodies, run in a worker thread -------------------------------------------

    def _put(self, db: sqlite3.Connection, stored: StoredResponse) -> None:
        response = stored.response
        row = (
            response.id,
            response.previous_response_id,
            response.created_at,
            self._clock(),
            *encode_row(stored),
            stored.owner,
        )
        with db:  # one transaction: all of it, or none of it
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT OR REPLACE INTO responses (id, previous_response_id, created_at, "
                "stored_at, response, items, owner) VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )
            db.execute(
                "DELETE FROM responses WHERE stored_at < ?", (self._clock() - self.max_age_s,)
            )
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                "ORDER BY stored_at DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )

    @staticmethod
    def _get(db: sqlite3.Connection, response_id: str, owner: str) -> StoredResponse | None:
        row = db.execute(
            "SELECT response, items FROM responses WHERE id = ? AND owner = ?",
            (response_id, owner),
        ).fetchone()
        return None if row is None else decode_row(row[0], row[1], owner)

    @classmethod
    def _chain(
        cls, db: sqlite3.Connection, response_id: str, owner: str
    ) -> list[StoredResponse] | None:
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        seen = set()
        with db:  # one read transaction: the chain as of one moment
            db.execute("BEGIN")
            while next_id is not None and next_id not in seen:
                seen.add(next_id)
                stored = cls._get(db, next_id, owner)
                if stored is None:
                    return None
                chain.append(stored)
                next_id = stored.response.previous_response_id
        chain.reverse()
        return chain

    # -- the interface --------------------------------------------------------------------------

    async def put(self, stored: StoredResponse) -> None:
        await self._call(self._write_limiter, PUT_FAILED, self._db, self._put, stored)

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        return await self._read(get_failed(response_id), self._get, response_id, owner)

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        return await self._read(chain_failed(response_id), self._chain, response_id, owner)

    def count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM responses").fetchone()[0])

    async def aclose(self) -> None:
        def close() -> None:
            for reader in self._all_readers:
                reader.close()
            self._db.close()

        async with self._write_limiter:
            await trio.to_thread.run_sync(close)


def chain_items(chain: Sequence[StoredResponse]) -> list[Item]:
    """The history a chain holds: its items in order, from its latest Response served from a
    compacted history (which stored that history) on."""
    start = max(
        (index for index, stored in enumerate(chain) if compacted_prompt(stored.response.output)),
        default=0,
    )
    return [item for stored in chain[start:] for item in stored.items]
