"""The SQLite store's SQL, and the small process that runs it for a file store.

SQLite maps a WAL database's index (the `-shm` file) into memory. If that file faults (made
immutable, truncated under the mapping, a full disk under a sparse page), the next access is a
SIGBUS, which no Python code can catch: it would kill the whole server. So every connection to
a file runs in a process of its own (this module run as a script, only the standard library
imported): a fault kills that process, the call that met it fails `store_unavailable`, and the
server starts another. A `:memory:` database has no file to fault; it runs these same
functions in the server's process.

The protocol on the child's stdin and stdout: one length-prefixed pickle each way per call,
`(op, busy_ms, args)` in, `("ok", result)`, `("fenced", None)` or `("error", (kind, name,
message))` out. Its first message is the outcome of opening the database.
"""

from __future__ import annotations

import pickle
import signal
import sqlite3
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

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
)
SCHEMA_VERSION = len(MIGRATIONS)

#: A stored row as it travels: (response JSON, items JSON, previous_response_id).
Row = tuple[bytes, bytes, "str | None"]


class Fenced(Exception):
    """A write named a suspension version that is no longer the stored one."""


def connect(path: str, timeout_s: float, *, writer: bool) -> sqlite3.Connection:
    """The connection of a writer (WAL set, the schema migrated) or of a reader."""
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


# -- the operations: plain values in, plain values out ---------------------------------------


def put(
    db: sqlite3.Connection, row: tuple[Any, ...], item_ids: list[str],
    ends_suspension: int | None, older_than: float, keep: int,
) -> None:  # fmt: skip
    """Store a row and the ids of its items; prune to the retention limit, the items' ids of
    what is pruned with it."""
    response_id, owner = row[0], row[-1]
    with db:  # one transaction: all of it, or none of it
        db.execute("BEGIN IMMEDIATE")
        if ends_suspension is not None:
            _end_suspension(db, response_id, ends_suspension)
        db.execute(
            "INSERT OR REPLACE INTO responses (id, previous_response_id, created_at, "
            "stored_at, response, items, owner) VALUES (?, ?, ?, ?, ?, ?, ?)",
            row,
        )
        db.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))
        db.executemany(
            "INSERT OR IGNORE INTO response_items (owner, item_id, response_id) VALUES (?, ?, ?)",
            [(owner, item_id, response_id) for item_id in item_ids],
        )
        # the oldest go first (by age, then past the count): both are a tail by stored_at
        gone = db.execute(
            "SELECT id FROM responses WHERE stored_at < ? UNION SELECT id FROM "
            "(SELECT id FROM responses ORDER BY stored_at DESC LIMIT -1 OFFSET ?)",
            (older_than, keep),
        ).fetchall()
        for (old,) in gone:
            _delete(db, old)


def _delete(db: sqlite3.Connection, response_id: str) -> None:
    db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
    db.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))


