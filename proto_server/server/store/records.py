"""What a store keeps: a stored Response with its items and owner, a suspended one, and
their stored form (JSON), the same in every backend."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs
import orjson

from proto_server.core.references import check_stored
from proto_server.server.store.sql import PutRow
from proto_server.wire.converter import converter, decode_stored, encode_json_bytes
from proto_server.wire.items import Item, item_id
from proto_server.wire.json_text import in_pieces
from proto_server.wire.response import Response
from proto_server.wire.tools import Tool

#: The owner of everything stored while auth is off.
ANONYMOUS = ""


def owner_id(key: str) -> str:
    """The owner id stored for an API key: a digest, so the store never holds the key."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


@attrs.frozen(kw_only=True)
class StoredResponse:
    response: Response
    #: What this Response added to the conversation, in order: its input items and its output
    #: (interleaved per segment in the prototype dialect). A chain's items are the concatenation.
    items: tuple[Item, ...]
    #: Who may read it back: `owner_id` of the key that created it, or `ANONYMOUS`.
    owner: str = ANONYMOUS


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
    #: Its create asked for logprobs (`include`): its next segments say them too.
    logprobs: bool = False
    #: Its create asked for token ids (`include`): its next segments' items carry them too.
    token_ids: bool = False
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
    in_pieces(state, levels=2)  # its tools, and its Response's
    return orjson.dumps(state)


def encode_items(items: Sequence[Item]) -> bytes:
    return encode_json_bytes(tuple(items))


def decode_suspended(
    state: bytes, chunks: Sequence[bytes], *, owner: str, version: int, claimed: bool,
    stored_at: float,
) -> SuspendedResponse:  # fmt: skip
    items: list[Item] = []
    for chunk in chunks:
        items += decode_items(chunk)
    decoded: SuspendedResponse = decode_stored(state, SuspendedResponse, items=[])
    return attrs.evolve(
        decoded, items=tuple(items), owner=owner, version=version, claimed=claimed,
        stored_at=stored_at,
    )  # fmt: skip


def put_row(stored: StoredResponse, stored_at: float) -> PutRow:
    """The row of a stored response, as every store writes it (`sql.put`): the response and
    its items as JSON."""
    response = stored.response
    return (
        response.id,
        response.previous_response_id,
        response.created_at,
        stored_at,
        # an entry at a time: one orjson call over 134,000 tools held the GIL 94 ms
        encode_json_bytes(response),
        encode_json_bytes(stored.items),
        stored.owner,
    )


def decode_items(items: bytes) -> tuple[Item, ...]:
    return tuple(decode_stored(items, list[Item]))


def decode_row(response: bytes, items: bytes, owner: str) -> StoredResponse:
    return StoredResponse(
        response=decode_stored(response, Response),
        items=decode_items(items),
        owner=owner,
    )


def stored_item_ids(stored: StoredResponse) -> list[str]:
    """The ids of a stored response's items, each once: what `item_reference` may name."""
    return list(dict.fromkeys(found for item in stored.items if (found := item_id(item))))


def found_items(
    where: dict[str, str], blobs: dict[str, bytes], nbytes: int, max_bytes: int | None
) -> dict[str, Item]:
    """The items of the ids found (`where`: each id's response; `blobs`: their items, `nbytes`
    of JSON, none read if that is past `max_bytes`: refused, `message_too_large`)."""
    if max_bytes is not None:
        check_stored(len(where), nbytes, max_bytes)
    held = {
        response_id: {item_id(item): item for item in decode_items(blob)}
        for response_id, blob in blobs.items()
    }
    return {
        wanted: held[response_id][wanted]
        for wanted, response_id in where.items()
        if wanted in held.get(response_id, ())  # one deleted meanwhile (PostgreSQL) is not found
    }
