"""Token-id helpers every model-backed generator shares (no torch: an engine needs none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Tokens that end a turn in the common chat formats, when the model's vocabulary has them.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def stop_ids(tokenizer: Any, configured: int | Sequence[int] | None) -> frozenset[int]:
    """The ids that end the model's turn: its configured `eos_token_id`(s), the tokenizer's,
    and the common end-of-turn tokens its vocabulary has."""
    ids: set[int] = set()
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocabulary = tokenizer.get_vocab()
    ids.update(vocabulary[token] for token in END_OF_TURN if token in vocabulary)
    return frozenset(ids)
