"""The embedded store: SQLite in WAL mode, one transaction per write; each connection to a
file in a child process (sqlite_host.py), so a fault of its memory mapping kills that process,
not the server. Blocking calls run in worker threads, writes one at a time, reads on
connections of their own.

`_call` is the one place every failure of the store becomes a
`StoreUnavailable` (a timeout, a lock, a dead child process, a lost file), and the connections are
what it sees fail (`_Child` rebuilds sqlite3's errors with the `sqlite_errorname` that `_call`
reads). Apart, the failures and what they become would be read in two files.
"""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from proto_server.core.shared_capacity import Load
from proto_server.server.process.logs import log
from proto_server.server.store import sql, sqlite_host
from proto_server.server.store.errors import (
    ITEMS_FAILED,
    LOADS_FAILED,
    PUT_FAILED,
    SUSPEND_FAILED,
    StoreUnavailable,
    SuspensionLost,
    chain_failed,
    delete_failed,
    get_failed,
    resume_failed,
)
from proto_server.server.store.records import (
    ANONYMOUS,
    StoredResponse,
    SuspendedResponse,
    decode_row,
    decode_suspended,
    encode_items,
    encode_suspended,
    found_items,
    put_row,
    stored_item_ids,
)
from proto_server.server.store.retention import DEFAULT_RETENTION, StoreRetention
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import Item

T = TypeVar("T")


#: Reader connections of a file store (a write never waits for them, nor they for it).
READERS = 4

#: SQLite gives up waiting for a lock this long before the call's deadline, so the call ends
#: by itself and its thread is not left behind holding the connection.
_MARGIN_S = 0.05


#: The schema of a file, and its migrations (sqlite_host.py; the statements are sql.py's).
_SCHEMA, _MIGRATIONS = sqlite_host.SCHEMA, sqlite_host.MIGRATIONS
SCHEMA_VERSION = sqlite_host.SCHEMA_VERSION

#: The script a file store's connections run in, each in a process of its own (sqlite_host.py).
_HOST = str(Path(sqlite_host.__file__))
#: `/readyz` waits this long at most for the store file's `stat` (a hung disk).
_PROBE_S = 2.0


class _StoreProcessDied(Exception):
    """The process of a connection died (a SIGBUS from a faulting `-shm` mapping, a kill)."""


class _InProcess:
    """A `:memory:` database: its SQL runs here (there is no file whose mapping could fault)."""

    def __init__(self, timeout_s: float) -> None:
        self._db = sqlite_host.connect(":memory:", timeout_s, writer=True)

    @property
    def alive(self) -> bool:
        return True

    def call(self, op: str, until: float, *args: Any) -> Any:
        return sqlite_host.run(self._db, op, until, args)

    def close(self) -> None:
        self._db.close()


