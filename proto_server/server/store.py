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
from proto_server.core.ranges import InvalidSetting, at_least, positive
from proto_server.core.settings import setting
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError, ServerFault, quoted
from proto_server.wire.items import Item
from proto_server.wire.response import Response
from proto_server.wire.tools import Tool

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


class SuspensionLost(ServerFault):
    """Another connection claimed this suspended Response (resumed it by id) after this one
    last wrote it: this copy is fenced off, and what it did is not stored."""

    status = 409

    def __init__(self, response_id: str) -> None:
        super().__init__(
            "response_resumed_elsewhere",
            f"Response {response_id} was resumed by id on another connection; this copy of it "
            "ends here and is not stored.",
        )


@attrs.frozen(kw_only=True)
class SuspendedResponse:
    """A prototype-dialect Response suspended on tool calls, as the store keeps it so that any
    process can rebuild it cold and resume it (the model's warm state is not kept)."""

    #: As its `response.done` said it: id, settings, output so far, usage so far.
    response: Response
    #: Its conversation in order: the create's input, then each segment's output and what was
    #: appended to answer it. Stored in chunks, each suspension writing only what is new.
    items: tuple[Item, ...]
    #: Where its output begins in `items` (what came before was the create's input); its
    #: output is the model's items from there on, so it is not stored twice.
    first_output: int = 0
    instructions: str | None = None
    tools: tuple[Tool, ...] = ()
    #: The call ids it waits on.
    pending: tuple[str, ...] = ()
    segments: int = 0
    tool_calls: int = 0
    owner: str = ANONYMOUS
    #: Raised by every write and every claim: a writer that is not the latest is fenced off.
    version: int = 1
    #: Taken by the connection that resumed it by id; free again when it next suspends.
    claimed: bool = False
    stored_at: float = 0.0


def encode_suspended(suspended: SuspendedResponse) -> bytes:
    """The stored form of a suspension, its items apart (they are written in chunks)."""
    state = converter.unstructure(attrs.evolve(suspended, items=()))
    for name in ("items", "owner", "version", "claimed", "stored_at"):
        state.pop(name, None)
    return orjson.dumps(state)


def encode_items(items: Sequence[Item]) -> bytes:
    return orjson.dumps(converter.unstructure(tuple(items)))


def decode_suspended(
    state: bytes, chunks: Sequence[bytes], *, owner: str, version: int, claimed: bool,
    stored_at: float,
) -> SuspendedResponse:  # fmt: skip
    items: list[Item] = []
    for chunk in chunks:
        items += converter.structure(orjson.loads(chunk), list[Item])  # type: ignore[arg-type,unused-ignore]
    decoded = converter.structure({**orjson.loads(state), "items": []}, SuspendedResponse)
    return attrs.evolve(
        decoded, items=tuple(items), owner=owner, version=version, claimed=claimed,
        stored_at=stored_at,
    )  # fmt: skip


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


DAY_S = 24 * 3600.0


