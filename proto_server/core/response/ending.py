"""An end decided but not yet said: the client cancelled, the server expired the Response or
its generator failed; the terminal event goes out at the next safe point (`end`). Until then
the Response is `ending` and takes nothing more from the client. Here: why it ends, the refusal
of what comes after, and the machine's calls that decide and say it (`Ends`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs

from proto_server.core.response import transitions
from proto_server.core.response.status import Status
from proto_server.core.response.transitions import Event, IllegalTransition
from proto_server.wire.errors import ErrorDetail, ProtocolError
from proto_server.wire.events import ResponseCancelled, ServerEvent

if TYPE_CHECKING:
    from proto_server.core.response.items import Output
    from proto_server.core.trace import Sampled
    from proto_server.wire.response import Response


@attrs.frozen
class Ending:
    """Why an `ending` Response ends: its terminal status, and the reason or error it says."""

    to: Status
    reason: str | None = None
    error: ErrorDetail | None = None


def refuse_if_ending(response_id: str, status: Status, ending: Ending | None, what: str) -> None:
    """The client's `ProtocolError` for a Response that ended or is ending: it cannot be `what`."""
    if status.terminal:
        raise ProtocolError(
            "no_open_response",
            f"Response {response_id} already ended ({status.value}); it cannot be {what}. "
            "Start a new one with response.create.",
        )
    if ending is not None:
        why = "cancelled" if ending.to is Status.CANCELLED else "ended"
        if ending.reason is not None:
            why = f"ended ({ending.reason})"
        raise ProtocolError(
            "no_open_response",
            f"Response {response_id} is being {why}; it cannot be {what}. Start a new one "
            "with response.create.",
        )


class _Machine(Protocol):
    """What of `ResponseMachine` its ends use (its part, `Ends`, is typed against this)."""

    id: str
    status: Status
    _ending: Ending | None
    _items: Output

    def _move(self, event: Event) -> None: ...
    def snapshot(self) -> Response: ...
    def fail(self, error: ErrorDetail) -> list[ServerEvent]: ...
    def make_incomplete(
        self, reason: str, *, tokens: int = 0, sampled: Sampled | None = None
    ) -> list[ServerEvent]: ...
    def _fail_steers(self, code: str = ..., why: str | None = None) -> list[ServerEvent]: ...
    def _cancelled(self) -> list[ServerEvent]: ...
    def _refuse_if_ending(self, what: str) -> None: ...


class Ends:
    """`ResponseMachine`'s calls that decide an end now (`request_cancel`, `request_expire`,
    `request_fail`) and say it at the next safe point (`end`)."""

    _ending: Ending | None

    def request_cancel(self: _Machine) -> None:
        """The client's `response.cancel`: refused once the Response is ending or ended."""
        self._refuse_if_ending("cancelled")
        self._move(Event.REQUEST_CANCEL)
        self._ending = Ending(Status.CANCELLED)

    def request_expire(self: _Machine, reason: str) -> bool:
        """The server ends the Response `incomplete` (`reason`); False if it is ending already."""
        if not transitions.allowed(self.status, Event.REQUEST_EXPIRE):
            return False
        self._move(Event.REQUEST_EXPIRE)
        self._ending = Ending(Status.INCOMPLETE, reason=reason)
        return True

    def request_fail(self: _Machine, error: ErrorDetail) -> bool:
        """The generator failed: the Response fails, unless it is ending already."""
        if not transitions.allowed(self.status, Event.REQUEST_FAIL):
            return False
        self._move(Event.REQUEST_FAIL)
        self._ending = Ending(Status.FAILED, error=error)
        return True

    def end(self: _Machine) -> list[ServerEvent]:
        """Say the end that was decided: open items close as incomplete, then the terminal."""
        ending = self._ending
        if self.status is not Status.ENDING or ending is None:
            raise IllegalTransition(f"cannot end a Response that is {self.status.value}")
        self._ending = None
        if ending.to is Status.FAILED:
            assert ending.error is not None
            return self.fail(ending.error)
        if ending.to is Status.INCOMPLETE:
            assert ending.reason is not None
            return self.make_incomplete(ending.reason)
        return self._cancelled()

    def _cancelled(self: _Machine) -> list[ServerEvent]:
        self._move(Event.CANCEL)
        events = self._items.abandon()
        return [*events, ResponseCancelled(response=self.snapshot()), *self._fail_steers()]

    def _refuse_if_ending(self: _Machine, what: str) -> None:
        refuse_if_ending(self.id, self.status, self._ending, what)
