"""The SQL both stores share, written once: what a write, a lookup and a pruning say.

SQLite (sqlite_host.py, in a child process) and PostgreSQL (postgres.py, on a worker thread)
run these same functions on a connection that keeps to the `Database` protocol: statements are
written in the subset both speak (upserts with `ON CONFLICT`, `LIMIT ? OFFSET ?` for the count
limit, a recursive CTE for a chain, `true`/`false`) with `?` placeholders and `{responses}`,
`{items}`, `{suspended}`, `{suspended_items}`, `{peers}` for the tables; each backend's
`Database` turns a statement into its own text once (`statement_text`). What differs stays
with its backend: the column types and the migrations each database has had, the harness, and
the errors.

Only the standard library is imported: a file store's child process runs this module with
nothing else on its path.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

#: A stored row as `put` takes it: (id, previous_response_id, created_at, stored_at, response
#: JSON, items JSON, owner).
PutRow = tuple[str, "str | None", int, float, bytes, bytes, str]
#: A stored row as it is read back: (response JSON, items JSON, previous_response_id).
Row = tuple[bytes, bytes, "str | None"]
#: A suspension as it is read back: (state, version, claimed, stored_at, item chunks in order).
Suspension = tuple[bytes, int, bool, float, list[bytes]]

#: "No limit" as a LIMIT both databases take (SQLite's -1 is PostgreSQL's error).
_ALL = 2**62
#: Ids looked up by one statement (far below either database's limit on parameters).
ITEMS_PER_QUERY = 500


class Fenced(Exception):
    """A write named a suspension version that is no longer the stored one."""


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Database(Protocol):
    """One connection, in autocommit mode outside `transaction`."""

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Cursor: ...

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def transaction(self, *, write: bool) -> AbstractContextManager[Any]:
        """All of it or none of it; `write` takes the write lock first (SQLite's IMMEDIATE).
        A write still open at its call's deadline is rolled back rather than committed: the
        server has told the client by then that it failed."""
        ...


@functools.cache
def statement_text(statement: str, *, prefix: str, placeholder: str) -> str:
    """A statement of this module as a database runs it: its tables named, its placeholders."""
    return statement.format(
        responses=prefix + "responses",
        items=prefix + "response_items",
        suspended=prefix + "suspended",
        suspended_items=prefix + "suspended_items",
        peers=prefix + "admission_peers",
    ).replace("?", placeholder)


# -- stored responses ---------------------------------------------------------------------------

_UPSERT = (
    "INSERT INTO {responses} (id, previous_response_id, created_at, stored_at, response, "
    "items, owner) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
    "previous_response_id = excluded.previous_response_id, created_at = excluded.created_at, "
    "stored_at = excluded.stored_at, response = excluded.response, items = excluded.items, "
    "owner = excluded.owner"
)
_ADD_ITEM = (
    "INSERT INTO {items} (owner, item_id, response_id) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
)
_CHAIN = """
WITH RECURSIVE chain AS (
    SELECT id, previous_response_id, response, items, 0 AS depth
      FROM {responses} WHERE id = ? AND owner = ?
    UNION ALL
    SELECT r.id, r.previous_response_id, r.response, r.items, c.depth + 1
      FROM {responses} r JOIN chain c ON r.id = c.previous_response_id
     WHERE r.owner = ? AND c.depth < ?
)
SELECT response, items, previous_response_id FROM chain ORDER BY depth DESC
"""


def put(
    db: Database, row: PutRow, item_ids: Sequence[str], ends_suspension: int | None,
    older_than: float, keep: int,
) -> None:  # fmt: skip
    """Store a row and the ids of its items, ending its suspension if it had one (`Fenced` if
    that is no longer the version named); prune to the retention limit, items' ids with it."""
    response_id, owner = row[0], row[-1]
    with db.transaction(write=True):
        if ends_suspension is not None:
            gone = db.execute(
                "DELETE FROM {suspended} WHERE id = ? AND version = ?",
                (response_id, ends_suspension),
            )
            if gone.rowcount != 1:
                raise Fenced
            db.execute("DELETE FROM {suspended_items} WHERE id = ?", (response_id,))
        db.execute(_UPSERT, row)
        db.execute("DELETE FROM {items} WHERE response_id = ?", (response_id,))
        db.executemany(_ADD_ITEM, [(owner, item_id, response_id) for item_id in item_ids])
        _prune(db, "responses", "items", "response_id", older_than, keep)


def _prune(db: Database, table: str, related: str, key: str, older_than: float, keep: int) -> None:
    """Delete `table`'s rows stored before `older_than` or past the newest `keep`, and their
    rows in `related`: the oldest go first, so both are a tail by stored_at."""
    # OFFSET walks the stored_at index past the newest `keep`; both databases need a LIMIT
    # before an OFFSET. (row_number() over the table reads the same, but SQLite ranks every
    # row: 13-24 ms a write at 10,000 rows against 0.5 ms.)
    old = db.execute(
        f"SELECT id, stored_at FROM {{{table}}} WHERE stored_at < ? UNION SELECT id, stored_at "
        f"FROM (SELECT id, stored_at FROM {{{table}}} ORDER BY stored_at DESC LIMIT ? OFFSET ?) "
        "AS past",
        (older_than, _ALL, keep),
    ).fetchall()
    # as selected: a row another process stored again since (PostgreSQL) is not the one pruned
    db.executemany(
        f"DELETE FROM {{{related}}} WHERE {key} IN "
        f"(SELECT id FROM {{{table}}} WHERE id = ? AND stored_at = ?)",
        old,
    )
    db.executemany(f"DELETE FROM {{{table}}} WHERE id = ? AND stored_at = ?", old)


def delete(db: Database, response_id: str, owner: str) -> bool:
    """Delete `owner`'s stored response `response_id` and its items' ids; whether there was one."""
    with db.transaction(write=True):
        gone = db.execute(
            "DELETE FROM {responses} WHERE id = ? AND owner = ?", (response_id, owner)
        )
        if gone.rowcount != 1:
            return False
        db.execute("DELETE FROM {items} WHERE response_id = ?", (response_id,))
    return True


def get(db: Database, response_id: str, owner: str) -> Row | None:
    row = db.execute(
        "SELECT response, items, previous_response_id FROM {responses} WHERE id = ? AND owner = ?",
        (response_id, owner),
    ).fetchone()
    return None if row is None else (bytes(row[0]), bytes(row[1]), row[2])


def chain(db: Database, response_id: str, owner: str, longest: int) -> list[Row] | None:
    """The rows from the first of `response_id`'s chain to it (oldest first), at most `longest`
    links back; None if it is not there or a link of it is missing."""
    rows = db.execute(_CHAIN, (response_id, owner, owner, longest)).fetchall()
    if not rows or rows[0][2] is not None:
        return None
    return [(bytes(response), bytes(items), previous) for response, items, previous in rows]


def items(
    db: Database, owner: str, item_ids: Sequence[str], max_bytes: int | None = None
) -> tuple[dict[str, str], dict[str, bytes], int]:
    """Where `owner`'s items of these ids are: each found id's response (the newest stored that
    holds it), those responses' items, and how many bytes of JSON those hold (each response
    once). Their lengths are read first, so responses past `max_bytes` in all are not read at
    all: then no items come back, only the ids' places and the bytes they would have been."""
    newest: dict[str, tuple[float, str]] = {}
    sizes: dict[str, int] = {}
    blobs: dict[str, bytes] = {}
    with db.transaction(write=False):  # the lookups as of one moment
        for some in _batches(item_ids):
            rows = db.execute(
                "SELECT i.item_id, r.id, r.stored_at, length(r.items) FROM {items} i "
                "JOIN {responses} r ON r.id = i.response_id WHERE i.owner = ? AND i.item_id IN "
                f"({', '.join('?' * len(some))})",
                (owner, *some),
            )
            for item_id, response_id, stored_at, size in rows:
                if item_id not in newest or stored_at > newest[item_id][0]:
                    newest[item_id] = (stored_at, response_id)
                    sizes[response_id] = int(size)
        where = {item_id: response_id for item_id, (_, response_id) in newest.items()}
        held = list(dict.fromkeys(where.values()))
        total = sum(sizes[response_id] for response_id in held)
        if max_bytes is not None and total > max_bytes:
            return where, blobs, total
        total = 0
        for some in _batches(held):
            rows = db.execute(
                f"SELECT id, items FROM {{responses}} WHERE id IN ({', '.join('?' * len(some))})",
                some,
            )
            for response_id, blob in rows:
                # read committed (PostgreSQL) may see a response stored again since: counted anew
                blobs[response_id] = bytes(blob)
                total += len(blobs[response_id])
    if max_bytes is not None and total > max_bytes:
        blobs.clear()
    return where, blobs, total


def _batches(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), ITEMS_PER_QUERY):
        yield ids[start : start + ITEMS_PER_QUERY]