def delete(db: sqlite3.Connection, response_id: str, owner: str) -> bool:
    """Delete `owner`'s stored response `response_id`; whether there was one."""
    with db:
        db.execute("BEGIN IMMEDIATE")
        found = db.execute(
            "SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        ).fetchone()
        if found is not None:
            _delete(db, response_id)
    return found is not None


#: Ids looked up by one statement (SQLite's limit on parameters is far above it).
ITEMS_PER_QUERY = 500


def items(
    db: sqlite3.Connection, owner: str, item_ids: list[str]
) -> tuple[dict[str, str], dict[str, bytes]]:
    """Where `owner`'s items of these ids are: each found id's response (the newest stored that
    holds it), and those responses' items."""
    newest: dict[str, tuple[float, str]] = {}
    blobs: dict[str, bytes] = {}
    with db:  # one read transaction
        db.execute("BEGIN")
        for start in range(0, len(item_ids), ITEMS_PER_QUERY):
            some = item_ids[start : start + ITEMS_PER_QUERY]
            rows = db.execute(
                "SELECT i.item_id, r.id, r.stored_at, r.items FROM response_items i "
                "JOIN responses r ON r.id = i.response_id WHERE i.owner = ? AND i.item_id IN "
                f"({', '.join('?' * len(some))})",
                (owner, *some),
            )
            for item_id, response_id, stored_at, blob in rows:
                if item_id not in newest or stored_at > newest[item_id][0]:
                    newest[item_id] = (stored_at, response_id)
                    blobs[response_id] = blob
    where = {item_id: response_id for item_id, (_, response_id) in newest.items()}
    held = set(where.values())
    return where, {response_id: blob for response_id, blob in blobs.items() if response_id in held}


def _end_suspension(db: sqlite3.Connection, response_id: str, version: int) -> None:
    gone = db.execute("DELETE FROM suspended WHERE id = ? AND version = ?", (response_id, version))
    if gone.rowcount != 1:
        raise Fenced
    db.execute("DELETE FROM suspended_items WHERE id = ?", (response_id,))


def suspend(
    db: sqlite3.Connection, response_id: str, owner: str, now: float, state: bytes,
    items_count: int, since: int, new: bytes | None, expected: int, older_than: float,
    keep: int,
) -> None:  # fmt: skip
    with db:
        db.execute("BEGIN IMMEDIATE")
        if expected == 0:
            try:
                db.execute(
                    "INSERT INTO suspended (id, owner, stored_at, version, claimed, "
                    "items_count, state) VALUES (?, ?, ?, 1, 0, ?, ?)",
                    (response_id, owner, now, items_count, state),
                )
            except sqlite3.IntegrityError:
                raise Fenced from None
        else:
            moved = db.execute(
                "UPDATE suspended SET state = ?, version = ?, claimed = 0, stored_at = ?, "
                "items_count = ? WHERE id = ? AND version = ?",
                (state, expected + 1, now, items_count, response_id, expected),
            )
            if moved.rowcount != 1:
                raise Fenced
        if new is not None:
            db.execute(
                "INSERT OR REPLACE INTO suspended_items (id, start, items) VALUES (?, ?, ?)",
                (response_id, since, new),
            )
        old = [
            row[0]
            for row in db.execute(
                "SELECT id FROM suspended WHERE stored_at < ? UNION SELECT id FROM "
                "(SELECT id FROM suspended ORDER BY stored_at DESC LIMIT -1 OFFSET ?)",
                (older_than, keep),
            )
        ]
        for gone in old:
            db.execute("DELETE FROM suspended WHERE id = ?", (gone,))
            db.execute("DELETE FROM suspended_items WHERE id = ?", (gone,))


def suspended(
    db: sqlite3.Connection, response_id: str, owner: str
) -> tuple[bytes, int, int, float, list[bytes]] | None:
    """(state, version, claimed, stored_at, item chunks in order), or None."""
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
    return row[0], int(row[1]), int(row[2]), float(row[4]), [chunk[0] for chunk in chunks]


def claim(
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


def release(db: sqlite3.Connection, response_id: str, version: int) -> None:
    db.execute(
        "UPDATE suspended SET claimed = 0 WHERE id = ? AND version = ?", (response_id, version)
    )


def get(db: sqlite3.Connection, response_id: str, owner: str) -> Row | None:
    row = db.execute(
        "SELECT response, items, previous_response_id FROM responses WHERE id = ? AND owner = ?",
        (response_id, owner),
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def chain(db: sqlite3.Connection, response_id: str, owner: str) -> list[Row] | None:
    """The rows from `response_id` back to the first of its chain (newest first)."""
    rows: list[Row] = []
    next_id: str | None = response_id
    seen = set()
    with db:  # one read transaction: the chain as of one moment
        db.execute("BEGIN")
        while next_id is not None and next_id not in seen:
            seen.add(next_id)
            row = get(db, next_id, owner)
            if row is None:
                return None
            rows.append(row)
            next_id = row[2]
    return rows


def count(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT count(*) FROM responses").fetchone()[0])


OPS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (put, delete, items, suspend, suspended, claim, release, get, chain, count)
}


def run(db: sqlite3.Connection, op: str, busy_ms: int, args: tuple[Any, ...]) -> Any:
    db.execute(f"PRAGMA busy_timeout = {busy_ms}")
    return OPS[op](db, *args)


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
            op, busy_ms, args = receive(requests)
        except EOFError:
            db.close()
            return 0
        try:
            send(replies, ("ok", run(db, op, busy_ms, args)))
        except Fenced:
            send(replies, ("fenced", None))
        except sqlite3.Error as exc:
            send(replies, failure(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
