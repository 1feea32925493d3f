"""A rollout handle: iterate its events until the next suspension or the end, append, cancel.

    rollout = await connection.create(...)
    async for received in rollout.events():   # this segment's events, as they arrive
        ...
    rollout.state           # streaming | suspended (rollout.pending_calls) | completed | ...
    await rollout.append({call_id: "output", ...})

What `append` puts on the wire depends on the dialect: `response.append` with the outputs
(prototype); a `response.create` with `previous_response_id` and only the outputs (launched);
a POST with the whole history and the outputs (http); `dialects.py` says which. The
bookkeeping is `RolloutTracker`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from proto_server.client.dialects import rules
from proto_server.client.display import rollout_html
from proto_server.client.segment import Received, Segment
from proto_server.client.state import RolloutState, RolloutTracker
from proto_server.wire.converter import unstructure
from proto_server.wire.items import Item, ToolCall, ToolOutput
from proto_server.wire.response import Response

if TYPE_CHECKING:
    from proto_server.client.connection import Connection


class Rollout:
    def __init__(
        self,
        connection: Connection,
        settings: Mapping[str, Any],
        input: str | list[Any],
        previous_response_id: str | None,
    ) -> None:
        self.connection = connection
        self.dialect = connection.dialect
        self.tracker = RolloutTracker(connection.dialect)
        self._turns = rules(connection.dialect).turns(settings, input, previous_response_id)
        self._history_outputs = 0

    # -- what the client knows -----------------------------------------------------------------

    @property
    def state(self) -> RolloutState:
        return self.tracker.state

    @property
    def pending_calls(self) -> list[ToolCall]:
        return list(self.tracker.pending_calls.values())

    @property
    def response(self) -> Response | None:
        """The latest Response object the server sent (its output and usage so far)."""
        return self.tracker.response

    @property
    def response_id(self) -> str | None:
        return self.tracker.response_ids[-1] if self.tracker.response_ids else None

    @property
    def output(self) -> list[Item]:
        """Every item the model finished in this rollout, across segments and turns."""
        return list(self.tracker.output)

    @property
    def segments(self) -> list[Segment]:
        return list(self.tracker.segments)

    @property
    def received(self) -> list[Received]:
        """Every event received in this rollout so far."""
        return [received for segment in self.tracker.segments for received in segment.events]

    # -- moves -----------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._send(self._turns.first())

    def events(self) -> _SegmentEvents:
        """This segment's events as they arrive; the iteration ends at a suspension or the end."""
        return _SegmentEvents(self)

    async def step(self) -> Segment:
        """Read events until the next suspension or the end; the segment they make up."""
        if self.state is not RolloutState.STREAMING:
            raise RuntimeError(self._not_streaming())
        async for _ in self.events():
            pass
        segment = self.tracker.current
        assert segment is not None
        return segment

    async def append(
        self, outputs: Mapping[str, str] | Sequence[ToolOutput], *, tool_choice: Any = None
    ) -> None:
        """Answer pending calls (`{call_id: output}` or output items); resumes once all are.

        `tool_choice`: a new one for the rest of the rollout, from the answer that resumes on
        (e.g. `"none"` once the agent must answer). Outputs that answer no pending call raise
        `OutputsRefused` and nothing is sent.
        """
        items = self.tracker.outputs(outputs)
        if tool_choice is not None:
            self._turns.choose(tool_choice)
        answer = self._turns.answer(
            [wire_json(item) for item in items],
            answered_all=self.tracker.answered(items),
            response_id=self.response_id,
            unsent=lambda: [wire_json(item) for item in self._unsent_outputs()],
        )
        if answer is None:
            return  # held until the last pending call is answered
        if answer.resumes:
            await self._send(answer.body)
        else:  # the server holds a partial answer; nothing streams yet
            self.tracker.sent_partial(size=await self.connection.send(answer.body))

    async def cancel(self) -> None:
        """End the rollout: `response.cancel` where a Response is open on the server."""
        state = self.state
        if state.ended:
            raise RuntimeError(f"the rollout already ended ({state.value}); nothing to cancel.")
        if rules(self.dialect).cancels_on_server(streaming=state is RolloutState.STREAMING):
            cancel = {"type": "response.cancel"}
            if state is RolloutState.SUSPENDED:
                await self._send(cancel)  # what streams back (the cancellation) is a segment
            else:
                await self.connection.send(cancel)
            await self.step()
            return
        if state is RolloutState.STREAMING:
            await self.connection.abort()
        self.tracker.cancelled_locally()

    # -- internals ------------------------------------------------------------------------------

    async def _send(self, body: Mapping[str, Any]) -> None:
        size = await self.connection.send(body)
        self.tracker.sent(at=self.connection.transcript[-1].at, size=size)

    def _unsent_outputs(self) -> list[Item]:
        outputs = self.tracker.output[self._history_outputs :]
        self._history_outputs = len(self.tracker.output)
        return outputs

    async def _receive(self) -> Received:
        received = await self.connection.receive()
        self.tracker.received(received)
        if self.state is not RolloutState.STREAMING and self.response_id is not None:
            self.connection.last_response_id = self.response_id
        return received

    def _not_streaming(self) -> str:
        if self.state is RolloutState.SUSPENDED:
            calls = ", ".join(f"{c.call_id} ({c.name})" for c in self.pending_calls)
            return f"the rollout is suspended: append outputs for {calls} to resume it."
        return f"the rollout ended ({self.state.value}); create a new one."

    def _repr_html_(self) -> str:
        return rollout_html(self.tracker)


class _SegmentEvents:
    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout

    def __aiter__(self) -> _SegmentEvents:
        return self

    async def __anext__(self) -> Received:
        if self._rollout.state is not RolloutState.STREAMING:
            raise StopAsyncIteration
        return await self._rollout._receive()


def wire_json(value: Any) -> Any:
    """A wire object (item, tool) as JSON, without the fields left unset (None)."""
    obj = unstructure(value)
    if isinstance(obj, dict):
        return {key: field for key, field in obj.items() if field is not None}
    return obj
