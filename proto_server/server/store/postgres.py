"""The PostgreSQL store: one store shared by every server process, on one machine or many.

Same interface and guarantees as the embedded SQLite store (store.py): one transaction per
response written (the row and the retention pruning together), owners kept apart, every
failure or overrun of `--store-timeout` a `StoreUnavailable` for that Response or lookup only.

psycopg 3 with its connection pool, each blocking call on a trio worker thread: psycopg's async
mode runs on asyncio only, while a thread per call leaves trio in charge of every deadline and
cancellation, as for SQLite (a call past its deadline is abandoned; the server's statement
timeout ends it on the database's side). The pool reconnects by itself in its own threads, and
checks a connection before lending it, so when the database comes back the next call works.

The schema is created or migrated at start-up under an advisory lock, so processes starting
together migrate once; `proto_server_schema` holds the version. The compaction secret lives in
the database too: every process sealing and opening compacted histories must share it.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
import trio
from psycopg_pool import ConnectionPool, PoolTimeout

from proto_server.core.shared_capacity import Load
from proto_server.server.store import (
    ANONYMOUS,
    DEFAULT_RETENTION,
    ITEMS_FAILED,
    LOADS_FAILED,
    PUT_FAILED,
    SUSPEND_FAILED,
    StoredResponse,
    StoreError,
    StoreRetention,
    StoreUnavailable,
    SuspendedResponse,
    SuspensionLost,
    chain_failed,
    decode_row,
    decode_suspended,
    delete_failed,
    encode_items,
    encode_suspended,
    found_items,
    get_failed,
    put_row,
    resume_failed,
    sql,
    stored_item_ids,
)
from proto_server.wire.items import Item

T = TypeVar("T")

#: Connections of one process to the database (each call holds one for its duration).
CONNECTIONS = 4
#: The longest `/readyz` waits for `SELECT 1` (or `--store-timeout`, if shorter): a balancer's
#: check must get its answer well within its own timeout.
PROBE_TIMEOUT_S = 2.0
#: A write still open this close to its call's deadline is rolled back, not committed.
_COMMIT_MARGIN_S = 0.05
#: Any key: the advisory lock that makes concurrent start-ups migrate one at a time.
_MIGRATION_LOCK = 0x70726F746F  # "proto"
_RESPONSES = "proto_server_responses"
_SUSPENDED = "proto_server_suspended"
_SUSPENDED_ITEMS = "proto_server_suspended_items"
_ITEMS = "proto_server_response_items"
_PEERS = "proto_server_admission_peers"

#: Schema changes in order; `proto_server_schema.version` counts those a database has had.
_MIGRATIONS = (
    f"""CREATE TABLE {_RESPONSES} (
        id text PRIMARY KEY,
        previous_response_id text,
        owner text NOT NULL,
        created_at bigint NOT NULL,
        stored_at double precision NOT NULL,
        response bytea NOT NULL,
        items bytea NOT NULL
    )""",
    f"CREATE INDEX {_RESPONSES}_stored_at ON {_RESPONSES} (stored_at)",
    "CREATE TABLE proto_server_secret (id integer PRIMARY KEY, secret bytea NOT NULL)",
    # 4-6: suspended prototype Responses, their items in chunks (each suspension adds one)
    f"""CREATE TABLE {_SUSPENDED} (
        id text PRIMARY KEY,
        owner text NOT NULL,
        stored_at double precision NOT NULL,
        version bigint NOT NULL,
        claimed boolean NOT NULL DEFAULT false,
        items_count integer NOT NULL,
        state bytea NOT NULL
    )""",
    f"CREATE INDEX {_SUSPENDED}_stored_at ON {_SUSPENDED} (stored_at)",
    f"""CREATE TABLE {_SUSPENDED_ITEMS} (
        id text NOT NULL,
        start integer NOT NULL,
        items bytea NOT NULL,
        PRIMARY KEY (id, start)
    )""",
    # 7-9: which stored response holds each item id (`item_reference`), filled for old rows;
    # deleted with its response (pruned or deleted by id)
    f"""CREATE TABLE {_ITEMS} (
        owner text NOT NULL,
        item_id text NOT NULL,
        response_id text NOT NULL REFERENCES {_RESPONSES} (id) ON DELETE CASCADE,
        PRIMARY KEY (owner, item_id, response_id)
    )""",
    f"CREATE INDEX {_ITEMS}_response ON {_ITEMS} (response_id)",
    f"INSERT INTO {_ITEMS} SELECT DISTINCT r.owner, e.value->>'id', r.id FROM {_RESPONSES} r, "
    "jsonb_array_elements(convert_from(r.items, 'UTF8')::jsonb) e "
    "WHERE jsonb_typeof(e.value->'id') = 'string' ON CONFLICT DO NOTHING",
    # 10: what each server process sharing the engines holds and waits for (shared admission)
    f"""CREATE TABLE {_PEERS} (
        peer text PRIMARY KEY,
        reserved bigint NOT NULL,
        waiting bigint NOT NULL,
        head bigint NOT NULL,
        seen_at double precision NOT NULL
    )""",
)
SCHEMA_VERSION = len(_MIGRATIONS)


class _Postgres:
    """A psycopg connection as `sql.Database`: the shared statements with this database's
    tables (prefixed, beside whatever else it holds) and psycopg's `%s` placeholders."""

    def __init__(self, conn: psycopg.Connection[Any], until: float) -> None:
        self._conn = conn
        self._until = until

    def execute(self, statement: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(_text(statement), params)

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(_text(statement), rows)

    @contextlib.contextmanager
    def transaction(self, *, write: bool) -> Iterator[None]:
        # a row written is locked until commit: the writer that comes second waits for it;
        # past the call's deadline the server has told the client it failed: not committed
        with self._conn.transaction():
            yield
            if write and time.monotonic() > self._until:
                raise trio.TooSlowError


def _text(statement: str) -> str:
    return sql.statement_text(statement, prefix="proto_server_", placeholder="%s")


class PostgresStore:
    """Responses in a PostgreSQL database, pruned to a retention limit; opened (and migrated)
    when made, before the server listens, so a database that is not there stops start-up."""

    def __init__(
        self,
        url: str,
        *,
        retention: StoreRetention = DEFAULT_RETENTION,
        connections: int = CONNECTIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_responses = retention.max_responses
        self.max_age_s = retention.max_age_s
        self.timeout_s = retention.timeout_s
        self._clock = clock
        self._limiter = trio.CapacityLimiter(connections)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=connections,
            timeout=self.timeout_s,
            open=False,
            check=ConnectionPool.check_connection,
            reconnect_timeout=math.inf,  # a database that is away is waited for, not given up
            kwargs={
                "autocommit": True,
                "connect_timeout": max(1, math.ceil(self.timeout_s)),
                "options": f"-c statement_timeout={math.ceil(self.timeout_s * 1000)}",
            },
        )
        try:
            self._pool.open(wait=True, timeout=self.timeout_s)
            with self._pool.connection() as conn:
                self.secret = _migrate(conn)
        except (psycopg.Error, PoolTimeout) as exc:
            self._pool.close()
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreError(why) from exc
        except BaseException:
            self._pool.close()
            raise

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(database, *args)` on a worker thread within `timeout_s`, the wait for a
        connection included; every way it can fail becomes a `StoreUnavailable` here."""

        # a commit begun this long before the deadline still lands before the client is told
        until = time.monotonic() + self.timeout_s - _COMMIT_MARGIN_S

        def run() -> T:
            with self._pool.connection(timeout=self.timeout_s) as conn:
                return fn(_Postgres(conn, until), *args)

        try:
            with trio.fail_after(self.timeout_s):
                return await trio.to_thread.run_sync(
                    run, limiter=self._limiter, abandon_on_cancel=True
                )
        except (trio.TooSlowError, PoolTimeout, psycopg.errors.QueryCanceled):
            raise StoreUnavailable(
                f"The response store did not answer within {self.timeout_s:g} s "
                f"(--store-timeout), so {what}."
            ) from None
        except psycopg.Error as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreUnavailable(f"The response store failed ({why}), so {what}.") from exc

    # -- blocking bodies, run in a worker thread: encode, the shared SQL (sql.py), decode --

    def _put(self, db: sql.Database, stored: StoredResponse, ends_suspension: int | None) -> None:
        now = self._clock()
        try:
            sql.put(
                db, put_row(stored, now), stored_item_ids(stored), ends_suspension,
                now - self.max_age_s, self.max_responses,
            )  # fmt: skip
        except sql.Fenced:
            raise SuspensionLost(stored.response.id) from None

    def _suspend(
        self,
        db: sql.Database,
        suspended: SuspendedResponse,
        since: int,
        expected: int,
    ) -> None:
        response_id = suspended.response.id
        now = self._clock()
        new = suspended.items[since:]
        try:
            sql.suspend(
                db, response_id, suspended.owner, now, encode_suspended(suspended),
                len(suspended.items), since, encode_items(new) if new else None, expected,
                now - self.max_age_s, self.max_responses,
            )  # fmt: skip
        except sql.Fenced:
            raise SuspensionLost(response_id) from None

    @staticmethod
    def _suspended(db: sql.Database, response_id: str, owner: str) -> SuspendedResponse | None:
        found = sql.suspended(db, response_id, owner)
        if found is None:
            return None
        state, version, claimed, stored_at, chunks = found
        return decode_suspended(
            state, chunks, owner=owner, version=version, claimed=claimed, stored_at=stored_at
        )

    @staticmethod
    def _op(db: sql.Database, op: Callable[..., T], *args: Any) -> T:
        return op(db, *args)

    @staticmethod
    def _get(db: sql.Database, response_id: str, owner: str) -> StoredResponse | None:
        row = sql.get(db, response_id, owner)
        return None if row is None else decode_row(row[0], row[1], owner)

    @staticmethod
    def _items(
        db: sql.Database, item_ids: list[str], owner: str, max_bytes: int | None
    ) -> dict[str, Item]:
        return found_items(*sql.items(db, owner, item_ids, max_bytes), max_bytes)

    def _chain(self, db: sql.Database, response_id: str, owner: str) -> list[StoredResponse] | None:
        rows = sql.chain(db, response_id, owner, self.max_responses)
        if rows is None:
            return None
        return [decode_row(row[0], row[1], owner) for row in rows]

    # -- the interface --------------------------------------------------------------------------

    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        await self._call(PUT_FAILED, self._put, stored, ends_suspension)

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        await self._call(SUSPEND_FAILED, self._suspend, suspended, since, expected)

    async def suspended(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> SuspendedResponse | None:
        return await self._call(resume_failed(response_id), self._suspended, response_id, owner)

    async def claim(
        self, response_id: str, *, owner: str, version: int, lapsed_before: float = -math.inf
    ) -> bool:
        return await self._call(
            resume_failed(response_id),
            self._op,
            sql.claim,
            response_id,
            owner,
            version,
            self._clock(),
            lapsed_before,
        )

    async def release(self, response_id: str, *, version: int) -> None:
        await self._call(resume_failed(response_id), self._op, sql.release, response_id, version)

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        return await self._call(get_failed(response_id), self._get, response_id, owner)

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        return await self._call(chain_failed(response_id), self._chain, response_id, owner)

    async def items(
        self, item_ids: Sequence[str], *, owner: str, max_bytes: int | None = None
    ) -> dict[str, Item]:
        return await self._call(ITEMS_FAILED, self._items, list(item_ids), owner, max_bytes)

    async def delete(self, response_id: str, *, owner: str) -> bool:
        return await self._call(
            delete_failed(response_id), self._op, sql.delete, response_id, owner
        )

    async def publish_load(self, peer: str, load: Load, *, stale_s: float) -> list[Load]:
        now = self._clock()
        rows = await self._call(
            LOADS_FAILED, self._op, sql.publish_load, peer,
            (load.reserved, load.waiting, load.head), now, now - stale_s,
        )  # fmt: skip
        return [Load(reserved, waiting, head, other) for other, reserved, waiting, head in rows]

    async def withdraw(self, peer: str) -> None:
        await self._call(LOADS_FAILED, self._op, sql.withdraw, peer)

    async def count(self) -> int:
        return await self._call("the responses could not be counted", self._op, sql.count)

    async def readiness(self) -> str | None:
        """None when the database answers `SELECT 1` through the pool in time; else why not."""
        limit = min(PROBE_TIMEOUT_S, self.timeout_s)

        def select_one(db: sql.Database) -> None:
            db.execute("SELECT 1").fetchone()

        try:
            with trio.fail_after(limit):
                await self._call("this server is not ready", select_one)
        except trio.TooSlowError:
            return f"the response store did not answer SELECT 1 within {limit:g} s"
        except StoreUnavailable as exc:
            return str(exc).rstrip(".")
        return None

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._pool.close)


def _migrate(conn: psycopg.Connection[Any]) -> bytes:
    """Bring the schema to `SCHEMA_VERSION` (once, whoever starts first); the shared secret."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS proto_server_schema (version integer NOT NULL)")
        row = conn.execute("SELECT version FROM proto_server_schema").fetchone()
        version = 0 if row is None else int(row[0])
        if version > SCHEMA_VERSION:
            raise psycopg.errors.FeatureNotSupported(
                f"the store has schema version {version}, written by a newer proto-server "
                f"(this one knows {SCHEMA_VERSION})"
            )
        for statement in _MIGRATIONS[version:]:
            conn.execute(statement)
        if row is None:
            conn.execute("INSERT INTO proto_server_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
        else:
            conn.execute("UPDATE proto_server_schema SET version = %s", (SCHEMA_VERSION,))
        conn.execute(
            "INSERT INTO proto_server_secret (id, secret) VALUES (1, %s) ON CONFLICT DO NOTHING",
            (secrets.token_bytes(32),),
        )
        secret = conn.execute("SELECT secret FROM proto_server_secret WHERE id = 1").fetchone()
    assert secret is not None
    return bytes(secret[0])
