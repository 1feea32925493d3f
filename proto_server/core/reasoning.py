"""Reasoning items a client sends back: their `encrypted_content` verified, their text restored.

A `reasoning` item's `encrypted_content` (made when a request's `include` names
`reasoning.encrypted_content`) is the reasoning text sealed with the server's secret, as
compaction items are (compaction.py): a client that keeps nothing (`store: false`) carries it
and sends it back, and the server reads the text again. A seal that does not verify is refused
where the item enters (`check_reasonings`); past that boundary `replayed` puts the text back in
the items that arrived with only the seal.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from proto_server.core.compaction import CompactionKey
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import Item, Reasoning, ReasoningText

#: What a request's `include` names to get reasoning items' `encrypted_content`.
ENCRYPTED_CONTENT = "reasoning.encrypted_content"

#: Bound into every reasoning seal, so no compaction seal verifies as one (and no other).
_DOMAIN = b"proto-server reasoning v1\n"


@attrs.frozen
class ReasoningSealer:
    """Seals a reasoning item's text with the server's key (`ResponseMachine(seal=...)`)."""

    key: CompactionKey

    def __call__(self, text: str) -> str:
        return self.key.seal_text(_DOMAIN, text)


def check_reasonings(items: Sequence[Item], key: CompactionKey, *, field: str = "input") -> None:
    """Refuse a reasoning item among a client's `items` whose `encrypted_content` this server
    did not seal (as OpenAI refuses one it cannot decrypt)."""
    for index, item in enumerate(items):
        if not isinstance(item, Reasoning) or item.encrypted_content is None:
            continue
        if key.open_text(_DOMAIN, item.encrypted_content) is None:
            raise ProtocolError(
                "invalid_encrypted_content",
                f"{field}[{index}] is a reasoning item whose encrypted_content does not verify: "
                "it was altered, made by another server, or sealed with a secret this server no "
                "longer has. Send reasoning items back exactly as this server returned them, or "
                "leave them out.",
                param=f"{field}[{index}].encrypted_content",
            )


def replayed(items: tuple[Item, ...], key: CompactionKey) -> tuple[Item, ...]:
    """`items` with each sealed reasoning item's text restored from its seal (checked by
    `check_reasonings` where it entered): the model reads it as it wrote it."""
    if not any(_sealed_only(item) for item in items):
        return items
    return tuple(_restored(item, key) if _sealed_only(item) else item for item in items)


def _sealed_only(item: Item) -> bool:
    return isinstance(item, Reasoning) and not item.content and item.encrypted_content is not None


def _restored(item: Item, key: CompactionKey) -> Item:
    assert isinstance(item, Reasoning)
    text = key.open_text(_DOMAIN, item.encrypted_content)
    return item if text is None else attrs.evolve(item, content=(ReasoningText(text=text),))
