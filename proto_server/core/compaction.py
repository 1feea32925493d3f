"""Compaction: a long history becomes the user's messages plus one opaque `compaction` item.

A client starts a new chain from the output (`previous_response_id: null`, the compacted output
plus new input). The item carries its summary in `encrypted_content`, opaque to clients as the
upstream one is, and sealed: an HMAC-SHA256 over the summary with the server's secret, so a
client can carry it but not forge or alter it. Every compaction item a client sends is checked
where it enters (`check_compactions`) and refused if its seal does not verify; past that
boundary the renderer reads the summary back (`summary_of`). The secret is passed in: this
module does no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections import Counter
from collections.abc import Sequence
from typing import TypeGuard

import attrs
import orjson

from proto_server.core.ids import new_id
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import FunctionCall, InputText, Item, Message, UnknownItem

#: Bound into every seal, so a MAC made for anything else never verifies as a compaction.
_DOMAIN = b"proto-server compaction v1\n"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _body(sealed: object) -> tuple[bytes, bytes] | None:
    """The body and the tag of a sealed `encrypted_content`, or None if it is not one."""
    if not isinstance(sealed, str) or sealed.count(".") != 1:
        return None
    body, tag = sealed.split(".")
    try:
        return _unb64(body), _unb64(tag)
    except (ValueError, binascii.Error):
        return None


def _summary(body: bytes) -> str | None:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    summary = data.get("summary") if isinstance(data, dict) else None
    return summary if isinstance(summary, str) else None


@attrs.frozen
class CompactionKey:
    """The server's secret for what it seals: compaction items, and reasoning items'
    `encrypted_content` (reasoning.py). Kept across restarts by the server layer."""

    secret: bytes = attrs.field(repr=False)

    @secret.validator
    def _long_enough(self, _: attrs.Attribute[bytes], secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a compaction secret needs at least 16 bytes")

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self.secret, _DOMAIN + body, hashlib.sha256).digest()

    def seal_text(self, domain: bytes, text: str) -> str:
        """`text` sealed for another use than compaction (`domain` names it, so no seal made
        for one use verifies for another)."""
        body = orjson.dumps({"text": text})
        return f"{_b64(body)}.{_b64(self._tag(domain + body))}"

    def open_text(self, domain: bytes, sealed: object) -> str | None:
        """The text if `sealed` was made by `seal_text(domain, ...)` with this secret."""
        parts = _body(sealed)
        if parts is None or not hmac.compare_digest(parts[1], self._tag(domain + parts[0])):
            return None
        try:
            text = orjson.loads(parts[0]).get("text")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return text if isinstance(text, str) else None

    def seal(self, summary: str, *, model_turns: int = 0, tool_outputs: int = 0) -> str:
        """`model_turns`, `tool_outputs`: what the summarized items counted, so a model that
        plans from those counts (a rollout script) goes on where the history was."""
        body = orjson.dumps(
            {"summary": summary, "model_turns": model_turns, "tool_outputs": tool_outputs}
        )
        return f"{_b64(body)}.{_b64(self._tag(body))}"

    def open(self, sealed: object) -> str | None:
        """The summary if `sealed` was made by `seal` with this secret, else None."""
        parts = _body(sealed)
        if parts is None or not hmac.compare_digest(parts[1], self._tag(parts[0])):
            return None
        return _summary(parts[0])


def summarize(items: Sequence[Item]) -> str:
    calls = Counter(item.name for item in items if isinstance(item, FunctionCall))
    used = ", ".join(f"{name} x{count}" for name, count in calls.most_common()) or "no tools"
    return f"Compacted {len(items)} earlier items; tools used: {used}."


def compact(
    items: Sequence[Item], key: CompactionKey, *, model_turns: int = 0, tool_outputs: int = 0
) -> tuple[list[Item], str]:
    """The compacted history (user messages kept, the rest summarized) and the summary;
    `model_turns` and `tool_outputs` (what `items` count, see `conversation.counted`) are
    sealed with it."""
    summary = summarize(items)
    sealed = key.seal(summary, model_turns=model_turns, tool_outputs=tool_outputs)
    compaction = UnknownItem(
        {"type": "compaction", "id": new_id("cmp"), "encrypted_content": sealed}
    )
    # the API's output messages carry an id, a status and a list of parts: never null, and a
    # string content (the "easy" input form) becomes its one input_text part
    kept: list[Item] = [
        attrs.evolve(
            item,
            id=item.id or new_id("msg"),
            status=item.status or "completed",
            content=(InputText(text=item.content),)
            if isinstance(item.content, str)
            else item.content,
        )
        for item in items
        if isinstance(item, Message) and item.role == "user"
    ]
    return [*kept, compaction], summary


def is_compaction(item: Item) -> TypeGuard[UnknownItem]:
    return isinstance(item, UnknownItem) and item.type == "compaction"


def compacted_prompt(output: Sequence[Item]) -> bool:
    """Whether a Response with this `output` was served from a compacted history: server-side
    compaction makes a compaction item its first output (a client's are only ever input)."""
    return bool(output) and is_compaction(output[0])


def check_compactions(items: Sequence[Item], key: CompactionKey, *, field: str = "input") -> None:
    """Refuse any compaction item among a client's `items` whose seal does not verify."""
    for index, item in enumerate(items):
        if not is_compaction(item):
            continue
        if key.open(item.raw.get("encrypted_content")) is None:
            raise ProtocolError(
                "invalid_field",
                f"{field}[{index}] is a compaction item whose encrypted_content does not "
                "verify: it was altered, made by another server, or sealed with a secret this "
                "server no longer has. Send compaction items exactly as /v1/responses/compact "
                "returned them, or resend the history they replaced.",
                param=f"{field}[{index}].encrypted_content",
            )


def summary_of(item: UnknownItem) -> str | None:
    """The summary a sealed compaction item carries (its seal was checked where it entered)."""
    parts = _body(item.raw.get("encrypted_content"))
    return None if parts is None else _summary(parts[0])


def counts_of(item: UnknownItem) -> tuple[int, int]:
    """The model turns and tool outputs a sealed compaction item stands for (0, 0 if it says
    nothing: items sealed before it did)."""
    parts = _body(item.raw.get("encrypted_content"))
    try:
        data = orjson.loads(parts[0]) if parts is not None else None
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return 0, 0
    turns, outputs = data.get("model_turns"), data.get("tool_outputs")
    return (
        turns if isinstance(turns, int) and turns > 0 else 0,
        outputs if isinstance(outputs, int) and outputs > 0 else 0,
    )
