"""The simulated GPU's prefix cache: what a real engine keeps across requests.

Engines keep the KV state of prompts they have seen and reuse it for any later prompt that starts
the same way, whoever sends it (vLLM's automatic prefix caching, SGLang's radix cache). Without
this, every stateless request would be charged a full prefill that no real deployment pays, and
a benchmark would credit the warm paths with GPU work they do not really save.

Prompts are cut into blocks of `block_tokens`. Each full block is named by a hash chained over
every token up to its end, so a block matches only under the same prefix. An LRU of those names,
bounded in tokens, is shared by all sessions of one generator. A prompt costs prefill only past
its longest run of cached leading blocks; a partial last block is never cached (as in vLLM).

As in vLLM's KV cache, the blocks of a sequence that is running are in use (`pin`): never let
go, though they count against the capacity; once it stops they are free again, the freshest of
the LRU, and the first to go are the blocks that have waited longest, such as those of a
rollout suspended on a slow tool.
"""

from __future__ import annotations

import collections
from array import array

BLOCK_TOKENS = 64
#: What the cache holds by default: a large GPU's KV cache of a small model, in tokens.
PREFIX_CACHE_TOKENS = 4_000_000


class BlockHashes:
    """The chained block hashes of one growing token sequence, extended incrementally.

    A session keeps one, so its own growing conversation is hashed once, block by block.
    """

    def __init__(self, block_tokens: int, salt: str | None = None) -> None:
        self.block_tokens = block_tokens
        self.hashes: list[int] = []
        #: What the first block is chained to: a salt's blocks match no other salt's.
        self._seed = 0 if salt is None else hash(salt)

    def update(self, tokens: array[int]) -> list[int]:
        """Hash the full blocks of `tokens` not hashed yet; `tokens` only ever grows."""
        width = self.block_tokens * tokens.itemsize
        data = memoryview(tokens).cast("B")
        hashes = self.hashes
        previous = hashes[-1] if hashes else self._seed
        for start in range(len(hashes) * width, len(data) - width + 1, width):
            previous = hash((previous, data[start : start + width].tobytes()))
            hashes.append(previous)
        return hashes


class PrefixCache:
    """Block names in least-recently-used order, at most `capacity_tokens` worth of them."""

    def __init__(
        self, *, block_tokens: int = BLOCK_TOKENS, capacity_tokens: int = PREFIX_CACHE_TOKENS
    ) -> None:
        if block_tokens <= 0 or capacity_tokens < block_tokens:
            raise ValueError(
                f"a prefix cache needs block_tokens > 0 and capacity_tokens >= block_tokens, "
                f"got {block_tokens} and {capacity_tokens}"
            )
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        #: Cached blocks not in use, least recently used first: what an insert may let go.
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Blocks in use by running sequences, and by how many.
        self._pinned: dict[int, int] = {}
        #: Blocks let go to make room, ever.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    @property
    def pinned_blocks(self) -> int:
        """Blocks in use by running sequences (what an engine cannot let go)."""
        return len(self._pinned)

    def hashes(self, salt: str | None = None) -> BlockHashes:
        return BlockHashes(self.block_tokens, salt)

    def cached_blocks(self, hashes: list[int], start: int = 0) -> int:
        """How many leading blocks are cached, given that the first `start` are (a session's own
        warm state); the ones found are marked recently used."""
        blocks, pinned = self._blocks, self._pinned
        found = start
        for name in hashes[start:]:
            if name in pinned:
                found += 1
                continue
            if name not in blocks:
                break
            blocks.move_to_end(name)
            found += 1
        return found

    def insert(self, hashes: list[int], start: int = 0) -> None:
        """Remember `hashes[start:]` as cached, evicting the least recently used beyond capacity."""
        blocks, pinned = self._blocks, self._pinned
        for name in hashes[start:]:
            if name not in pinned:
                blocks[name] = None
                blocks.move_to_end(name)
        self._make_room()

    def pin(self, hashes: list[int]) -> list[int]:
        """Mark the cached ones of `hashes` in use (a sequence runs on them); what was pinned,
        to `unpin` when it stops."""
        blocks, pinned = self._blocks, self._pinned
        taken = []
        for name in hashes:
            if name in pinned:
                pinned[name] += 1
            elif name in blocks:
                del blocks[name]
                pinned[name] = 1
            else:
                continue
            taken.append(name)
        return taken

    def unpin(self, hashes: list[int]) -> None:
        """The sequence stopped: its blocks are free again, the most recently used."""
        blocks, pinned = self._blocks, self._pinned
        for name in hashes:
            count = pinned.get(name)
            if count is None:
                continue
            if count > 1:
                pinned[name] = count - 1
            else:
                del pinned[name]
                blocks[name] = None
        self._make_room()

    def _make_room(self) -> None:
        """Let the least recently used free blocks go until the cache fits its capacity (blocks
        in use are never let go: with too many running, it holds more, as an engine would
        preempt)."""
        blocks = self._blocks
        while blocks and len(blocks) + len(self._pinned) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evicted += 1
