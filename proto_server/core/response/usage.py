"""A Response's token accounts, every segment counted: what its `usage` says."""

from __future__ import annotations

import attrs

from proto_server.wire.response import InputTokensDetails, OutputTokensDetails, Usage


@attrs.define
class Tokens:
    input: int = 0
    cached: int = 0
    output: int = 0
    reasoning: int = 0
    #: What the engine said of this segment's prompt at its start (`report_cached` corrects it).
    segment_cached: int = 0

    @classmethod
    def of(cls, usage: Usage | None) -> Tokens:
        """The accounts a persisted Response's `usage` says (a restored suspension goes on)."""
        if usage is None:
            return cls()
        return cls(
            input=usage.input_tokens,
            cached=usage.input_tokens_details.cached_tokens,
            output=usage.output_tokens,
            reasoning=usage.output_tokens_details.reasoning_tokens,
        )

    def begin_segment(self, *, prompt_tokens: int, cached_tokens: int) -> None:
        self.input += prompt_tokens
        self.cached += cached_tokens
        self.segment_cached = cached_tokens

    def report_cached(self, cached_tokens: int) -> None:
        """The engine said, once the segment ended, how much of its prompt it had cached."""
        self.cached += cached_tokens - self.segment_cached
        self.segment_cached = cached_tokens

    def usage(self) -> Usage:
        return Usage(
            input_tokens=self.input,
            input_tokens_details=InputTokensDetails(cached_tokens=self.cached),
            output_tokens=self.output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning),
            total_tokens=self.input + self.output,
        )