def count(db: Database) -> int:
    return int(db.execute("SELECT count(*) FROM {responses}").fetchone()[0])


# -- suspended prototype Responses ------------------------------------------------------------


def suspend(
    db: Database, response_id: str, owner: str, now: float, state: bytes, items_count: int,
    since: int, new: bytes | None, expected: int, older_than: float, keep: int,
) -> None:  # fmt: skip
    """Write a suspension's state, and its items from `since` as one more chunk; `expected` is
    the version it replaces (0: none), `Fenced` if that is no longer the stored one."""
    with db.transaction(write=True):
        if expected == 0:
            written = db.execute(
                "INSERT INTO {suspended} (id, owner, stored_at, version, claimed, items_count, "
                "state) VALUES (?, ?, ?, 1, false, ?, ?) ON CONFLICT (id) DO NOTHING",
                (response_id, owner, now, items_count, state),
            )
        else:
            # the row is locked until commit: a claim racing this write waits, then sees the
            # version it moved to and fails; a write racing a claim fails the same way
            written = db.execute(
                "UPDATE {suspended} SET state = ?, version = ?, claimed = false, stored_at = ?, "
                "items_count = ? WHERE id = ? AND version = ?",
                (state, expected + 1, now, items_count, response_id, expected),
            )
        if written.rowcount != 1:
            raise Fenced
        if new is not None:
            db.execute(
                "INSERT INTO {suspended_items} (id, start, items) VALUES (?, ?, ?) "
                "ON CONFLICT (id, start) DO UPDATE SET items = excluded.items",
                (response_id, since, new),
            )
        _prune(db, "suspended", "suspended_items", "id", older_than, keep)


