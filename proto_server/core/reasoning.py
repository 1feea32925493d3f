"""Reasoning: what a request may ask of it, and the items a client sends back.

`reasoning.effort` and `.summary` take the API's values (`check_reasoning`) and are echoed
whole (`echoed_reasoning`).

A `reasoning` item's `encrypted_content` (made when a request's `include` names
`reasoning.encrypted_content`) is the reasoning text sealed with the server's secret, as
compaction items are (compaction.py): a client that keeps nothing (`store: false`) carries it
and sends it back, and the server reads the text again. A seal that does not verify is refused
where the item enters (`check_reasonings`); past that boundary `replayed` puts the text back in
the items that arrived with only the seal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from proto_server.core.compaction import CompactionKey
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.items import Item, Reasoning, ReasoningText

#: What a request's `include` names to get reasoning items' `encrypted_content`.
ENCRYPTED_CONTENT = "reasoning.encrypted_content"

#: The values OpenAI's API takes for `reasoning.effort` and `reasoning.summary` (and the older
#: `reasoning.generate_summary`), each also null; the published schema's effort enum omits
#: `minimal`, which its descriptions and the SDKs name. A summary of `none` is Codex's own value
#: (its `model_reasoning_summary` setting), taken as no summary rather than refused.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed", "none")
_REASONING_FIELDS = {
    "effort": REASONING_EFFORTS,
    "summary": REASONING_SUMMARIES,
    "generate_summary": REASONING_SUMMARIES,
}


def check_reasoning(reasoning: Mapping[str, Any] | None) -> None:
    """`reasoning.effort` and `.summary` hold one of the API's values or null, as OpenAI
    checks them: a value no model knows is refused rather than echoed (other keys are
    ignored, as unknown fields are, and not echoed)."""
    for name, allowed in _REASONING_FIELDS.items():
        value = (reasoning or {}).get(name)
        if value is not None and value not in allowed:
            shown = quoted(value) if isinstance(value, str) else type(value).__name__
            raise ProtocolError(
                "invalid_field",
                f"`reasoning.{name}` is {shown}; it must be one of "
                f"{', '.join(map(repr, allowed))}, or null.",
                param=f"reasoning.{name}",
            )


def echoed_reasoning(reasoning: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """`reasoning` as the API echoes it: both `effort` and `summary`, null when not asked
    (Codex sends only one of them; a strict client's parser requires both), the older
    `generate_summary` read as `summary`, Codex's `none` as null (the published schema has no
    such summary), and nothing else the client put there."""
    if reasoning is None:
        return None
    summary = reasoning.get("summary")
    if summary is None:
        summary = reasoning.get("generate_summary")
    return {"effort": reasoning.get("effort"), "summary": None if summary == "none" else summary}


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
