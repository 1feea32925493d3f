"""Test what a Responses event stream promises, against this server or any other.

`StreamChecker` follows one connection: feed it every frame the client sent (`sent`) and every
event the server sent (`received`), in the order the client saw them, and it raises
`InvariantViolation` at the first event that breaks the protocol's ordering promises.
`LaneChecker` does the same for a connection with lanes (`stream_id`): a `StreamChecker` per
lane. `connect_checked` opens a `WireClient` that does the feeding for you (`connect`: the same
client without a checker). `wire_schema()` validates events and bodies against the published
Open Responses schema (needs `jsonschema`); give it to a checker (`schema=`) to hold a stream
to it too.
"""

from proto_server.testing.checker import (
    INVARIANTS,
    InvariantViolation,
    LaneChecker,
    StreamChecker,
    o200k_count,
)
from proto_server.testing.client import WireClient, connect, connect_checked
from proto_server.testing.schema import SchemaViolation, WireSchema, wire_schema

__all__ = [
    "INVARIANTS",
    "InvariantViolation",
    "LaneChecker",
    "SchemaViolation",
    "StreamChecker",
    "WireClient",
    "WireSchema",
    "connect",
    "connect_checked",
    "o200k_count",
    "wire_schema",
]
