"""What a Response's sampling loop does next, decided here (h11's `next_event`): the loop asks
`Steps.next_step` and `match`es on the answer, `RunSegment`, `Suspend`, `Send` or `End`; it
decides nothing itself, it only awaits (the generator, the client's wait, the store, the wire).

What the decision reads is kept here, beside the machine: the events that open the next segment
(the Response's start, or a resumption an append or an inject made), whether an inject's
resumption waits for its `wake`, whether the machine closed the segment that ran, and the
generator's failure, held until the chunks it sent before it are out. Sans-IO: it never awaits,
and the loop's trio objects (the wait, the cancel scopes) stay the loop's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from proto_server.core.conversation import RenderedItems
from proto_server.core.response.machine import ResponseMachine
from proto_server.core.response.status import Status
from proto_server.wire.errors import ServerFault
from proto_server.wire.events import ServerEvent
from proto_server.wire.items import Item


@attrs.frozen
class RunSegment:
    """Run the next generator segment; `announce`: the events that open it, sent once the
    generator has started (so its prefill overlaps with writing them)."""

    announce: tuple[ServerEvent, ...] = ()


@attrs.frozen
class Suspend:
    """Wait, suspended, until a client's call wakes the Response (the append or inject that
    answers its last call, a cancel, an expiry) or its client stays idle too long."""


@attrs.frozen
class Send:
    """Send `events` (steers applied at a safe point), then ask again."""

    events: tuple[ServerEvent, ...]


@attrs.frozen
class End:
    """Send `events`, the Response's last (none: it said its end already), and finish.
    `fault`: the generator's failure that ended it, for the log."""

    events: tuple[ServerEvent, ...] = ()
    fault: ServerFault | None = None


Step = RunSegment | Suspend | Send | End

#: Why a segment failed when its generator stopped without saying why.
STOPPED = ServerFault("generator_error", "the token generator stopped in the middle of a segment")


class Steps:
    """The sampling loop's decisions for one Response, over its `machine`. `announced`: its
    Response was announced already (rebuilt from a stored suspension): no `response.created`."""

    def __init__(self, machine: ResponseMachine, *, announced: bool = False) -> None:
        self.machine = machine
        self._started = announced
        #: Events that open the next segment, not sent yet.
        self._announce: list[ServerEvent] = []
        #: An inject answered every call: the Response resumes once the caller says so (`wake`).
        self._answered = False
        #: A segment was handed out (`RunSegment`) and the loop has not asked again since.
        self._running = False
        #: The machine closed the running segment (`segment_closed`).
        self._closed = False
        #: The generator's failure, held until the chunks it sent before it are streamed.
        self._fault: ServerFault | None = None

    def next_step(self) -> Step:
        """What the loop does now. Decides, and changes the machine where a decision is said at
        once: outputs injected while the segment streamed join it as it suspends, steers due at
        a safe point are applied, a segment cut short fails the Response."""
        machine = self.machine
        if not self._started:
            self._started = True
            self._announce = machine.start()
        if self._running:
            self._running = False
            after = self._after_segment()
            if after is not None:
                return after
        if machine.status.terminal:
            return End()
        if machine.status is Status.ENDING:
            return End((*self._take_announce(), *machine.end()))
        if machine.status is Status.SUSPENDED:
            if machine.holds_injected:  # outputs injected while the segment streamed
                self._announce = machine.release_held()
            if machine.status is Status.SUSPENDED:
                return Suspend()
            # every call was answered before it could wait: no wait at all
        self._running = True
        self._closed = False
        return RunSegment(tuple(self._take_announce()))

    def _after_segment(self) -> Step | None:
        """A segment the machine did not close (its generator stopped or was cut): a steer
        due is applied, else the Response fails. None: decide as at any other time."""
        machine = self.machine
        # closed: it may be in progress again already, resumed by outputs that came meanwhile
        if self._closed or machine.status is not Status.IN_PROGRESS:
            return None
        if machine.steer_due:  # a safe point: the steer ends it, or it goes on in place
            return Send(tuple(machine.take_steers()))
        fault, self._fault = self._fault or STOPPED, None
        machine.request_fail(fault.detail)
        return End((*self._take_announce(), *machine.end()), fault=fault)

    def _take_announce(self) -> list[ServerEvent]:
        announce, self._announce = self._announce, []
        return announce

    # -- what the running segment told ------------------------------------------------------------

    def segment_closed(self) -> bool:
        """Whether the machine closed the running segment (suspended or ended the Response, or
        resumed it in place): the loop reads no more of its chunks."""
        machine = self.machine
        if machine.status is not Status.IN_PROGRESS or not machine.segment_open:
            self._closed = True
        return self._closed

    def generator_failed(self, fault: ServerFault) -> None:
        """The generator failed or misbehaved: said once the chunks before it are streamed."""
        self._fault = fault

    # -- what the client sent ------------------------------------------------------------------

    def append(
        self, items: Sequence[Item], rendered: RenderedItems | None, *, tool_choice: Any = None
    ) -> bool:
        """`ResponseMachine.append`; whether it resumed the Response (the wait is to be woken;
        else the client is alive and its idle clock starts again)."""
        self._announce = self.machine.append(items, rendered, tool_choice=tool_choice)
        return self.machine.status is Status.IN_PROGRESS

    def inject(self, items: Sequence[Item], rendered: RenderedItems | None) -> bool:
        """`ResponseMachine.inject`; whether it answered the last call. The resumption waits
        for `wake`, so the caller can say the inject was committed before the next event."""
        resumed = self.machine.inject(items, rendered)
        if resumed:
            self._announce = resumed
            self._answered = True
        return bool(resumed)

    def wake(self) -> bool:
        """Whether an inject's resumption is due now (once: it is then no longer pending)."""
        answered, self._answered = self._answered, False
        return answered