class _Child:
    """One connection to a file, held by a child process (sqlite_host.py): a fault of the
    file's mappings kills that process, and the call fails instead of the server."""

    def __init__(self, path: str, timeout_s: float, *, writer: bool) -> None:
        role = "writer" if writer else "reader"
        # -I: only the standard library, never a module of this directory (http.py, logs.py)
        self._process = subprocess.Popen(
            [sys.executable, "-I", _HOST, path, repr(timeout_s), role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._dead = False
        try:
            self._reply()  # the outcome of opening the database
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return not self._dead and self._process.poll() is None

    def call(self, op: str, until: float, *args: Any) -> Any:
        assert self._process.stdin is not None
        try:
            sqlite_host.send(self._process.stdin, (op, until, args))
        except OSError:
            raise self._died() from None
        return self._reply()

    def _reply(self) -> Any:
        assert self._process.stdout is not None
        try:
            status, value = sqlite_host.receive(self._process.stdout)
        except (EOFError, OSError):
            raise self._died() from None
        if status == "ok":
            return value
        if status == "fenced":
            raise sql.Fenced
        kind, name, message = value
        error = getattr(sqlite3, kind, sqlite3.DatabaseError)(message)
        error.sqlite_errorname = name
        raise error

    def _died(self) -> _StoreProcessDied:
        self._dead = True
        try:
            status = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its pipe broke, yet it lives: it is of no use
            self._process.kill()
            status = self._process.wait()
        how = f"died of {signal.Signals(-status).name}" if status < 0 else f"exited ({status})"
        log.error("store.process_died", extra={"pid": self._process.pid, "how": how})
        return _StoreProcessDied(f"its process {how}; the next call starts another")

    def close(self) -> None:
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()  # it sees the end of its input and exits
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck on a hung disk
            self._process.kill()
            self._process.wait()


_Connection = _InProcess | _Child


class SQLiteStore:
    """Responses in one SQLite file (or `:memory:`), pruned to a retention limit.

    Each connection to a file lives in a child process (sqlite_host.py says why); every call
    first checks that the file at the path is still the one opened (`file_lost`)."""

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
        self._memory = self.path == ":memory:"
        self._db = self._connect()
        # which file was opened, so that one deleted or replaced under the server is noticed
        self._identity = None if self._memory else _identity(os.stat(self.path))
        self._lost: str | None = None
        self._lost_lock = threading.Lock()
        self._probe_limiter = trio.CapacityLimiter(1)
        self._write_limiter = trio.CapacityLimiter(1)
        # one in-memory database is one connection: its reads take turns with its writes
        self._read_limiter = self._write_limiter if self._memory else trio.CapacityLimiter(READERS)
        self._readers: list[_Connection] = []
        self._all_readers: list[_Connection] = []

    def _connect(self, writer: bool = True) -> _Connection:
        if self._memory:
            return _InProcess(self.timeout_s)
        return _Child(self.path, self.timeout_s, writer=writer)

    def _writer(self) -> _Connection:
        """The writing connection: a new one if the last one's process died."""
        if not self._db.alive:
            self._db.close()
            self._db = self._connect()
        return self._db

    @property
    def file_lost(self) -> str | None:
        """Why the file at the path is no longer the one open (as the last check saw it)."""
        return self._lost

    def _check_file(self) -> str | None:
        """Compare the path's file with the one opened (a `stat`: no I/O of the database)."""
        if self._identity is None:
            return None
        try:
            now: tuple[int, int] | None = _identity(os.stat(self.path))
        except FileNotFoundError:
            now = None
        except OSError as exc:
            return f"the SQLite store's file {self.path} cannot be checked ({exc})"
        problem = None
        if now != self._identity:
            what = "was deleted" if now is None else "was replaced by another file"
            problem = (
                f"the SQLite store's file {self.path} {what} while the server had it open "
                "(what it stores now would be lost at a restart)"
            )
        with self._lost_lock:  # logged once when it goes, once if it comes back
            if problem != self._lost:
                if problem is None:
                    log.warning("store.file_back", extra={"path": self.path})
                else:
                    log.error("store.file_lost", extra={"path": self.path, "why": what})
                self._lost = problem
        return problem

    async def readiness(self) -> str | None:
        """Whether the file at the path is still the one open (`:memory:` always is)."""
        if self._memory:
            return None
        limit = min(self.timeout_s, _PROBE_S)
        with trio.move_on_after(limit):
            return await trio.to_thread.run_sync(
                self._check_file, limiter=self._probe_limiter, abandon_on_cancel=True
            )
        return f"the SQLite store's file {self.path} did not answer a stat within {limit:g} s"

    async def _call(
        self,
        limiter: trio.CapacityLimiter,
        what: str,
        db: Callable[[], _Connection] | None,
        fn: Callable[..., T],
        *args: Any,
    ) -> T:
        """Run `fn(connection, until, *args)` in a worker thread within `timeout_s`, waiting
        for a turn included; every way it can fail becomes a `StoreUnavailable` here, and
        only here."""
        deadline = time.monotonic() + self.timeout_s

        def bounded() -> T:
            if (lost := self._check_file()) is not None:
                raise _FileLost(lost)
            if db is None:
                return fn(*args)
            until = deadline - _MARGIN_S  # what is left after waiting for a turn
            if until <= time.monotonic():
                raise trio.TooSlowError
            return fn(db(), until, *args)

        try:
            with trio.fail_after(self.timeout_s):
                # abandoned only if SQLite hangs past its busy timeout (a stuck disk): the
                # thread keeps its limiter slot until it ends, so no two share a connection
                return await trio.to_thread.run_sync(
                    bounded, limiter=limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            why = ""
        except _FileLost as exc:
            raise StoreUnavailable(f"The response store is unavailable: {exc}, so {what}.") from exc
        except (sqlite3.Error, _StoreProcessDied) as exc:
            name = getattr(exc, "sqlite_errorname", "")
            if not name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
                raise StoreUnavailable(f"The response store failed ({exc}), so {what}.") from exc
            why = ": another writer holds its lock"
        raise StoreUnavailable(
            f"The response store did not answer within {self.timeout_s:g} s (--store-timeout)"
            f"{why}, so {what}."
        )

    async def _write(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        return await self._call(self._write_limiter, what, self._writer, fn, *args)

    async def _read(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._memory:
            return await self._call(self._read_limiter, what, self._writer, fn, *args)
        async with self._read_limiter:  # as many idle readers as free slots
            reader = self._readers.pop() if self._readers else None
            if reader is None:
                reader = await self._call(trio.CapacityLimiter(1), what, None, self._connect, False)
                self._all_readers.append(reader)
            # a reader whose call failed may still be busy in an abandoned thread: not reused;
            # one that answered with a refusal (a lookup over its bound) is done, and is
            this = reader
            try:
                result = await self._call(trio.CapacityLimiter(1), what, lambda: this, fn, *args)
            except ProtocolError:
                self._readers.append(reader)
                raise
            self._readers.append(reader)
            return result

    # -- run in a worker thread: encode, call the connection, decode --------------------------

    def _put(
        self, db: _Connection, until: float, stored: StoredResponse, ends_suspension: int | None
    ) -> None:
        now = self._clock()
        try:
            db.call(
                "put", until, put_row(stored, now), stored_item_ids(stored), ends_suspension,
                now - self.max_age_s, self.max_responses,
            )  # fmt: skip
        except sql.Fenced:
            raise SuspensionLost(stored.response.id) from None

    def _suspend(
        self, db: _Connection, until: float, suspended: SuspendedResponse, since: int,
        expected: int,
    ) -> None:  # fmt: skip
        response_id = suspended.response.id
        now = self._clock()
        new = suspended.items[since:]
        try:
            db.call(
                "suspend", until, response_id, suspended.owner, now,
                encode_suspended(suspended), len(suspended.items), since,
                encode_items(new) if new else None, expected, now - self.max_age_s,
                self.max_responses,
            )  # fmt: skip
        except sql.Fenced:
            raise SuspensionLost(response_id) from None

    @staticmethod
    def _suspended(
        db: _Connection, until: float, response_id: str, owner: str
    ) -> SuspendedResponse | None:
        found = db.call("suspended", until, response_id, owner)
        if found is None:
            return None
        state, version, claimed, stored_at, chunks = found
        return decode_suspended(
            state, chunks, owner=owner, version=version, claimed=bool(claimed),
            stored_at=stored_at,
        )  # fmt: skip

    @staticmethod
    def _op(db: _Connection, until: float, op: str, *args: Any) -> Any:
        return db.call(op, until, *args)

    @staticmethod
    def _get(db: _Connection, until: float, response_id: str, owner: str) -> StoredResponse | None:
        row = db.call("get", until, response_id, owner)
        return None if row is None else decode_row(row[0], row[1], owner)

    @staticmethod
    def _items(
        db: _Connection, until: float, item_ids: list[str], owner: str, max_bytes: int | None
    ) -> dict[str, Item]:
        where, blobs, nbytes = db.call("items", until, owner, item_ids, max_bytes)
        return found_items(where, blobs, nbytes, max_bytes)

    def _chain(
        self, db: _Connection, until: float, response_id: str, owner: str
    ) -> list[StoredResponse] | None:
        rows = db.call("chain", until, response_id, owner, self.max_responses)
        if rows is None:
            return None
        return [decode_row(row[0], row[1], owner) for row in rows]

    # -- the interface --------------------------------------------------------------------------

    async def put(self, stored: StoredResponse, *, ends_suspension: int | None = None) -> None:
        await self._write(PUT_FAILED, self._put, stored, ends_suspension)

    async def suspend(self, suspended: SuspendedResponse, *, since: int, expected: int) -> None:
        await self._write(SUSPEND_FAILED, self._suspend, suspended, since, expected)

    async def suspended(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> SuspendedResponse | None:
        return await self._read(resume_failed(response_id), self._suspended, response_id, owner)

    async def claim(
        self, response_id: str, *, owner: str, version: int, lapsed_before: float = -math.inf
    ) -> bool:
        won = await self._write(
            resume_failed(response_id), self._op, "claim", response_id, owner, version,
            self._clock(), lapsed_before,
        )  # fmt: skip
        return bool(won)

    async def release(self, response_id: str, *, version: int) -> None:
        await self._write(resume_failed(response_id), self._op, "release", response_id, version)

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        return await self._read(get_failed(response_id), self._get, response_id, owner)

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        return await self._read(chain_failed(response_id), self._chain, response_id, owner)

    async def items(
        self, item_ids: Sequence[str], *, owner: str, max_bytes: int | None = None
    ) -> dict[str, Item]:
        return await self._read(ITEMS_FAILED, self._items, list(item_ids), owner, max_bytes)

    async def delete(self, response_id: str, *, owner: str) -> bool:
        deleted = await self._write(
            delete_failed(response_id), self._op, "delete", response_id, owner
        )
        return bool(deleted)

    async def publish_load(self, peer: str, load: Load, *, stale_s: float) -> list[Load]:
        now = self._clock()
        rows = await self._write(
            LOADS_FAILED, self._op, "publish_load", peer,
            (load.reserved, load.waiting, load.head), now, now - stale_s,
        )  # fmt: skip
        return [Load(reserved, waiting, head, other) for other, reserved, waiting, head in rows]

    async def withdraw(self, peer: str) -> None:
        await self._write(LOADS_FAILED, self._op, "withdraw", peer)

    def count(self) -> int:
        return int(self._writer().call("count", time.monotonic() + self.timeout_s))

    async def aclose(self) -> None:
        def close() -> None:
            for reader in self._all_readers:
                reader.close()
            self._db.close()

        async with self._write_limiter:
            await trio.to_thread.run_sync(close)


class _FileLost(Exception):
    """The file at the store's path is not the one open (deleted or replaced)."""


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino
