"""A client for proto-server: trio (`connect`) and blocking for notebooks (`BlockingClient`)."""

from proto_server.client.connection import Connection, connect
from proto_server.client.dialects import Dialect
from proto_server.client.rollout import Rollout
from proto_server.client.segment import Received, Segment, Sent
from proto_server.client.state import RolloutState

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
