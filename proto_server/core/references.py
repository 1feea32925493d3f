"""`item_reference` input items: an earlier item named by its id, replaced by the item itself
before anything renders it, so the model reads what was referenced.

A client that stores its responses may send references instead of the items (the Vercel AI
SDK, with `store: true`, replaces each earlier assistant reply of a resent history by one). A
reference is resolved from the conversation it continues first (the chain of
`previous_response_id`, warm or stored), then from every response its owner stored; one found
nowhere is refused, naming it, so no history is served with a hole in it.

A reference is a few dozen bytes that may stand for megabytes, and may be repeated: what a
request costs is what its references expand to, measured from the items found (`expansion`)
and bounded (`check_expansion`) before anything is rendered; what the store reads to find them
is bounded before it is read (`check_stored`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from proto_server.core.conversation import item_bytes
from proto_server.core.ids import new_id
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.items import ID_PREFIXES, Item, UnknownItem, item_id, with_id

REFERENCE = "item_reference"
#: Where a reference is looked for, as its refusal says.
LOOKED_IN = (
    "in the conversation this request continues, nor an item of a response stored "
    "(store: true) with this API key"
)


def references(items: Sequence[Item]) -> dict[str, int]:
    """The ids `items` reference, each with the index of its first reference; a malformed
    reference (no string `id`) is refused."""
    wanted: dict[str, int] = {}
    for index, item in enumerate(items):
        if not (isinstance(item, UnknownItem) and item.type == REFERENCE):
            continue
        named = item.raw.get("id")
        if not isinstance(named, str) or not named:
            raise ProtocolError(
                "invalid_field",
                f"`input[{index}]` is an item_reference without an `id`; send "
                '{"type": "item_reference", "id": "<an item id>"}.',
                param=f"input[{index}].id",
            )
        wanted.setdefault(named, index)
    return wanted


def find_in(history: Sequence[Item], wanted: Sequence[str]) -> dict[str, Item]:
    """Those of `wanted` that name an item of `history`, newest first, stopping once all are
    found (a reference is most often to what was just said: a long history is not walked)."""
    missing = set(wanted)
    found: dict[str, Item] = {}
    for item in reversed(history):
        if not missing:
            break
        named = item_id(item)
        if named in missing:
            missing.discard(named)
            found[named] = item
    return found


@attrs.frozen
class Expansion:
    """What a request's references expand to: how many there are, and what the items they name
    hold in memory (`item_bytes`), each counted as often as it is named."""

    references: int = 0
    nbytes: int = 0

    def __str__(self) -> str:
        return f"{self.references:,} item_references expanding to {self.nbytes / 2**20:.1f} MiB"


def expansion(items: Sequence[Item], found: Mapping[str, Item]) -> Expansion:
    """What `items`' references to `found` expand to, without building the expansion: each
    item named is measured once, however often it is named (one not found is `resolve`'s)."""
    sizes: dict[str, int] = {}
    count = nbytes = 0
    for item in items:
        if isinstance(item, UnknownItem) and item.type == REFERENCE:
            named = item.raw.get("id")
            if isinstance(named, str) and named in found:
                if named not in sizes:
                    sizes[named] = item_bytes(found[named])
                count += 1
                nbytes += sizes[named]
    return Expansion(count, nbytes)


def check_expansion(expanded: Expansion, limit: int) -> None:
    """Refuse references that expand past `limit` (`--max-message-bytes`): the most one request
    may carry, so referencing an item is no way round it (a 5 KB body naming a 4 MB item 100
    times would otherwise be rendered as 400 MB)."""
    if expanded.nbytes > limit:
        raise ProtocolError(
            "message_too_large",
            f"`input` has {expanded}, each referenced item counted as often as it is named: "
            f"over the limit of {limit} bytes (--max-message-bytes) one request may carry. "
            "Reference each item once, or send less (continue with previous_response_id and "
            "only new items).",
            param="input",
            status=413,
        )


def check_stored(found: int, nbytes: int, limit: int) -> None:
    """Refuse references to stored items whose responses hold more than `limit` bytes of JSON
    (`--max-message-bytes`), checked by the store before it reads them: what a request may
    carry inline is all it may load by reference (a 50 KB body naming 1,000 different 4 MB
    items would otherwise load 4 GB to find it too large). A stored item is read with the
    response that holds it, so each such response counts, once, at its stored length: for
    ASCII text JSON need not escape, less than the `item_bytes` of what it holds (the keys
    cost 100-180 bytes an item, the estimate 240-440), so where it holds only what is named,
    nothing is refused here that `check_expansion` would let through."""
    if nbytes > limit:
        raise ProtocolError(
            "message_too_large",
            f"`input` references {found:,} stored items whose responses hold "
            f"{nbytes / 2**20:.1f} MiB of JSON: over the limit of {limit} bytes "
            "(--max-message-bytes) one request may carry, inline or by reference. Reference "
            "fewer stored items at a time (continue with previous_response_id and only new "
            "items).",
            param="input",
            status=413,
        )


def resolve(items: Sequence[Item], found: Mapping[str, Item]) -> tuple[Item, ...]:
    """`items` with every reference replaced by the item it names; one not in `found` is a 400
    naming it and where it is in `input`."""
    resolved: list[Item] = []
    for index, item in enumerate(items):
        if isinstance(item, UnknownItem) and item.type == REFERENCE:
            named = str(item.raw.get("id"))
            if named not in found:
                raise ProtocolError(
                    "item_not_found",
                    f"Item {quoted(named)} referenced by `input[{index}]` not found: it is not "
                    f"{LOOKED_IN}. Send the item itself instead of a reference.",
                    param=f"input[{index}]",
                )
            item = found[named]
        resolved.append(item)
    return tuple(resolved)


def with_ids(items: Sequence[Item]) -> tuple[Item, ...]:
    """`items`, each without an id given one (`msg_...` for a message, as OpenAI's): a stored
    item is listed, and may be referenced, by its id."""
    return tuple(
        item if item_id(item) else with_id(item, new_id(ID_PREFIXES.get(item.type, "item")))
        for item in items
    )