def suspended(db: Database, response_id: str, owner: str) -> Suspension | None:
    with db.transaction(write=False):  # the state and its chunks as of one moment
        # a suspension's chunks below items_count are never rewritten, so PostgreSQL's read
        # committed sees a consistent state and its chunks too
        row = db.execute(
            "SELECT state, version, claimed, items_count, stored_at FROM {suspended} "
            "WHERE id = ? AND owner = ?",
            (response_id, owner),
        ).fetchone()
        if row is None:
            return None
        chunks = db.execute(
            "SELECT items FROM {suspended_items} WHERE id = ? AND start < ? ORDER BY start",
            (response_id, row[3]),
        ).fetchall()
    return bytes(row[0]), int(row[1]), bool(row[2]), float(row[4]), [bytes(c[0]) for c in chunks]


def claim(
    db: Database, response_id: str, owner: str, version: int, now: float, lapsed_before: float
) -> bool:
    """Take a suspension to resume it: unclaimed, or claimed by someone whose claim lapsed."""
    # one statement: of racing claims the first takes the row's lock (SQLite: the one writer;
    # PostgreSQL: read committed re-checks the WHERE against the row the winner wrote) and wins
    with db.transaction(write=True):  # a claim past its deadline must not land either
        won = db.execute(
            "UPDATE {suspended} SET claimed = true, version = version + 1, stored_at = ? "
            "WHERE id = ? AND owner = ? AND version = ? AND (NOT claimed OR stored_at < ?)",
            (now, response_id, owner, version, lapsed_before),
        )
        return won.rowcount == 1


def release(db: Database, response_id: str, version: int) -> None:
    db.execute(
        "UPDATE {suspended} SET claimed = false WHERE id = ? AND version = ?",
        (response_id, version),
    )


# -- the loads of the server processes that share the engines (shared admission) -----------


def publish_load(
    db: Database, peer: str, load: tuple[int, int, int], now: float, stale_before: float
) -> list[tuple[str, int, int, int]]:
    """Write `peer`'s load (reserved, waiting, head), forget the processes not heard from
    since `stale_before` (gone), and read the others' (peer first), all as of one moment."""
    with db.transaction(write=True):
        db.execute(
            "INSERT INTO {peers} (peer, reserved, waiting, head, seen_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (peer) DO UPDATE SET reserved = excluded.reserved, "
            "waiting = excluded.waiting, head = excluded.head, seen_at = excluded.seen_at",
            (peer, *load, now),
        )
        db.execute("DELETE FROM {peers} WHERE seen_at < ?", (stale_before,))
        rows = db.execute(
            "SELECT peer, reserved, waiting, head FROM {peers} WHERE peer <> ? ORDER BY peer",
            (peer,),
        ).fetchall()
    return [(str(p), int(r), int(w), int(h)) for p, r, w, h in rows]


def withdraw(db: Database, peer: str) -> None:
    """`peer` stops: the others share the room without it at once."""
    db.execute("DELETE FROM {peers} WHERE peer = ?", (peer,))
