"""The server: one listener for HTTP and WebSocket, a nursery per connection.

server nursery (serve)
 └─ connection nursery (one per socket, _handle)
     ├─ trio-websocket's reader
     ├─ reader (connection.py) and writer (writer.py)
     ├─ the launched dialect's turn loop (launched.py)
     └─ rollout nurseries (sampling.py): generator task + sampling loop
"""

from __future__ import annotations

import collections
import hmac
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Literal

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from proto_server.core.compaction import CompactionKey, check_compactions
from proto_server.core.conversation import Conversation
from proto_server.core.ids import new_id
from proto_server.core.render import O200kRenderer, Renderer
from proto_server.core.request import (
    ToolChoice,
    check_create,
    compact_turn,
    compaction_threshold,
    input_items,
    is_warmup,
    parse_tool_choice,
    prepare_input,
    request_bytes,
    response_template,
)
from proto_server.core.response import ResponseMachine
from proto_server.engine.base import TokenGenerator
from proto_server.server import metrics
from proto_server.server.config import ServerConfig
from proto_server.server.connection import CLOSE_WAIT_S, Connection, Dialect
from proto_server.server.handshake import (
    BadRequestHead,
    ReplayStream,
    RequestHead,
    accept_upgrade,
    read_request_head,
    upgrade_refusal,
)
from proto_server.server.http import (
    LINGER_S,
    error_body,
    linger,
    send_error,
    serve_http,
    unauthorized,
)
from proto_server.server.lanes import MULTI_AGENT_BETA, beta_values
from proto_server.server.launched import LaunchedDialect
from proto_server.server.logs import log
from proto_server.server.memory import MemoryBudget
from proto_server.server.observe import ServerObserver
from proto_server.server.offload import Offload
from proto_server.server.outbox import EventSink
from proto_server.server.prototype import PrototypeDialect
from proto_server.server.resume import Durable
from proto_server.server.rollout import Rollout
from proto_server.server.sampling import SamplingLoop, TurnRecord
from proto_server.server.store import (
    ANONYMOUS,
    ResponseStore,
    SQLiteStore,
    StoredResponse,
    owner_id,
)
from proto_server.server.suspension import Suspensions
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate
from proto_server.wire.items import Item

RESPONSES_PATH = "/v1/responses"
PROTOTYPE_BETA = "responses_websockets=2026-02-04"
#: What Codex 0.171 sends: the launched protocol (also what a client with no beta header gets).
LAUNCHED_BETA = "responses_websockets=2026-02-06"
#: Codex 0.171 reads the largest frame the server takes from this upgrade-response header.
MAX_MESSAGE_BYTES_HEADER = b"x-codex-websocket-max-message-bytes"
DialectName = Literal["prototype", "launched"]


def select_dialect(head: RequestHead) -> DialectName:
    """Prototype if the client opts in: Codex 0.107's beta header, or this project's own opt-in.
    Anything else is launched: Codex 0.171's `LAUNCHED_BETA`, no header, an unknown beta."""
    betas = (head.header(b"openai-beta") or "").replace(" ", "").split(",")
    if PROTOTYPE_BETA in betas:
        return "prototype"
    if (head.header(b"x-proto-dialect") or "").lower() == "prototype":
        return "prototype"
    _, _, query = head.target.partition("?")
    if "dialect=prototype" in query.split("&"):
        return "prototype"
    return "launched"


def multi_agent_beta(head: RequestHead) -> bool:
    """Whether the client opted into the multi-agent beta (`response.inject`)."""
    return MULTI_AGENT_BETA in beta_values(head.header(b"openai-beta"))


@attrs.frozen
class BoundAddress:
    host: str
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}{RESPONSES_PATH}"


