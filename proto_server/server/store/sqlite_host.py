"""The SQLite store's schema, and the small process that runs the shared SQL for a file store.

SQLite maps a WAL database's index (the `-shm` file) into memory. If that file faults (made
immutable, truncated under the mapping, a full disk under a sparse page), the next access is a
SIGBUS, which no Python code can catch: it would kill the whole server. So every connection to
a file runs in a process of its own (this module run as a script, only the standard library
imported): a fault kills that process, the call that met it fails `store_unavailable`, and the
server starts another. A `:memory:` database has no file to fault; it runs these same
functions in the server's process. The statements themselves are sql.py's, shared with
PostgreSQL; what is SQLite's own is here: its column types and migrations, and its transactions.

The protocol on the child's stdin and stdout: one length-prefixed pickle each way per call,
`(op, until, args)` in, `("ok", result)`, `("fenced", None)` or `("error", (kind, name,
message))` out. Its first message is the outcome of opening the database.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import sqlite3
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

if __package__:
    from proto_server.server.store import sql
else:  # the child (-I, run as a script): sql.py beside it, which needs only the standard library
    # (loaded by its path: an installed module named `sql` must not stand in for it)
    _spec = importlib.util.spec_from_file_location(
        "proto_server_sql", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sql.py")
    )
    assert _spec is not None and _spec.loader is not None
    sql = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sql)

SCHEMA = (
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
MIGRATIONS = (
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
    # 5-7: which stored response holds each item id (`item_reference`), filled for old rows
    """CREATE TABLE response_items (
        owner TEXT NOT NULL,
        item_id TEXT NOT NULL,
        response_id TEXT NOT NULL,
        PRIMARY KEY (owner, item_id, response_id)
    )""",
    "CREATE INDEX response_items_response ON response_items (response_id)",
    "INSERT OR IGNORE INTO response_items SELECT r.owner, json_extract(j.value, '$.id'), r.id "
    "FROM responses r, json_each(CAST(r.items AS TEXT)) j "
    "WHERE json_type(j.value, '$.id') = 'text'",
    # 8: what each server process sharing the engines holds and waits for (shared admission)
    """CREATE TABLE admission_peers (
        peer TEXT PRIMARY KEY,
        reserved INTEGER NOT NULL,
        waiting INTEGER NOT NULL,
        head INTEGER NOT NULL,
        seen_at REAL NOT NULL
    )""",
)
SCHEMA_VERSION = len(MIGRATIONS)


class SQLite:
    """A sqlite3 connection as `sql.Database`: the shared statements with SQLite's tables.

    `until` is the call's deadline on the monotonic clock every process of the machine shares.
    SQLite's busy timeout counts the sleeps it asked for, not the time that passed, so on a
    busy machine it can outwait the server, which by then has told the client the write
    failed: a write that comes to its commit after `until` is rolled back (and the client's
    answer stays true)."""

    def __init__(self, db: sqlite3.Connection, until: float) -> None:
        self._db = db
        self._until = until

    def execute(self, statement: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(_text(statement), params)

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        self._db.executemany(_text(statement), rows)

    @contextlib.contextmanager
    def transaction(self, *, write: bool) -> Iterator[None]:
        with self._db:  # commits, or rolls back on an exception
            self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield
            if write and time.monotonic() > self._until:
                late = sqlite3.OperationalError("the write came to its commit past its deadline")
                late.sqlite_errorname = "SQLITE_BUSY"
                raise late


def _text(statement: str) -> str:
    return sql.statement_text(statement, prefix="", placeholder="?")


#: The statements' upserts (`ON CONFLICT ... DO UPDATE`) and `true`/`false` need it.
OLDEST_SQLITE = (3, 24, 0)


def connect(path: str, timeout_s: float, *, writer: bool) -> sqlite3.Connection:
    """The connection of a writer (WAL set, the schema migrated) or of a reader."""
    if sqlite3.sqlite_version_info < OLDEST_SQLITE:
        raise sqlite3.NotSupportedError(
            f"this Python links SQLite {sqlite3.sqlite_version}; the store needs 3.24 or later "
            "(a newer Python, or --store postgresql://...)"
        )
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
    if writer:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        migrate(db)
    return db


def migrate(db: sqlite3.Connection) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        for statement in SCHEMA:
            db.execute(statement)
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"the store has schema version {version}, written by a newer proto-server "
                f"(this one knows {SCHEMA_VERSION})"
            )
        for statement in MIGRATIONS[version:]:
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


#: What a server may ask of a connection: the shared operations (sql.py), by name.
OPS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        sql.put, sql.delete, sql.items, sql.suspend, sql.suspended, sql.claim, sql.release,
        sql.get, sql.chain, sql.count, sql.publish_load, sql.withdraw,
    )
}  # fmt: skip


def run(db: sqlite3.Connection, op: str, until: float, args: tuple[Any, ...]) -> Any:
    """Run the operation `op`, waiting for a lock until `until` (`time.monotonic()`) at most."""
    busy_ms = max(1, int((until - time.monotonic()) * 1000))
    db.execute(f"PRAGMA busy_timeout = {busy_ms}")
    return OPS[op](SQLite(db, until), *args)


# -- the child process ------------------------------------------------------------------------

_LENGTH = struct.Struct("!I")


def send(stream: IO[bytes], message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    """The next message, or EOFError when the other side is gone."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError
    (length,) = _LENGTH.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        raise EOFError
    return pickle.loads(payload)


def failure(exc: sqlite3.Error) -> tuple[str, tuple[str, str, str]]:
    kind = type(exc).__name__ if hasattr(sqlite3, type(exc).__name__) else "DatabaseError"
    return "error", (kind, getattr(exc, "sqlite_errorname", ""), str(exc))


def main(argv: list[str]) -> int:
    """`sqlite_host.py PATH TIMEOUT_S reader|writer`: serve calls until stdin closes."""
    # it lives exactly as long as its server holds the pipe: a terminal's Ctrl-C or a signal to
    # the process group is the server's to handle (it may still store while it drains)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path, timeout_s, role = argv[0], float(argv[1]), argv[2]
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the protocol's stream
    try:
        db = connect(path, timeout_s, writer=role == "writer")
    except sqlite3.Error as exc:
        send(replies, failure(exc))
        return 1
    send(replies, ("ok", None))
    while True:
        try:
            op, until, args = receive(requests)
        except EOFError:
            db.close()
            return 0
        try:
            send(replies, ("ok", run(db, op, until, args)))
        except sql.Fenced:
            send(replies, ("fenced", None))
        except sqlite3.Error as exc:
            send(replies, failure(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