def _positive_finite(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 < value < math.inf:
        raise InvalidSetting(attribute.name, f"must be positive and finite, got {value}")


@attrs.frozen(kw_only=True)
class StoreRetention:
    """What every store keeps, and how long a call may wait on it (both stores, every flag)."""

    # zero or less would delete each response in the transaction that writes it
    max_responses: int = setting(
        100_000,
        at_least(1),
        flag="--store-max-responses",
        help="retention: the newest this many stored responses are kept",
    )
    max_age_s: float = setting(
        30 * DAY_S,
        positive,
        flag="--store-max-age",
        metavar="DAYS",
        unit=DAY_S,
        help="retention: stored responses older than this many days are deleted",
    )
    timeout_s: float = setting(
        5.0,
        _positive_finite,
        flag="--store-timeout",
        help="longest wait for the store (a lock held elsewhere, a slow disk); then the "
        "Response fails (store_unavailable) or the lookup is refused (503), the connection lives",
    )


DEFAULT_RETENTION = StoreRetention()

#: What a failed call of any store could not do, as its `StoreUnavailable` says.
PUT_FAILED = "the response could not be stored; retry, or send it with store: false"
SUSPEND_FAILED = "the suspension could not be stored (it stays resumable on this connection only)"


def resume_failed(response_id: str) -> str:
    return f"suspended response {response_id!r} could not be looked up or claimed; retry shortly"


def get_failed(response_id: str) -> str:
    return f"response {response_id!r} could not be looked up; retry shortly"


def chain_failed(response_id: str) -> str:
    return (
        f"previous response {response_id!r} could not be looked up; retry shortly, or resend "
        "the full history without previous_response_id"
    )


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
    # 2-4: suspended prototype Responses, their items in chunks (each suspension adds one)
    """CREATE TABLE suspended (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        stored_at REAL NOT NULL,
        version INTEGER NOT NULL,
        claimed INTEGER NOT NULL DEFAULT 0,
        items_count INTEGER NOT NULL,
        state BLOB NOT NULL
    )""",
    "CREATE INDEX suspended_stored_at ON suspended (stored_at)",
    """CREATE TABLE suspended_items (
        id TEXT NOT NULL,
        start INTEGER NOT NULL,
        items BLOB NOT NULL,
        PRIMARY KEY (id, start)
    )""",
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
        retention: StoreRetention = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = str(path)
        self._clock = clock
        self.max_responses = retention.max_responses
        self.max_age_s = retention.max_age_s
        self.timeout_s = retention.timeout_s
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

    def _put(
        self, db: sqlite3.Connection, stored: StoredResponse, ends_suspension: int | None
    ) -> None:
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
            if ends_suspension is not None:
                self._end_suspension(db, response.id, ends_suspension)
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
    def _end_suspension(db: sqlite3.Connection, response_id: str, version: int) -> None:
        gone = db.execute(
            "DELETE FROM suspended WHERE id = ? AND version = ?", (response_id, version)
        )
        if gone.rowcount != 1:
            raise SuspensionLost(response_id)
        db.execute("DELETE FROM suspended_items WHERE id = ?", (response_id,))

    def _suspend(
        self, db: sqlite3.Connection, suspended: SuspendedResponse, since: int, expected: int
    ) -> None:
        response_id = suspended.response.id
        now = self._clock()
        state = encode_suspended(suspended)
        new = suspended.items[since:]
        with db:
            db.execute("BEGIN IMMEDIATE")
            if expected == 0:
                try:
                    db.execute(
                        "INSERT INTO suspended (id, owner, stored_at, version, claimed, "
                        "items_count, state) VALUES (?, ?, ?, 1, 0, ?, ?)",
                        (response_id, suspended.owner, now, len(suspended.items), state),
                    )
                except sqlite3.IntegrityError:
                    raise SuspensionLost(response_id) from None
            else:
                moved = db.execute(
                    "UPDATE suspended SET state = ?, version = ?, claimed = 0, stored_at = ?, "
                    "items_count = ? WHERE id = ? AND version = ?",
                    (state, expected + 1, now, len(suspended.items), response_id, expected),
                )
                if moved.rowcount != 1:
                    raise SuspensionLost(response_id)
            if new:
                db.execute(
                    "INSERT OR REPLACE INTO suspended_items (id, start, items) VALUES (?, ?, ?)",
                    (response_id, since, encode_items(new)),
                )
            old = [
                row[0]
                for row in db.execute(
                    "SELECT id FROM suspended WHERE stored_at < ? UNION SELECT id FROM "
                    "(SELECT id FROM suspended ORDER BY stored_at DESC LIMIT -1 OFFSET ?)",
                    (now - self.max_age_s, self.max_responses),
                )
            ]
            for gone in old:
                db.execute("DELETE FROM suspended WHERE id = ?", (gone,))
                db.execute("DELETE FROM suspended_items WHERE id = ?", (gone,))

    @staticmethod
    def _suspended(
        db: sqlite3.Connection, response_id: str, owner: str
    ) -> SuspendedResponse | None:
        with db:  # one read transaction: the state and its chunks as of one moment
            db.execute("BEGIN")
            row = db.execute(
                "SELECT state, version, claimed, items_count, stored_at FROM suspended "
                "WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
            if row is None:
                return None
            chunks = db.execute(
                "SELECT items FROM suspended_items WHERE id = ? AND start < ? ORDER BY start",
                (response_id, row[3]),
            ).fetchall()
        return decode_suspended(
            row[0], [chunk[0] for chunk in chunks], owner=owner, version=int(row[1]),
            claimed=bool(row[2]), stored_at=float(row[4]),
        )  # fmt: skip

    @staticmethod
    def _claim(
        db: sqlite3.Connection, response_id: str, owner: str, version: int, now: float,
        lapsed_before: float,
    ) -> bool:  # fmt: skip
        # one statement: SQLite runs one writer at a time, so of two racing claims one wins
        won = db.execute(
            "UPDATE suspended SET claimed = 1, version = version + 1, stored_at = ? "
            "WHERE id = ? AND owner = ? AND version = ? AND (claimed = 0 OR stored_at < ?)",
            (now, response_id, owner, version, lapsed_before),
        )
        return won.rowcount == 1

    @staticmethod
    def _release(db: sqlite3.Connection, response_id: str, version: int) -> None:
        db.execute(
            "UPDATE suspended SET claimed = 0 WHERE id = ? AND version = ?", (response_id, version)
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

    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        await self._call(
            self._write_limiter, PUT_FAILED, self._db, self._put, stored, ends_suspension
        )

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        await self._call(
            self._write_limiter, SUSPEND_FAILED, self._db, self._suspend, suspended, since,
            expected,
        )  # fmt: skip

    async def suspended(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> SuspendedResponse | None:
        return await self._read(resume_failed(response_id), self._suspended, response_id, owner)

    async def claim(
        self, response_id: str, *, owner: str, version: int, lapsed_before: float = -math.inf
    ) -> bool:
        return await self._call(
            self._write_limiter, resume_failed(response_id), self._db, self._claim,
            response_id, owner, version, self._clock(), lapsed_before,
        )  # fmt: skip

    async def release(self, response_id: str, *, version: int) -> None:
        await self._call(
            self._write_limiter, resume_failed(response_id), self._db, self._release,
            response_id, version,
        )  # fmt: skip

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


#: Where a chain is looked for, as `previous_response_not_found` says it.
STORED = "in the store (never stored with store: true, or expired)"


async def history_of(
    store: ResponseStore, previous: str, *, owner: str, where: str = STORED
) -> list[Item]:
    """The items of the stored chain that ends at `previous`: what a turn continuing it is
    served from; `previous_response_not_found` (saying `where` it was looked for) if the store
    holds no such chain for `owner`. The one lookup of both HTTP and the WebSocket dialects."""
    chain = await store.chain(previous, owner=owner)
    if chain is None:
        raise previous_response_not_found(previous, where)
    return chain_items(chain)


def previous_response_not_found(response_id: str, where: str) -> ProtocolError:
    return ProtocolError(
        "previous_response_not_found",
        f"Previous response {quoted(response_id)} not found: it is not {where}. Resend the "
        "full history without previous_response_id.",
        param="previous_response_id",
    )


def chain_items(chain: Sequence[StoredResponse]) -> list[Item]:
    """The history a chain holds: its items in order, from its latest Response served from a
    compacted history (which stored that history) on."""
    start = max(
        (index for index, stored in enumerate(chain) if compacted_prompt(stored.response.output)),
        default=0,
    )
    return [item for stored in chain[start:] for item in stored.items]
