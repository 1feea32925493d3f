"""The stream checker: a Responses connection's event-ordering invariants, checked as the events
arrive (`StreamChecker`, in `stream.py`; `LaneChecker`, a connection with lanes, in `lanes.py`)."""

from proto_server.testing.checker.lanes import LaneChecker
from proto_server.testing.checker.stream import (
    INVARIANTS,
    TERMINAL_EVENTS,
    Dialect,
    InvariantViolation,
    StreamChecker,
    o200k_count,
)

__all__ = [
    "INVARIANTS",
    "TERMINAL_EVENTS",
    "Dialect",
    "InvariantViolation",
    "LaneChecker",
    "StreamChecker",
    "o200k_count",
]
