"""The Response state machine, one idea a module: its status (`status`), the dialect's mode
(`mode`), the table every status change goes through (`transitions`), its output items
(`items`), usage (`usage`), steers (`steering`), held injects (`held`), what an append may
answer (`answers`), a decided end (`ending`), what the generator produced (`streaming`),
`ResponseMachine` composing them (`machine`), and what the sampling loop does next
(`steps`)."""

from proto_server.core.response.machine import ResponseMachine
from proto_server.core.response.mode import Mode
from proto_server.core.response.status import TERMINAL, Status
from proto_server.core.response.steering import STEERED, Steer, Steering, steer_failed
from proto_server.core.response.transitions import (
    TABLE,
    TRANSITIONS,
    Event,
    IllegalTransition,
    move,
)

__all__ = [
    "STEERED",
    "TABLE",
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "IllegalTransition",
    "Mode",
    "ResponseMachine",
    "Status",
    "Steer",
    "Steering",
    "move",
    "steer_failed",
]
