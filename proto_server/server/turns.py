"""What one Response cost the server, kept as it runs: the `TurnRecord` that `/metrics`, the
bench and the logs read (`response.ended`)."""

from __future__ import annotations

import attrs

from proto_server.core.response import ResponseMachine

#: A turn's source when its engine replica went down and another prefilled it again.
FAILOVER = "failover"


@attrs.frozen(kw_only=True)
class TurnRecord:
    """What one Response cost the server: how much it rendered, and what the model re-read."""

    response_id: str
    source: str  # "fresh", "cache", "store", "rebuilt", "append"; "failover": see `Rerouted`
    rendered_input_tokens: int
    prompt_tokens: int
    cached_tokens: int
    status: str
    #: From the request's arrival: to the generator's first start, and to the first event out.
    prepare_s: float | None = None
    first_event_s: float | None = None
    #: The generator's segments, summed.
    decode_s: float = 0.0


@attrs.define(kw_only=True)
class TurnAccount:
    """The running account of one Response, times from `arrived_at` (trio's clock)."""

    arrived_at: float
    source: str
    #: The conversation's rendered tokens when this Response last counted them: what was
    #: rendered past it (its input, appended outputs) is input this Response rendered.
    rendered_mark: int
    rendered_input: int = 0
    prepare_s: float | None = None
    first_event_s: float | None = None
    decode_s: float = 0.0

    def generating(self, now: float) -> None:
        if self.prepare_s is None:
            self.prepare_s = now - self.arrived_at

    def sending(self, now: float) -> None:
        if self.first_event_s is None:
            self.first_event_s = now - self.arrived_at

    def count_rendered(self, rendered_tokens: int) -> int:
        """Add the tokens rendered since the last count to this Response's; return them."""
        new = rendered_tokens - self.rendered_mark
        self.rendered_input += new
        self.rendered_mark = rendered_tokens
        return new

    def record(self, machine: ResponseMachine) -> TurnRecord:
        usage = machine.usage()
        return TurnRecord(
            response_id=machine.id,
            source=self.source,
            rendered_input_tokens=self.rendered_input,
            prompt_tokens=usage.input_tokens,
            cached_tokens=usage.input_tokens_details.cached_tokens,
            status=machine.status.value,
            prepare_s=self.prepare_s,
            first_event_s=self.first_event_s,
            decode_s=self.decode_s,
        )
