"""Every limit and default of a running server, in one place (the CLI's flags map onto it),
each with its allowed range (core/ranges.py)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from proto_server.core.ranges import at_least, between, positive

MiB = 1024 * 1024


def _no_blank_keys(instance: Any, attribute: attrs.Attribute[Any], keys: tuple[str, ...]) -> None:
    """A blank key would let `Authorization: Bearer` with no token in."""
    for key in keys:
        if not key.strip():
            raise ValueError(f"{attribute.name} must not hold an empty or blank key")


def _positive_finite(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} must be positive and finite, got {value}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=between(0, 65535))
    #: A client frame larger than this closes the connection with code 1009 and says so. At
    #: least 1 KiB: below that not even a short response.create fits, so every request would be
    #: refused; that is a typo, not a policy.
    max_message_bytes: int = attrs.field(default=16 * MiB, validator=at_least(1024))
    #: Server events buffered for a slow client before the stream itself slows down.
    client_queue_events: int = attrs.field(default=256, validator=at_least(1))
    #: When a writer falls behind its client, send the deltas that piled up as one frame.
    merge_deltas: bool = True
    #: Compress frames with permessage-deflate when the client offers it (Codex 0.171 does).
    permessage_deflate: bool = False
    #: Chunks the generator may run ahead of the sampling loop.
    chunk_queue: int = attrs.field(default=64, validator=at_least(1))
    #: Time a new connection has to send its request head.
    handshake_timeout_s: float = attrs.field(default=10.0, validator=positive)
    #: Largest request head (request line and headers) accepted.
    max_request_head_bytes: int = attrs.field(default=64 * 1024, validator=at_least(1))
    #: The model name reported when a request names none.
    default_model: str = "proto-sim"
    #: A WebSocket lives this long; then `websocket_connection_limit_reached` and a clean close.
    max_connection_lifetime_s: float = attrs.field(default=3600.0, validator=positive)
    #: Open connections (WebSocket and HTTP); one more is answered 503 `server_busy` and closed.
    max_connections: int = attrs.field(default=1000, validator=at_least(1))
    #: Prototype dialect: a suspended Response whose client sends nothing for this long ends
    #: with `response.incomplete` (reason `suspend_timeout`); a partial answer restarts it.
    suspend_timeout_s: float = attrs.field(default=600.0, validator=positive)
    #: Suspended Responses per process; past it the one idle longest ends with
    #: `response.incomplete` (reason `suspended_rollout_limit`), and a warning is logged.
    max_suspended_rollouts: int = attrs.field(default=10_000, validator=at_least(1))
    #: On SIGTERM/SIGINT: how long streaming segments may take to finish before they are cut.
    shutdown_grace_s: float = attrs.field(default=10.0, validator=positive)
    #: On SIGTERM/SIGINT: how long the server goes on serving and accepting, answering `/readyz`
    #: 503, before it stops listening, so a balancer's health check takes it out of rotation
    #: while it still accepts (0: stop listening at once, for a server with no balancer).
    drain_delay_s: float = attrs.field(default=0.0, validator=between(0, 3600))
    #: Launched dialect: `response.create` frames that may wait behind the one in flight on
    #: each lane (the default lane and every named one); one more is `concurrent_request`.
    max_queued_requests: int = attrs.field(default=8, validator=at_least(1))
    #: Named lanes (`stream_id`s) one WebSocket may use over its life (the default lane is not
    #: counted; OpenAI's service allows 32); a create naming one more is refused with
    #: `websocket_stream_limit_reached`. Each keeps its last Response warm.
    max_lanes: int = attrs.field(default=32, validator=at_least(1))
    #: Accepted steers one Response may hold before they are applied (`response.steer`); one
    #: more is refused with `too_many_pending_steers`, its input returned.
    max_pending_steers: int = attrs.field(default=8, validator=at_least(1))
    #: What the whole process keeps for its clients (rollouts, queued and in-preparation
    #: requests); past it the idlest cached or suspended rollouts are let go, then requests are
    #: refused with `server_busy` (503).
    max_memory_bytes: int = attrs.field(default=2048 * MiB, validator=at_least(MiB))
    #: What one connection may make the server keep (its rollouts and queued requests); past it
    #: its own idle cache is let go, then requests are refused with `connection_memory_limit`.
    max_connection_memory_bytes: int = attrs.field(default=256 * MiB, validator=at_least(MiB))
    #: Worker threads that decode and render large requests off the event loop.
    prepare_threads: int = attrs.field(default=2, validator=at_least(1))
    #: Bearer keys accepted on the WebSocket handshake and on HTTP; empty means no auth.
    #: Each key is a tenant: what one stores, another cannot read, continue or compact.
    api_keys: tuple[str, ...] = attrs.field(default=(), validator=_no_blank_keys, repr=False)
    #: Deadline of each call to the default in-memory store (the CLI's store has its own).
    store_timeout_s: float = attrs.field(default=5.0, validator=_positive_finite)
