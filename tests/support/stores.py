"""Stores for the tests: one fixture that opens the store of each kind (SQLite's file, and
PostgreSQL's database, marked `postgres`), what they are given to keep, a store in a dict that
yields, another process holding a file's lock, and a store's timeout shortened for the calls
meant to fail for want of an answer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from proto_server.server.store import (
    ANONYMOUS,
    SQLiteStore,
    StoredResponse,
    records,
)
from proto_server.wire.items import Item, Message
from proto_server.wire.response import Response

#: Each kind of persisted store, as a fixture's parameters.
STORES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]

OpenStore = Callable[..., Awaitable[Any]]


@pytest.fixture(params=STORES)
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    """`await open_store(**options)`: a store of the kind the test runs for, on the test's one
    database (a file, or a new PostgreSQL database): two are two processes sharing it. Each
    is closed after the test (requested before `nursery`, after the server stopped)."""
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    opened: list[Any] = []

    async def open_(**options: Any) -> Any:
        if url is None:
            store: Any = SQLiteStore(tmp_path / "store.sqlite3", **options)
        else:
            from proto_server.server.store.postgres import PostgresStore

            store = await trio.to_thread.run_sync(partial(PostgresStore, url, **options))
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.aclose()


@pytest.fixture
async def store(open_store: OpenStore) -> Any:
    """A store of each kind, with the default retention."""
    return await open_store()


async def count(store: Any) -> int:
    """How many responses `store` keeps (SQLite's answers at once, PostgreSQL's is awaited)."""
    counted = store.count()
    return int(await counted) if isinstance(counted, Awaitable) else int(counted)


class CheckpointStore:
    """A store in a dict that yields once per call, as a real one would, without a thread
    (a worker thread would look idle to `wait_all_tasks_blocked` and end `quiet()` early)."""

    def __init__(self) -> None:
        self.responses: dict[str, StoredResponse] = {}

    async def put(self, stored: StoredResponse) -> None:
        await trio.lowlevel.checkpoint()
        self.responses[stored.response.id] = stored

    async def get(self, response_id: str, *, owner: str = ANONYMOUS) -> StoredResponse | None:
        await trio.lowlevel.checkpoint()
        stored = self.responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    async def chain(
        self, response_id: str, *, owner: str = ANONYMOUS
    ) -> list[StoredResponse] | None:
        stored = await self.get(response_id, owner=owner)
        return None if stored is None else [stored]

    async def aclose(self) -> None:
        pass


def stored(response_id: str, previous: str | None = None, text: str = "x") -> StoredResponse:
    return StoredResponse(
        response=Response(
            id=response_id,
            created_at=0,
            status="completed",
            model="m",
            previous_response_id=previous,
            output=(Message(role="assistant", content=text),),
        ),
        items=(
            Message(role="user", content=f"q {response_id}"),
            Message(role="assistant", content=text),
        ),
    )


def identified(
    response_id: str, previous: str | None = None, owner: str = ANONYMOUS
) -> StoredResponse:
    """`stored(...)` with ids on its items, as the server stores them: `q_ID` and `a_ID`."""
    plain = stored(response_id, previous, text=f"answer of {response_id}")
    question, answer = plain.items
    answer = attrs.evolve(answer, id=f"a_{response_id}")  # type: ignore[misc]
    return attrs.evolve(
        plain,
        items=(attrs.evolve(question, id=f"q_{response_id}"), answer),  # type: ignore[misc]
        response=attrs.evolve(plain.response, output=(answer,)),
        owner=owner,
    )


@contextmanager
def counting_decodes() -> Iterator[list[int]]:
    """How many stored responses' items are decoded in this process meanwhile (the first of
    the list): what a store read for an `item_reference` (a file store's child only reads)."""
    decoded = [0]
    decode = records.decode_items

    def counted(items: bytes) -> tuple[Item, ...]:
        decoded[0] += 1
        return decode(items)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records, "decode_items", counted)
        yield decoded


LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
"""


class Locker:
    """Another process holding the store file's write lock until the block ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Locker:
        self.process = subprocess.Popen(
            [sys.executable, "-c", LOCK, str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == "locked\n"
        return self

    def __exit__(self, *_: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # it lets go and exits
        assert self.process.wait(timeout=10) == 0


async def write_under_way(store: SQLiteStore) -> None:
    """Until a write of `store` has its turn (its one writer is taken): with the file locked by
    another process, it is then waiting for the lock, however long the machine took to start it."""
    while store._write_limiter.statistics().borrowed_tokens == 0:  # noqa: ASYNC110 (a state)
        await trio.sleep(0.001)


async def writer_free(store: SQLiteStore) -> None:
    """Until no write of `store` holds its one writer: the last one's thread has ended."""
    while store._write_limiter.statistics().borrowed_tokens:  # noqa: ASYNC110 (a state)
        await trio.sleep(0.001)


#: The store timeout of a test's store while it is to answer: longer than any call that can
#: succeed takes on a machine however busy. Only calls meant to fail for want of an answer (a
#: locked file, a stopped cluster) are given a short one (`timing_out`), so that they fail soon.
ANSWERING_S = 60.0


@contextmanager
def timing_out(store: Any, seconds: float) -> Iterator[None]:
    """`store`'s calls made within the block fail past `seconds` (`--store-timeout`)."""
    kept, store.timeout_s = store.timeout_s, seconds
    try:
        yield
    finally:
        store.timeout_s = kept
