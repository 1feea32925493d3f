"""What a request allows the model in the segment about to be decoded.

The sampling loop builds `GenerationLimits` before every segment from the Response (what the
client asked) and what the Response already holds, and hands them to `generate`: every
generator obeys them, so a limit the client set is honoured whichever model serves it.
"""

from __future__ import annotations

import attrs

from proto_server.core.text_format import TextFormat, parse_text_format
from proto_server.core.tool_choice import ToolChoice, parse_tool_choice
from proto_server.wire.response import Response

#: The code of a failure that is the engine's absence (not there, or gone mid-stream): with
#: several replicas, the one that failed is taken out and the rollout goes on another.
ENGINE_UNAVAILABLE = "engine_unavailable"


class GeneratorError(Exception):
    """A segment the generator cannot produce, for a reason it can name: `code` (it ends the
    Response with `response.failed` carrying that code, no traceback; the connection lives).
    `unsent`: nothing of the segment had been handed over yet, so it may be sent again, whole,
    to another engine replica."""

    def __init__(self, code: str, message: str, *, unsent: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.unsent = unsent


class GenerationRefused(GeneratorError):
    """The generator cannot produce what the limits demand: the request, not the server, is at
    odds with it."""


@attrs.frozen(kw_only=True)
class GenerationLimits:
    #: Output tokens this segment may decode: `max_output_tokens` minus what the Response's
    #: earlier segments decoded, so the whole Response stays within it. None: no limit.
    max_output_tokens: int | None = None
    tool_choice: ToolChoice = attrs.field(factory=ToolChoice)
    #: False: at most one tool call in this segment.
    parallel_tool_calls: bool = True
    #: Tool calls this segment may make: `max_tool_calls` minus the Response's calls so far.
    max_tool_calls: int | None = None
    #: Sampling, as the request set it (None: the generator's default). Greedy generators
    #: (simulated, local) ignore them; an engine is passed them.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    #: The shape the text answer must have (`text.format`); None: free text.
    text_format: TextFormat | None = None
    #: The engine's scheduling priority (lower first; `--engine-priority`); None: none sent.
    priority: int | None = None
    #: Logprobs of the sampled tokens, each with this many of the likeliest tokens at its
    #: position (the request's `top_logprobs`); None: none asked (`include`), none computed.
    top_logprobs: int | None = None
    #: The ids of the prompt and of every sampled token, with each token's logprob, on the
    #: chunks (`Prefilled.prompt_ids`, `Sampled`): the request's `include` asked for them.
    token_ids: bool = False

    @classmethod
    def for_response(
        cls,
        response: Response,
        *,
        output_tokens: int,
        tool_calls: int,
        logprobs: bool = False,
        token_ids: bool = False,
    ) -> GenerationLimits:
        """The limits of the next segment of `response`, which already decoded `output_tokens`
        and made `tool_calls` calls; `logprobs`, `token_ids`: its create asked for them
        (`include`)."""
        limit, calls = response.max_output_tokens, response.max_tool_calls
        return cls(
            max_output_tokens=None if limit is None else max(limit - output_tokens, 0),
            tool_choice=parse_tool_choice(response.tool_choice),
            parallel_tool_calls=response.parallel_tool_calls,
            max_tool_calls=None if calls is None else max(calls - tool_calls, 0),
            temperature=response.temperature,
            top_p=response.top_p,
            seed=response.seed,
            text_format=parse_text_format(response.text),
            top_logprobs=response.top_logprobs if logprobs else None,
            token_ids=token_ids,
        )

    @property
    def engine_logprobs(self) -> int | None:
        """How many of the likeliest tokens an engine is asked to list beside each sampled
        token's logprob: `top_logprobs`, or none beside it where only ids were asked (their
        logprobs come with them); None: no logprob asked."""
        if self.top_logprobs is not None:
            return self.top_logprobs
        return 0 if self.token_ids else None

    @property
    def max_calls(self) -> int | None:
        """How many tool calls this segment may make; None: any number."""
        if self.tool_choice.mode == "none":
            return 0
        single = None if self.parallel_tool_calls else 1
        bounds = [b for b in (single, self.max_tool_calls) if b is not None]
        return min(bounds) if bounds else None

    @property
    def must_call(self) -> bool:
        """`required` or a named function, and calls still allowed: the segment must call."""
        return self.tool_choice.mode == "required" and self.max_calls != 0
