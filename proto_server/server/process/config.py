"""Every limit and default of a running server, in one place: each with its allowed range
(core/ranges.py) and, where it has one, its `serve` flag and help (core/settings.py)."""

from __future__ import annotations

from typing import Any

import attrs

from proto_server.core.ranges import InvalidSetting, at_least, between, one_of, positive
from proto_server.core.settings import setting
from proto_server.engine import families

MiB = 1024 * 1024


def _no_blank_keys(instance: Any, attribute: attrs.Attribute[Any], keys: tuple[str, ...]) -> None:
    """A blank key would let `Authorization: Bearer` with no token in."""
    for key in keys:
        if not key.strip():
            raise ValueError(f"{attribute.name} must not hold an empty or blank key")


def _no_blank_key(instance: Any, attribute: attrs.Attribute[Any], key: str | None) -> None:
    if key is not None:
        _no_blank_keys(instance, attribute, (key,))


def _weights(
    instance: Any, attribute: attrs.Attribute[Any], weights: tuple[tuple[str, float], ...]
) -> None:
    """A weight of 0 or less would never be served, or divide by zero."""
    for owner, weight in weights:
        if not weight > 0:
            raise InvalidSetting(attribute.name, f"must be positive, got {weight} for {owner}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8000, between(0, 65535), help="port to listen on; 0 picks a free one")
    # At least 1 KiB: below that not even a short response.create fits, so every request would
    # be refused; that is a typo, not a policy.
    max_message_bytes: int = setting(
        16 * MiB,
        at_least(1024),
        metavar="BYTES",
        help="largest client frame; a larger one closes the connection with code 1009 and says "
        "so; also the most a request's item_references may expand to (message_too_large)",
    )
    # At least 64 KiB: a bound below what one ordinary event takes would only fill the log.
    max_event_bytes: int = setting(
        MiB,
        at_least(64 * 1024),
        metavar="BYTES",
        help="largest server event the server means to send (1 MiB: Python websockets' "
        "default max_size); a prototype-dialect Response snapshot over it is sent with its "
        "output left out (each item came in its response.output_item.done); an event of "
        "another dialect, whose clients read output there, is sent whole, logged and counted",
    )
    #: Server events buffered for a slow client before the stream itself slows down.
    client_queue_events: int = attrs.field(default=256, validator=at_least(1))
    merge_deltas: bool = setting(
        True,
        help="when a writer falls behind its client, send the deltas that piled up as one "
        "frame; --no-merge-deltas sends every delta in a frame of its own",
    )
    permessage_deflate: bool = setting(
        False,
        help="compress WebSocket frames (RFC 7692) when the client offers it, as Codex 0.171 does",
    )
    #: Chunks the generator may run ahead of the sampling loop.
    chunk_queue: int = attrs.field(default=64, validator=at_least(1))
    handshake_timeout_s: float = setting(
        10.0,
        positive,
        help="time to send a request head (or the next one on a kept-alive HTTP connection, "
        "or the rest of a body); then 408 and the connection is closed",
    )
    #: Largest request head (request line and headers) accepted.
    max_request_head_bytes: int = attrs.field(default=64 * 1024, validator=at_least(1))
    #: The model name reported when a request names none.
    default_model: str = "proto-sim"
    max_connection_lifetime_s: float = setting(
        3600.0,
        positive,
        help="a WebSocket lives this long; then websocket_connection_limit_reached and a clean "
        "close",
    )
    send_timeout_s: float = setting(
        60.0,
        positive,
        help="a client that accepts no bytes for this long while the server has some for it "
        "is let go (as nginx's send_timeout): its open Responses end response.incomplete "
        "(reason slow_reader), a WebSocket is closed with code 1008; a client that reads "
        "slowly but steadily is not",
    )
    max_connections: int = setting(
        1000,
        at_least(1),
        help="open connections (WebSocket and HTTP); one more is answered 503 server_busy and "
        "closed (a GET /healthz or /readyz among them is answered: --probe-connections); one "
        "whose client went away, open only for a Response kept for a reattach, is not counted",
    )
    probe_connections: int = setting(
        16,
        at_least(0),
        help="connections past --max-connections whose request head is read (1 s, 4 KiB at "
        "most) so that a GET /healthz or /readyz is answered during a connection flood; past "
        "these, 503 server_busy at once; 0: every one at once",
    )
    suspend_timeout_s: float = setting(
        600.0,
        positive,
        help="prototype dialect: a suspended Response whose client sends nothing for this long "
        "ends with response.incomplete (reason suspend_timeout); a partial answer restarts it",
    )
    max_suspended_rollouts: int = setting(
        10_000,
        at_least(1),
        help="suspended Responses per process; past it the one idle longest ends with "
        "response.incomplete (reason suspended_rollout_limit), and a warning is logged",
    )
    shutdown_grace_s: float = setting(
        10.0,
        positive,
        help="on SIGTERM or Ctrl-C: how long streaming segments may take to finish; then "
        "every open Response ends (response.incomplete, reason server_shutdown), close 1001",
    )
    drain_delay_s: float = setting(
        0.0,
        between(0, 3600),
        help="on SIGTERM or Ctrl-C: /readyz answers 503 at once, but the server goes on "
        "accepting and serving this long before it stops listening (and its grace begins), so "
        "a balancer's health check takes it out of rotation first; set it above the "
        "balancer's check interval times its fall count (deploy/haproxy.cfg: 3); 0 stops "
        "listening at once, for a server with no balancer",
    )
    reattach_grace_s: float = setting(
        30.0,
        between(0, 3600),
        help="a streamed Response whose client goes away mid-stream runs on this long, its "
        "events kept, for the client to reattach (GET /v1/responses/{id}?stream=true&"
        "starting_after=N); then it is cancelled as if the grace were 0; a reattach stops the "
        "clock, another drop restarts it; 0: cancelled at once",
    )
    reattach_keep_bytes: int = setting(
        4 * MiB,
        at_least(1024),
        metavar="BYTES",
        help="most bytes of events (their JSON) kept per streamed Response for a reattach, "
        "charged to --max-memory; past it the oldest go, and a reattach after one of them is "
        "refused with reattach_events_lost",
    )
    max_background: int = setting(
        64,
        at_least(1),
        help="background Responses (background: true over HTTP) that may run at once in this "
        "process, each to its end whatever its client does; one more is refused with 429 "
        "too_many_background_responses",
    )
    max_queued_requests: int = setting(
        8,
        at_least(1),
        help="launched dialect: response.create frames that may wait behind the one in flight "
        "on each lane; one more is refused with concurrent_request",
    )
    max_lanes: int = setting(
        32,
        at_least(1),
        help="named lanes (stream_id) one WebSocket may use over its life (the default lane "
        "is not counted; OpenAI's service allows 32); one more is refused with "
        "websocket_stream_limit_reached",
    )
    max_pending_steers: int = setting(
        8,
        at_least(1),
        help="accepted response.steer inputs one Response may hold before they are applied; "
        "one more gets response.steer.failed (too_many_pending_steers) with its input back",
    )
    max_memory_bytes: int = setting(
        2048 * MiB,
        at_least(MiB),
        flag="--max-memory",
        metavar="MIB",
        unit=MiB,
        help="memory the process may keep for its clients (rollouts, queued and in-preparation "
        "requests); past it the idlest cached or suspended rollouts are let go, then requests "
        "are refused with server_busy (503)",
    )
    max_connection_memory_bytes: int = setting(
        256 * MiB,
        at_least(MiB),
        flag="--max-connection-memory",
        metavar="MIB",
        unit=MiB,
        help="memory one connection may make the server keep (its rollouts and queued "
        "requests); past it its own idle cache is let go, then requests are refused with "
        "connection_memory_limit",
    )
    prepare_threads: int = setting(
        2, at_least(1), help="worker threads that decode and render large requests off the loop"
    )
    #: Bearer keys accepted on the WebSocket handshake and on HTTP; empty means no auth.
    #: Each key is a tenant: what one stores, another cannot read, continue or compact. (Its
    #: flag, `--api-key`, also reads PROTO_SERVER_API_KEYS: the CLI builds it.)
    api_keys: tuple[str, ...] = attrs.field(default=(), validator=_no_blank_keys, repr=False)
    #: The bearer key of the admin endpoints (`/admin/...`: a pause for a weight update), apart
    #: from the clients' keys; None: they answer 404. (Its flag, `--admin-key`, also reads
    #: PROTO_SERVER_ADMIN_KEY: the CLI builds it.)
    admin_key: str | None = attrs.field(default=None, validator=_no_blank_key, repr=False)
    pause_timeout_s: float = setting(
        600.0,
        positive,
        help="a segment held by a pause for a weight update (POST /admin/pause) this long "
        "ends its Response response.incomplete (reason pause_timeout)",
    )
    kv_capacity_tokens: int = setting(
        0,
        at_least(0),
        metavar="TOKENS",
        help="the engine's KV cache in tokens (vLLM: num_gpu_blocks x block_size); set, the "
        "server admits rollouts by it (see Scheduling); 0: off",
    )
    kv_capacity_from_engine: bool = setting(
        True,
        help="vllm: unless --kv-capacity-tokens is given, admit rollouts by the engines' KV "
        "cache as they report it at start-up (their /metrics: vllm:cache_config_info's "
        "num_gpu_blocks x block_size); an engine that does not say, or does not answer, leaves "
        "admission off and the log says so; --no-kv-capacity-from-engine: no admission by it",
    )
    tool_syntax: str = setting(
        families.AUTO,
        one_of(families.CHOICES),
        metavar="FAMILY",
        help="local model and vllm: the model family whose tool-call syntax the server offers, "
        f"renders and reads: {', '.join(families.CHOICES[1:])}; auto: the one the tokenizer's "
        "special tokens show (qwen: hermes' tags in the form Qwen's template renders a call in; "
        "none: hermes, and the log says so)",
    )
    kv_target_fill: float = setting(
        0.9,
        between(0.01, 1.0),
        metavar="FRACTION",
        help="share of --kv-capacity-tokens the admitted rollouts' tokens may fill",
    )
    admission_growth: float = setting(
        1.0,
        between(1, 100),
        metavar="G",
        help="admit a rollout for G times the tokens it holds, reserved until it holds more, "
        "as it grows by each turn's call, output and answer; 1: what it holds now",
    )
    admission_overflow: bool = setting(
        False,
        help="when the admitted rollouts have outgrown --kv-capacity-tokens, those suspended "
        "on a tool give their places up at once, the smallest first, until the rest fit (a "
        "rollout that comes back then waits like a new one); off: they keep them, and the "
        "engine evicts among them",
    )
    admission_ttl_s: float = setting(
        30.0,
        positive,
        help="an admitted rollout waiting on its tool keeps its place this long; then, if "
        "others wait, it is demoted (waits like a new one when it comes back)",
    )
    admission_ttl_median: float = setting(
        0.0,
        between(0, 1000),
        metavar="K",
        help="keep a waiting rollout's place K times the median time rollouts were away on "
        "their tools lately (the last 256, once 16 came back), at most --admission-ttl; "
        "0: --admission-ttl alone",
    )
    admission_bypass: int = setting(
        16,
        between(0, 1_000_000),
        metavar="N",
        help="a key's waiting rollouts are admitted smallest first, but the one that has "
        "waited longest is passed by at most N others, then goes next; 0: first come first "
        "served",
    )
    admission_timeout_s: float = setting(
        300.0,
        positive,
        help="longest a rollout waits for room in the engine's KV cache; then its Response "
        "ends response.incomplete (reason admission_timeout)",
    )
    admission_shared: bool = setting(
        False,
        help="admit against the engines together with every other server process that uses "
        "this --store (a file the workers of one host share, or a PostgreSQL database that "
        "hosts share): each publishes what its rollouts hold and wait for, and admits against "
        "its part of the room nobody holds; --workers N turns it on",
    )
    admission_sync_interval_s: float = setting(
        0.5,
        between(0.01, 60),
        help="with --admission-shared: how often each process publishes its load and reads "
        "the others' (sooner when a rollout starts to wait); one not heard from for 10 "
        "intervals is taken for gone",
    )
    engine_priority: bool = setting(
        False,
        help="the engine runs with --scheduling-policy priority: resumed rollouts' segments "
        "are sent with priority 0, new ones' with 1, so the engine serves resumed ones first",
    )
    #: Per owner id (`key:` and 32 hex digits of the key's SHA-256), its weight in the fair
    #: share of admission between keys (default 1). Its flag, `--key-weight`, the CLI builds.
    key_weights: tuple[tuple[str, float], ...] = attrs.field(default=(), validator=_weights)

    @property
    def kv_budget_tokens(self) -> int:
        """What the admitted rollouts may hold: the capacity times the target fill."""
        return max(1, int(self.kv_capacity_tokens * self.kv_target_fill))
