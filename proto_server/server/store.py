"""The persisted store: `store: true` responses, so a chain survives a reconnect or a restart.

Behind a small interface (`ResponseStore`), so that a shared store (postgres.py) can serve
several server processes. The default is embedded SQLite in WAL mode, one transaction per
write, so a crash in the middle of a write leaves the previous state intact. Its blocking calls
run in worker threads, each connection to a file in a child process (sqlite_host.py), so that a
fault of the file's memory mapping (a SIGBUS) kills that process, not the server.

A stored response belongs to its owner (the API key that created it, as an opaque id; with auth
off, one anonymous owner): a lookup by another owner finds nothing. Every failure of the store,
and every call that takes longer than its timeout, is a `StoreUnavailable`: the Response or the
lookup fails, never the connection. Writes go one at a time through one connection; reads of a
file have connections of their own, so they do not queue behind a write that waits for a lock.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import orjson
import trio

from proto_server.core.compaction import compacted_prompt
from proto_server.core.ranges import at_least, positive, positive_finite
from proto_server.core.settings import setting
from proto_server.server import sqlite_host
from proto_server.server.logs import log
from proto_server.wire.converter import converter
from proto_server.wire.errors import ProtocolError, ServerFault, quoted
from proto_server.wire.items import Item, item_id
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


def decode_items(items: bytes) -> tuple[Item, ...]:
    return tuple(converter.structure(orjson.loads(items), list[Item]))  # type: ignore[arg-type,unused-ignore]


def decode_row(response: bytes, items: bytes, owner: str) -> StoredResponse:
    return StoredResponse(
        response=converter.structure(orjson.loads(response), Response),
        items=decode_items(items),
        owner=owner,
    )


def stored_item_ids(stored: StoredResponse) -> list[str]:
    """The ids of a stored response's items, each once: what `item_reference` may name."""
    return list(dict.fromkeys(found for item in stored.items if (found := item_id(item))))


def found_items(where: dict[str, str], blobs: dict[str, bytes]) -> dict[str, Item]:
    """The items of the ids found (`where`: each id's response; `blobs`: their items)."""
    held = {
        response_id: {item_id(item): item for item in decode_items(blob)}
        for response_id, blob in blobs.items()
    }
    return {
        wanted: held[response_id][wanted]
        for wanted, response_id in where.items()
        if wanted in held[response_id]
    }


DAY_S = 24 * 3600.0


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
        positive_finite,
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


ITEMS_FAILED = "the referenced items could not be looked up; retry shortly, or send the items"


def delete_failed(response_id: str) -> str:
    return f"response {response_id!r} could not be deleted; retry shortly"


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
class ItemStore(Protocol):
    """A store that finds stored items by their ids (what `item_reference` names) and deletes
    stored responses (`DELETE /v1/responses/{id}`); both stores do, a test's dict may not."""

    async def items(self, item_ids: Sequence[str], *, owner: str) -> dict[str, Item]:
        """Those of the ids that name an item of a response `owner` stored, with the item (from
        the newest such response, if several hold it)."""
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
class ProbedStore(Protocol):
    """A store that may be unusable while the server is up: `/readyz` asks it. A database
    server may be down; an embedded SQLite file may have been deleted or replaced."""

    async def readiness(self) -> str | None:
        """None when the store answers now, within a short timeout; otherwise why not."""
        ...


#: The schema of a file, and its migrations (sqlite_host.py, where the SQL lives).
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

    def call(self, op: str, busy_ms: int, *args: Any) -> Any:
        return sqlite_host.run(self._db, op, busy_ms, args)

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

    def call(self, op: str, busy_ms: int, *args: Any) -> Any:
        assert self._process.stdin is not None
        try:
            sqlite_host.send(self._process.stdin, (op, busy_ms, args))
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
            raise sqlite_host.Fenced
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
        """Run `fn(connection, busy_ms, *args)` in a worker thread within `timeout_s`, waiting
        for a turn included; every way it can fail becomes a `StoreUnavailable` here, and
        only here."""
        deadline = time.monotonic() + self.timeout_s

        def bounded() -> T:
            if (lost := self._check_file()) is not None:
                raise _FileLost(lost)
            if db is None:
                return fn(*args)
            left = deadline - time.monotonic() - _MARGIN_S  # after waiting for a turn
            if left <= 0:
                raise trio.TooSlowError
            return fn(db(), max(1, int(left * 1000)), *args)

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
            # a reader whose call failed may still be busy in an abandoned thread: not reused
            this = reader
            result = await self._call(trio.CapacityLimiter(1), what, lambda: this, fn, *args)
            self._readers.append(reader)
            return result

    # -- run in a worker thread: encode, call the connection, decode --------------------------

    def _put(
        self, db: _Connection, busy_ms: int, stored: StoredResponse, ends_suspension: int | None
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
        try:
            db.call(
                "put", busy_ms, row, stored_item_ids(stored), ends_suspension,
                self._clock() - self.max_age_s, self.max_responses,
            )  # fmt: skip
        except sqlite_host.Fenced:
            raise SuspensionLost(response.id) from None

    def _suspend(
        self, db: _Connection, busy_ms: int, suspended: SuspendedResponse, since: int,
        expected: int,
    ) -> None:  # fmt: skip
        response_id = suspended.response.id
        now = self._clock()
        new = suspended.items[since:]
        try:
            db.call(
                "suspend", busy_ms, response_id, suspended.owner, now,
                encode_suspended(suspended), len(suspended.items), since,
                encode_items(new) if new else None, expected, now - self.max_age_s,
                self.max_responses,
            )  # fmt: skip
        except sqlite_host.Fenced:
            raise SuspensionLost(response_id) from None

    @staticmethod
    def _suspended(
        db: _Connection, busy_ms: int, response_id: str, owner: str
    ) -> SuspendedResponse | None:
        found = db.call("suspended", busy_ms, response_id, owner)
        if found is None:
            return None
        state, version, claimed, stored_at, chunks = found
        return decode_suspended(
            state, chunks, owner=owner, version=version, claimed=bool(claimed),
            stored_at=stored_at,
        )  # fmt: skip

    @staticmethod
    def _op(db: _Connection, busy_ms: int, op: str, *args: Any) -> Any:
        return db.call(op, busy_ms, *args)

    @staticmethod
    def _get(db: _Connection, busy_ms: int, response_id: str, owner: str) -> StoredResponse | None:
        row = db.call("get", busy_ms, response_id, owner)
        return None if row is None else decode_row(row[0], row[1], owner)

    @staticmethod
    def _items(db: _Connection, busy_ms: int, item_ids: list[str], owner: str) -> dict[str, Item]:
        return found_items(*db.call("items", busy_ms, owner, item_ids))

    @staticmethod
    def _chain(
        db: _Connection, busy_ms: int, response_id: str, owner: str
    ) -> list[StoredResponse] | None:
        rows = db.call("chain", busy_ms, response_id, owner)
        if rows is None:
            return None
        return [decode_row(row[0], row[1], owner) for row in reversed(rows)]

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

    async def items(self, item_ids: Sequence[str], *, owner: str) -> dict[str, Item]:
        return await self._read(ITEMS_FAILED, self._items, list(item_ids), owner)

    async def delete(self, response_id: str, *, owner: str) -> bool:
        deleted = await self._write(
            delete_failed(response_id), self._op, "delete", response_id, owner
        )
        return bool(deleted)

    def count(self) -> int:
        return int(self._writer().call("count", int(self.timeout_s * 1000)))

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
