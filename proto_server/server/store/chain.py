"""A chain of stored Responses as the history a continuing turn is served from: the one
lookup of both HTTP and the WebSocket dialects."""

from __future__ import annotations

from collections.abc import Sequence

from proto_server.core.compaction import compacted_prompt
from proto_server.server.store.interfaces import ResponseStore
from proto_server.server.store.records import StoredResponse
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.items import Item

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
