"""The token ids of a Response's output items, when the client asked for them (`include`).

A segment's prompt is the ids the engine was sent; each chunk the generator hands over carries
the ids the engine returned for it (`Sampled`); the item streaming gathers its chunks' ids and
logprobs (`Trace`), and its prompt is what the model had read before its first token: the
segment's prompt, then the ids of the segment's items before it. So, item after item, each
prompt extends the last one's prompt and ids, as a trainer reading them as one sequence needs
(NeMo Gym's `assert_prefix_contiguity`).
"""

from __future__ import annotations

from typing import Any, TypedDict

import attrs

#: What a token field holds per id or logprob: its slot in a tuple, and, for what was sampled,
#: the int or float object the slot points to (a prompt's ids are mostly shared with the item
#: before it, so only the slot is counted).
SLOT_BYTES = 8
NUMBER_BYTES = 32


class TokenFields(TypedDict, total=False):
    """An item's token fields, as NeMo Gym names them (none: not asked, or not done yet)."""

    prompt_token_ids: tuple[int, ...]
    generation_token_ids: tuple[int, ...]
    generation_log_probs: tuple[float, ...]
    #: The weights' label when the item's segment began (set by a trainer's resume).
    weight_version: str


@attrs.frozen
class Sampled:
    """The ids of the tokens a chunk carries, exactly as the engine returned them, and each
    one's logprob."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@attrs.define
class Trace:
    """The tokens of one item: what the model had read before its first (`prompt`), and the
    ids the engine returned for it, with their logprobs."""

    prompt: tuple[int, ...]
    ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    weight_version: str | None = None

    def fields(self) -> TokenFields:
        """The item's token fields (its weight version where one was set)."""
        fields: TokenFields = {
            "prompt_token_ids": self.prompt,
            "generation_token_ids": tuple(self.ids),
            "generation_log_probs": tuple(self.logprobs),
        }
        if self.weight_version is not None:
            fields["weight_version"] = self.weight_version
        return fields


def token_fields(trace: Trace | None, status: str) -> TokenFields:
    """What an item of `status` carries of `trace`: all of it once done, nothing before (its
    `output_item.added`) or where ids were not asked."""
    return trace.fields() if trace is not None and status != "in_progress" else {}


class SegmentTokens:
    """What the model has read and written so far in the segment streaming: its prompt, then
    every id returned since; items open on it (`open`) and their ids join it (`add`)."""

    def __init__(self) -> None:
        self._seen: list[int] = []
        self._version: str | None = None

    def begin(self, prompt: tuple[int, ...] | None, weight_version: str | None = None) -> None:
        self._seen = list(prompt or ())
        self._version = weight_version

    def open(self) -> Trace:
        return Trace(prompt=tuple(self._seen), weight_version=self._version)

    def add(self, trace: Trace | None, sampled: Sampled | None) -> None:
        if sampled is None:
            return
        self._seen += sampled.ids
        if trace is not None:
            trace.ids += sampled.ids
            trace.logprobs += sampled.logprobs


def token_field_bytes(item: Any) -> int:
    """What an item's token fields hold in memory, for budgets (none where it has none)."""
    ids = getattr(item, "generation_token_ids", None)
    if ids is None:
        return 0
    prompt = getattr(item, "prompt_token_ids", None) or ()
    logprobs = getattr(item, "generation_log_probs", None) or ()
    return SLOT_BYTES * len(prompt) + (SLOT_BYTES + NUMBER_BYTES) * (len(ids) + len(logprobs))
