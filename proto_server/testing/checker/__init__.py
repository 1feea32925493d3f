"""The stream checker: a Responses connection's event-ordering invariants, checked as the events
arrive (`StreamChecker`, in `stream.py`; `LaneChecker` for a connection with lanes)."""

from proto_server.testing.checker.stream import (
    INVARIANTS,
    TERMINAL_EVENTS,
    Dialect,
    InvariantViolation,
    LaneChecker,
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