class ProtoServer:
    def __init__(
        self,
        generator: TokenGenerator,
        config: ServerConfig | None = None,
        *,
        renderer: Renderer | None = None,
        store: ResponseStore | None = None,
        compaction_secret: bytes | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        #: A socket bound by someone else (the supervisor of `--workers`): accept on it instead.
        self._listener = listener
        self.generator = generator
        self.renderer = renderer or generator.renderer or O200kRenderer()
        # every call timed into the metrics (proto_server_store_seconds)
        self.store = metrics.TimedStore(store or SQLiteStore(":memory:"))
        #: Seals compaction items; without a kept secret they live as long as this process.
        self.compaction_key = CompactionKey(compaction_secret or secrets.token_bytes(32))
        self.open_connections = 0
        self.open_rollouts = 0
        #: Connections ended by an unexpected exception (logged as `connection.crashed`).
        self.crashed_connections = 0
        self.suspensions = Suspensions(self.config.max_suspended_rollouts)
        #: Everything the process keeps for its clients, counted (see server/memory.py).
        self.memory = MemoryBudget(
            self.config.max_memory_bytes, flag="--max-memory", name="process"
        )
        #: Decodes and renders large requests on worker threads (see server/offload.py).
        self.offload = Offload(self.config.prepare_threads)
        #: Set at the very start of `shutdown()`: from then on `/readyz` answers 503, while the
        #: server still accepts for `drain_delay_s` (so a balancer stops sending first).
        self.draining = False
        #: Set by `shutdown()` once it stops listening: when streaming segments must have finished.
        self.stopping: float | None = None
        #: Kept-alive HTTP connections waiting for their next request (shutdown ends them).
        self.idle_http: set[trio.CancelScope] = set()
        self._websockets: set[Connection] = set()
        self._listening = trio.CancelScope()
        self._handlers: trio.Nursery | None = None
        #: The most recent Responses' costs, newest last (tests and the benchmark read them).
        self.turns: collections.deque[TurnRecord] = collections.deque(maxlen=10_000)
        #: Told what each request costs, as it happens (the benchmark sets one); None: no cost.
        self.observer: ServerObserver | None = None
        self._changed = trio.Event()

    def _count(self, *, connections: int = 0, rollouts: int = 0) -> None:
        if connections:
            metrics.CONNECTIONS.inc(connections)
        self.open_connections += connections
        self.open_rollouts += rollouts
        self._changed.set()
        self._changed = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no connection and no rollout is open (every one has released its state)."""
        while self.open_connections or self.open_rollouts:
            await self._changed.wait()

    def owner(self, authorization: str | None) -> str | None:
        """Who sends a request with this `Authorization` header: the owner id of its key (keys
        are tenants), `ANONYMOUS` with auth off, or None if it is refused."""
        keys = self.config.api_keys
        if not keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None  # an empty token never matches, whatever the keys
        matches = [key for key in keys if hmac.compare_digest(token.encode(), key.encode())]
        return owner_id(matches[0]) if matches else None

    def authorized(self, authorization: str | None) -> bool:
        return self.owner(authorization) is not None

    # -- listening -------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen until cancelled or `shutdown()`; `nursery.start(server.serve)` returns the
        bound address."""
        config = self.config
        async with trio.open_nursery() as handlers:
            self._handlers = handlers
            listeners = await handlers.start(self._listen, handlers)
            port = listeners[0].socket.getsockname()[1]
            address = BoundAddress(config.host, port)
            log.info("server.listening", extra={"url": address.ws_url})
            task_status.started(address)

    async def _listen(
        self,
        handlers: trio.Nursery,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        config = self.config
        with self._listening:  # cancelled: the listening sockets close, connections go on
            if self._listener is not None:
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._listener))
                await trio.serve_listeners(
                    self._handle, [listener], handler_nursery=handlers, task_status=task_status
                )
                return
            await trio.serve_tcp(
                self._handle,
                config.port,
                host=config.host,
                handler_nursery=handlers,
                task_status=task_status,
            )

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop gracefully: first be not ready (`/readyz` 503) while still accepting and
        serving for `drain_delay_s`, so a balancer's health check takes this process out of
        rotation before its port closes (a client the balancer still sends meanwhile is served);
        then accept no more connections; let streaming segments finish within `grace_s`
        (default `shutdown_grace_s`); end every open Response with `response.incomplete` (reason
        `server_shutdown`) and close its WebSocket with 1001; return once every connection is
        closed, and `serve()` returns too."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.draining = True
        if self.config.drain_delay_s > 0:
            log.info("server.draining", extra={"delay_s": self.config.drain_delay_s})
            await trio.sleep(self.config.drain_delay_s)
        log.info(
            "server.stopping",
            extra={"grace_s": grace, "connections": self.open_connections},
        )
        self._listening.cancel()
        deadline = trio.current_time() + grace
        self.stopping = deadline
        for connection in list(self._websockets):
            connection.shut_down(deadline)
        for idle in list(self.idle_http):
            idle.cancel()
        with trio.move_on_at(deadline + CLOSE_WAIT_S + 1):
            while self.open_connections:
                await self._changed.wait()
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()  # whatever would not finish in time
        log.info("server.stopped", extra={"forced": self.open_connections})

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.open_connections >= self.config.max_connections:
            await self._turn_away(stream)
            return
        self._count(connections=1)
        try:
            head = None
            # one deadline for the whole handshake: the request head, and the upgrade after it
            deadline = trio.current_time() + self.config.handshake_timeout_s
            with trio.move_on_at(deadline) as waiting:
                try:
                    head = await read_request_head(
                        stream, max_bytes=self.config.max_request_head_bytes
                    )
                except BadRequestHead as exc:
                    await send_error(
                        stream, ProtocolError("bad_request", f"Malformed HTTP request: {exc}.")
                    )
                    return
            if waiting.cancelled_caught:
                timeout = self.config.handshake_timeout_s
                message = f"The request head did not arrive within {timeout:g} s; send it at once."
                with trio.move_on_after(1):  # a client that sends this slowly may not read either
                    await send_error(stream, ProtocolError("request_timeout", message, status=408))
                return
            if head is None:
                return
            if not head.is_websocket:
                await serve_http(self, stream, head)
            elif (refusal := upgrade_refusal(head)) is not None:
                await send_error(stream, refusal)
            else:
                await self._serve_websocket(stream, head, deadline)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed):
            pass  # the peer went away; everything it started is already cancelled
        except* Exception:
            # a bug in serving one connection must not take the others down with it
            self.crashed_connections += 1
            log.exception("connection.crashed")
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._count(connections=-1)

    async def _turn_away(self, stream: trio.SocketStream) -> None:
        """A connection past `max_connections`: 503 at once, before its head is read (a full
        server spends nothing on it), then closed; it is not counted as open."""
        limit = self.config.max_connections
        log.info("connection.refused", extra={"limit": limit})
        busy = ProtocolError(
            "server_busy",
            f"The server has reached its limit of {limit:,} open connections "
            "(--max-connections); retry later.",
            status=503,
            error_type="server_error",
        )
        try:
            with trio.move_on_after(2 * LINGER_S):  # a client that does not read cannot stay
                await send_error(stream, busy)
                await linger(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _serve_websocket(
        self, stream: trio.SocketStream, head: RequestHead, deadline: float
    ) -> None:
        async with trio.open_nursery() as nursery:
            with trio.move_on_at(deadline) as handshake:
                request = await wrap_server_stream(
                    nursery,
                    ReplayStream(stream, head.raw),
                    max_message_size=self.config.max_message_bytes,
                )
            if handshake.cancelled_caught:  # the upgrade never completed
                nursery.cancel_scope.cancel()
                return
            # the key first: without one, a client cannot even tell a valid path from a wrong one
            owner = self.owner(head.header(b"authorization"))
            if owner is None:
                await _reject(request, nursery, unauthorized())
                return
            if head.path.rstrip("/") not in (RESPONSES_PATH, "/responses"):
                refusal = ProtocolError(
                    "not_found",
                    f"No WebSocket endpoint at {head.path}; connect to {RESPONSES_PATH}.",
                    status=404,
                )
                await _reject(request, nursery, refusal)
                return
            dialect_name = select_dialect(head)
            ws, deflated = await accept_upgrade(
                request,
                extra_headers=[(MAX_MESSAGE_BYTES_HEADER, b"%d" % self.config.max_message_bytes)],
                deflate=self.config.permessage_deflate,
            )
            connection = Connection(
                ws,
                budget=self.connection_budget(),
                offload=self.offload,
                queue_events=self.config.client_queue_events,
                merge_deltas=self.config.merge_deltas,
                observer=self.observer,
                dialect=dialect_name,
                compressed=deflated,
            )
            log.info(
                "connection.opened",
                extra={
                    "connection": connection.id,
                    "dialect": dialect_name,
                    "path": head.target,
                    "deflate": deflated,
                },
            )
            dialect: Dialect
            beta = multi_agent_beta(head)
            if dialect_name == "prototype":
                dialect = PrototypeDialect(self, connection, nursery, owner=owner, multi_agent=beta)
            else:
                dialect = LaunchedDialect(self, connection, nursery, owner=owner, multi_agent=beta)
            self._websockets.add(connection)
            if self.stopping is not None:  # accepted just as the server began to stop
                connection.shut_down(self.stopping)
            try:
                await connection.run(
                    nursery, dialect, lifetime_s=self.config.max_connection_lifetime_s
                )
            finally:
                self._websockets.discard(connection)
                log.info("connection.closed", extra={"connection": connection.id})

    # -- Responses -------------------------------------------------------------------------------

    def check_create(self, create: ResponseCreate) -> None:
        """Refuse, when it arrives, a create this server cannot serve: what `check_create`
        refuses, a compaction item this server did not seal, and a forced tool call the
        generator cannot make."""
        check_create(create)
        check_compactions(input_items(create), self.compaction_key)
        self.check_forcing(parse_tool_choice(create.tool_choice))

    def check_forcing(self, choice: ToolChoice) -> None:
        """Refuse a forced tool call (`required`, a named function) the generator cannot make."""
        if choice.mode == "required" and not self.generator.forces_tool_calls:
            demanded = f"names {choice.name!r}" if choice.name is not None else 'is "required"'
            raise ProtocolError(
                "unsupported_tool_choice",
                f"`tool_choice` {demanded}: a forced tool call, which this server's generator "
                'cannot make yet; send "auto" (or "none") instead.',
                param="tool_choice",
            )

    def checked_bytes(self, create: ResponseCreate) -> int:
        """`check_create`, then about how much memory `create` holds while it waits."""
        self.check_create(create)
        return request_bytes(create)

    def connection_budget(self) -> MemoryBudget:
        """The memory budget of one connection, inside the process's."""
        return self.memory.child(
            self.config.max_connection_memory_bytes,
            flag="--max-connection-memory",
            name="connection",
        )

    def new_rollout(
        self, create: ResponseCreate, budget: MemoryBudget, prefix: list[int] | None = None
    ) -> Rollout:
        """A cold rollout: a conversation with only the rendered prefix, a fresh session."""
        conversation = Conversation(
            self.renderer, instructions=create.instructions, tools=create.tools, prefix=prefix
        )
        return self.rollout_of(conversation, budget)

    def rollout_of(self, conversation: Conversation, budget: MemoryBudget) -> Rollout:
        """A rollout on `conversation` (rendered already) with a fresh session: nothing warm."""
        self._count(rollouts=1)
        return Rollout(
            conversation,
            self.generator.open_session(conversation),
            budget=budget,
            on_close=lambda _: self._count(rollouts=-1),
        )

    async def begin_response(
        self,
        create: ResponseCreate,
        events: EventSink,
        *,
        budget: MemoryBudget,
        source: str,
        owner: str = ANONYMOUS,
        rollout: Rollout | None = None,
        history: Sequence[Item] = (),
        suspend_on_tool_calls: bool = False,
        announce_suspension: bool = True,
        response_id: str | None = None,
        size: int = 0,
    ) -> SamplingLoop:
        """A Response for `create`, on a warm `rollout` or on a new one holding `history`.

        Only what is new is rendered: the create's input on a warm rollout; the prefix, the
        history and the input on a cold one. Rendering runs off the event loop when the input
        is large (`size`: the bytes of the request; each history item counts as 1 KiB). What it
        adds must fit `budget`, else a `ProtocolError` says so and nothing changes (a warm
        `rollout` stays its caller's to close). Stored, it belongs to `owner`. `response_id`:
        the id a `response.queued` already announced; `suspend_on_tool_calls` and
        `announce_suspension`: see `ResponseMachine`.
        """
        arrived_at = trio.current_time()
        prepared = await self.offload.run(
            partial(prepare_input, cold=rollout is None),
            self.renderer,
            create,
            history,
            size=size + 1024 * len(history),
        )
        compaction = None
        discarded = 0  # tokens rendered for a prompt that compaction replaced: work all the same
        threshold = compaction_threshold(create)
        warm = rollout.conversation.token_count if rollout is not None else 0
        if threshold is not None and warm + prepared.tokens > threshold:
            # the prompt is over the client's threshold: served from its compaction, cold
            items = rollout.conversation.items if rollout is not None else prepared.history.items
            discarded = prepared.tokens
            prepared, compaction = await self.offload.run(
                compact_turn,
                self.renderer,
                create,
                [*items, *prepared.input.items],
                self.compaction_key,
                size=size + 1024 * len(items),
            )
            source = "compacted"
            if rollout is not None:
                await rollout.aclose()  # its state is of a prompt no longer served
                rollout = None
        budget.check(prepared.nbytes, "This request")
        if rollout is None:
            rollout = self.new_rollout(create, budget, prepared.prefix)
            rendered_mark = -discarded
            rollout.conversation.extend_rendered(prepared.history)
        else:
            rendered_mark = rollout.conversation.rendered_tokens
        conversation = rollout.conversation
        # a compacted Response stores the history it was served from: a chain restarts there
        first_item = 0 if compaction is not None else len(conversation.items)
        conversation.extend_rendered(prepared.input)
        rollout.account()
        if self.observer is not None:
            self.observer.rendered()
        response = response_template(
            create,
            response_id=response_id or new_id("resp"),
            created_at=int(time.time()),
            default_model=self.config.default_model,
        )
        machine = ResponseMachine(
            response=response,
            conversation=conversation,
            suspend_on_tool_calls=suspend_on_tool_calls,
            clock=lambda: int(time.time()),
            compaction=compaction,
            announce_suspension=announce_suspension,
            max_pending_steers=self.config.max_pending_steers,
            # as OpenAI's: a Response with automatic compaction is not steered
            steering="unsupported" if create.context_management else None,
        )

        durable = None
        # a stored prototype Response outlives its process: its suspensions are stored too
        prototype = suspend_on_tool_calls and announce_suspension
        if response.store and prototype and self.store.suspensions is not None:
            first_output = len(conversation.items)
            durable = Durable(self.store, owner, response.id, first_output=first_output)
        return SamplingLoop(
            machine,
            rollout,
            events,
            chunk_queue=self.config.chunk_queue,
            source=source,
            rendered_mark=rendered_mark,
            persist=self._persister(first_item, owner, durable) if response.store else None,
            on_end=self._turn_ended,
            observer=self.observer,
            suspensions=self.suspensions,
            suspend_timeout_s=self.config.suspend_timeout_s,
            arrived_at=arrived_at,
            durable=durable,
            warmup=is_warmup(create),
        )

    def _persister(
        self, first_item: int, owner: str, durable: Durable | None
    ) -> Callable[[ResponseMachine], Awaitable[None]]:
        """How an ended `store: true` Response is written: its items from `first_item` on, its
        stored suspension (if any) deleted in the same transaction."""

        async def persist(machine: ResponseMachine) -> None:
            items = tuple(machine.conversation.items[first_item:])
            stored = StoredResponse(response=machine.snapshot(), items=items, owner=owner)
            ends = durable.ends if durable is not None else None
            await self.store.put(stored, ends_suspension=ends)

        return persist

    def resumed_loop(
        self,
        machine: ResponseMachine,
        budget: MemoryBudget,
        events: EventSink,
        *,
        durable: Durable,
        owner: str,
    ) -> SamplingLoop:
        """The sampling loop of a suspended Response rebuilt from the store (`resume.py`): a
        fresh session on its re-rendered conversation, so its next prefill is cold."""
        rollout = self.rollout_of(machine.conversation, budget)
        return SamplingLoop(
            machine,
            rollout,
            events,
            chunk_queue=self.config.chunk_queue,
            source="store",
            rendered_mark=0,  # its whole prompt was rendered again: count it
            persist=self._persister(0, owner, durable),
            on_end=self._turn_ended,
            observer=self.observer,
            suspensions=self.suspensions,
            suspend_timeout_s=self.config.suspend_timeout_s,
            durable=durable,
            resumed=True,
        )

    def _turn_ended(self, record: TurnRecord) -> None:
        self.turns.append(record)
        metrics.turn_ended(
            source=record.source,
            rendered=record.rendered_input_tokens,
            prompt=record.prompt_tokens,
            cached=record.cached_tokens,
            prepare_s=record.prepare_s,
            decode_s=record.decode_s,
            first_event_s=record.first_event_s,
        )


async def _reject(request: WebSocketRequest, nursery: trio.Nursery, error: ProtocolError) -> None:
    """Refuse a WebSocket upgrade with a JSON error, then end the connection: trio-websocket
    would keep reading it, and a refused client would hold its place (`--max-connections`)."""
    json = [(b"content-type", b"application/json")]
    with trio.move_on_after(2 * LINGER_S):  # a client that does not read cannot stay
        await request.reject(error.status, extra_headers=json, body=error_body(error))
    nursery.cancel_scope.cancel()
