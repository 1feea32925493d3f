"""A client for proto-server: trio (`connect`) and blocking for notebooks (`BlockingClient`)."""

from proto_server.client.connection import Connection, connect
from proto_server.client.rollout import Rollout
from proto_server.client.state import Dialect, Received, RolloutState, Segment, Sent

__all__ = [
    "Connection",
    "Dialect",
    "Received",
    "Rollout",
    "RolloutState",
    "Segment",
    "Sent",
    "connect",
]
