"""Compaction: a long history becomes the user's messages plus one opaque `compaction` item.

A client starts a new chain from the output (`previous_response_id: null`, the compacted output
plus new input). The item carries its summary in `encrypted_content`, opaque to clients as the
upstream one is; this server can read it back, and renders it like any carried item.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Sequence

import orjson

from proto_server.core.ids import new_id
from proto_server.wire.items import FunctionCall, Item, Message, UnknownItem


def summarize(items: Sequence[Item]) -> str:
    calls = Counter(item.name for item in items if isinstance(item, FunctionCall))
    used = ", ".join(f"{name} x{count}" for name, count in calls.most_common()) or "no tools"
    return f"Compacted {len(items)} earlier items; tools used: {used}."


def compact(items: Sequence[Item]) -> tuple[list[Item], str]:
    """The compacted history (user messages kept, the rest summarized) and the summary."""
    summary = summarize(items)
    opaque = base64.b64encode(orjson.dumps({"summary": summary})).decode()
    compaction = UnknownItem(
        {"type": "compaction", "id": new_id("cmp"), "encrypted_content": opaque}
    )
    kept: list[Item] = [item for item in items if isinstance(item, Message) and item.role == "user"]
    return [*kept, compaction], summary


def summary_of(item: UnknownItem) -> str | None:
    """The summary a compaction item carries, if it is one of ours."""
    try:
        data = orjson.loads(base64.b64decode(str(item.raw.get("encrypted_content", ""))))
    except (ValueError, orjson.JSONDecodeError):
        return None
    summary = data.get("summary") if isinstance(data, dict) else None
    return summary if isinstance(summary, str) else None
