"""What every model renderer shares: the `ModelRenderer` promise, and the cache it keeps.

A real model's conversation becomes tokens through its chat template (chat_template.py),
harmony's rendering for gpt-oss (harmony_renderer.py) or mistral-common's (mistral_renderer.py);
which one a family gets is renderers.py's choice. Each keeps the tokens of the messages it
rendered last (`RenderedMessages`, bounded by `--render-cache-mb`), as a stateless client
resends its whole history every turn, and each refuses a model it cannot render one message at
a time with the same error (`TemplateError`), which the command line reports.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias, runtime_checkable

from cachetools import LRUCache

from proto_server.core.render import Renderer

log = logging.getLogger("proto_server.engine.model_renderer")


class TemplateError(ValueError):
    """The model's chat template cannot render a conversation one message at a time."""


#: How a compacted history's summary is introduced to a model that reads chat messages.
COMPACTION_PREAMBLE = "Summary of the conversation so far (earlier turns were compacted):"

#: What `--render-cache-mb` defaults to.
RENDER_CACHE_BYTES = 64 * 1024 * 1024

ChatMessage: TypeAlias = tuple[str, str]  # a message as the template reads it: (role, content)
#: The role a conversation's start (its system prompt, rendered whole) is kept under: no
#: message has it.
PREFIX = "\0prefix"


def prefix_key(*head: object, specs: Sequence[object]) -> tuple[str, str]:
    """The key a conversation's start is kept under: `head` (its instructions, ...) and each
    tool's spec as JSON, a line each (JSON has no raw newline), encoded a tool at a time: in
    one call, 134,000 tools held the GIL for the whole of it."""
    return PREFIX, "\n".join([json.dumps(head), *map(json.dumps, specs)])


#: A kept rendering: the message's text (kept alive with it, so counted) and its tokens.
Kept: TypeAlias = "tuple[str, array[int]]"


#: What an entry costs besides its text and its tokens: the key and value tuples and the
#: cache's own link and dict slot (measured with tracemalloc: about 300 bytes).
ENTRY_BYTES = 320


def _kept_bytes(kept: Kept) -> int:
    text, tokens = kept
    return sys.getsizeof(text) + sys.getsizeof(tokens) + ENTRY_BYTES


class RenderedMessages:
    """The tokens of recently rendered messages, the least recently used let go past
    `max_bytes` (0: none kept); thread-safe, as large inputs are rendered on worker threads."""

    def __init__(self, max_bytes: int) -> None:
        self._cache: LRUCache[ChatMessage, Kept] | None = None
        if max_bytes > 0:
            self._cache = LRUCache(max_bytes, getsizeof=_kept_bytes)
        self._lock = threading.Lock()
        self.hits = self.misses = self.evicted = 0
        self._taken = (0, 0, 0)

    def get(self, message: ChatMessage) -> array[int] | None:
        if self._cache is None:
            return None
        hash(message)  # a long text is hashed once (str keeps it), here, not under the lock
        with self._lock:
            kept = self._cache.get(message)
            if kept is None:
                self.misses += 1
                return None
            self.hits += 1
            return kept[1]

    def put(self, message: ChatMessage, tokens: array[int]) -> None:
        if self._cache is None:
            return
        kept = (message[1], tokens)
        if _kept_bytes(kept) > self._cache.maxsize:
            return  # bigger than the whole cache: not kept
        with self._lock:
            before = len(self._cache) + (message not in self._cache)
            self._cache[message] = kept
            let_go = before - len(self._cache)
            if let_go and not self.evicted:  # the limit is reached: said once
                log.info(
                    "render_cache.full",
                    extra={"max_bytes": self._cache.maxsize, "flag": "--render-cache-mb"},
                )
            self.evicted += let_go

    def rendered(self, message: ChatMessage, render: Callable[[], Sequence[int]]) -> array[int]:
        """The tokens kept for `message`, else `render()`'s, kept for the next time."""
        tokens = self.get(message)
        if tokens is None:
            tokens = array("I", render())
            self.put(message, tokens)
        return tokens

    def take_counts(self) -> tuple[int, int, int]:
        """(hits, misses, evicted) since the last call: for counters kept elsewhere (/metrics)."""
        with self._lock:
            now = (self.hits, self.misses, self.evicted)
            before, self._taken = self._taken, now
        hits, misses, evicted = (new - old for new, old in zip(now, before, strict=True))
        return hits, misses, evicted

    @property
    def nbytes(self) -> int:
        """The bytes kept now."""
        return 0 if self._cache is None else int(self._cache.currsize)


@runtime_checkable
class ModelRenderer(Renderer, Protocol):
    """A real model's rendering (its chat template, or harmony's for gpt-oss): what opens
    the model's turn, and the messages it keeps rendered (`--render-cache-mb`)."""

    generation_prompt: list[int]
    rendered: RenderedMessages
    #: The model writes a `<think>` block first (thinking.py), and its turn may open inside it.
    thinks: bool
    opens_thinking: bool
    #: The block's tags (`<think>`, `</think>`; Magistral's `[THINK]`, `[/THINK]`).
    think_tags: tuple[str, str]
