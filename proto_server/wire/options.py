"""The object-valued options of a `response.create` that the server reads.

Typed so the converter refuses a wrong shape with the field's path (`context_management[0].
compact_threshold`); keys they do not name are accepted and ignored, as at the top level. What
the values must be beyond their types (a known `ttl`, one compaction entry) is checked with the
rest of the create, in `core/request.py`.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class PromptCacheOptions:
    """`prompt_cache_options`: `prewarm: true` is a warm-up (as `generate: false`); `ttl` and
    `mode` are hints this server's caches do not need (they live as long as the connection)."""

    prewarm: bool | None = None
    ttl: str | None = None
    mode: str | None = None
    comparison_response_id: str | None = None


@attrs.frozen(kw_only=True)
class ContextManagement:
    """One `context_management` entry: `{"type": "compaction", "compact_threshold": N}`
    compacts a turn whose prompt is over N tokens before the model reads it."""

    type: str
    compact_threshold: int | None = None
