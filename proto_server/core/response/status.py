"""A Response's status as the machine knows it (the wire says less: `Status.wire`)."""

from __future__ import annotations

import enum

from proto_server.wire.events import (
    ResponseCancelled,
    ResponseCompleted,
    ResponseFailed,
    ResponseIncomplete,
)


class Status(enum.Enum):
    IN_PROGRESS = "in_progress"
    SUSPENDED = "suspended"
    #: Decided to end (cancelled, expired, failed); its terminal event is not out yet.
    ENDING = "ending"
    COMPLETED = "completed"
    FAILED = "failed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def wire(self) -> str:
        """What the Response object says: a suspended or ending one is still `in_progress`."""
        return "in_progress" if self in (Status.SUSPENDED, Status.ENDING) else self.value


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED})
#: The events that say a Response's end, one per terminal status: the writer, the store step and
#: the HTTP routes know a Response is over by them.
TERMINAL_EVENTS = (ResponseCompleted, ResponseFailed, ResponseIncomplete, ResponseCancelled)
