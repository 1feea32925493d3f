"""The persisted store: `store: true` responses, so a chain survives a reconnect or a restart.

Behind a small interface (`ResponseStore`), so that a shared store (postgres.py) can serve
several server processes. The default is embedded SQLite (sqlite.py) in WAL mode, one
transaction per write, so a crash in the middle of a write leaves the previous state intact.
Its blocking calls run in worker threads, each connection to a file in a child process
(sqlite_host.py), so that a fault of the file's memory mapping (a SIGBUS) kills that process,
not the server.

A stored response belongs to its owner (the API key that created it, as an opaque id; with auth
off, one anonymous owner): a lookup by another owner finds nothing. Every failure of the store,
and every call that takes longer than its timeout, is a `StoreUnavailable`: the Response or the
lookup fails, never the connection. Writes go one at a time through one connection; reads of a
file have connections of their own, so they do not queue behind a write that waits for a lock.

A module per idea: records.py (what is kept, and its stored form), errors.py, location.py,
retention.py, interfaces.py (what the server asks of a store), chain.py (a chain as a history),
sql.py (the SQL both backends run, written once), sqlite.py with sqlite_host.py (the embedded
backend) and postgres.py (the shared one, imported only when a postgresql:// URL is given:
psycopg is optional).
"""

from proto_server.server.store.chain import (
    STORED,
    chain_items,
    history_of,
    previous_response_not_found,
)
from proto_server.server.store.errors import (
    ITEMS_FAILED,
    LOADS_FAILED,
    PUT_FAILED,
    SUSPEND_FAILED,
    StoreError,
    StoreUnavailable,
    SuspensionLost,
    chain_failed,
    delete_failed,
    get_failed,
    resume_failed,
)
from proto_server.server.store.interfaces import (
    FileStore,
    ItemStore,
    LoadStore,
    ProbedStore,
    ResponseStore,
    SuspensionStore,
)
from proto_server.server.store.location import is_postgres_url, redact
from proto_server.server.store.records import (
    ANONYMOUS,
    StoredResponse,
    SuspendedResponse,
    decode_items,
    decode_row,
    decode_suspended,
    encode_items,
    encode_suspended,
    found_items,
    owner_id,
    put_row,
    stored_item_ids,
)
from proto_server.server.store.retention import DAY_S, DEFAULT_RETENTION, StoreRetention
from proto_server.server.store.sqlite import READERS, SCHEMA_VERSION, SQLiteStore

__all__ = [
    "ANONYMOUS",
    "DAY_S",
    "DEFAULT_RETENTION",
    "ITEMS_FAILED",
    "LOADS_FAILED",
    "PUT_FAILED",
    "READERS",
    "SCHEMA_VERSION",
    "STORED",
    "SUSPEND_FAILED",
    "FileStore",
    "ItemStore",
    "LoadStore",
    "ProbedStore",
    "ResponseStore",
    "SQLiteStore",
    "StoreError",
    "StoreRetention",
    "StoreUnavailable",
    "StoredResponse",
    "SuspendedResponse",
    "SuspensionLost",
    "SuspensionStore",
    "chain_failed",
    "chain_items",
    "decode_items",
    "decode_row",
    "decode_suspended",
    "delete_failed",
    "encode_items",
    "encode_suspended",
    "found_items",
    "get_failed",
    "history_of",
    "is_postgres_url",
    "owner_id",
    "previous_response_not_found",
    "put_row",
    "redact",
    "resume_failed",
    "stored_item_ids",
]
