"""The server: one listener for HTTP and WebSocket, a nursery per connection.

It accepts, reads each request's head, routes it (HTTP to `http.py`, a WebSocket upgrade to its
dialect) and stops gracefully; what a Response is built from is `Responses`' (responses.py),
which it makes once and hands to every dialect and HTTP exchange.

server nursery (serve)
 ├─ the generator's own task, if it has one (engine replicas' probe: engine/replicas.py)
 ├─ admission shared with other processes (--admission-shared: server/rollouts/admission.py)
 └─ connection nursery (one per socket, _handle)
     ├─ trio-websocket's reader
     ├─ reader (connection.py) and writer (writer.py)
     ├─ the launched dialect's turn loop (launched.py)
     └─ rollout nurseries (sampling.py): generator task + sampling loop
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from functools import partial

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, wrap_server_stream

from proto_server.core.render import Renderer
from proto_server.engine.base import SupervisedGenerator, TokenGenerator
from proto_server.server.dialects.registry import (
    DIALECTS,
    OUTPUT_FROM_ITEMS,
    multi_agent_beta,
    select_dialect,
)
from proto_server.server.dialects.routes import unauthorized
from proto_server.server.listener.keepalive import serve_http
from proto_server.server.listener.overflow import Overflow
from proto_server.server.process import metrics
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.logs import log
from proto_server.server.rollouts.responses import Responses
from proto_server.server.store import ResponseStore
from proto_server.server.transport.connection import CLOSE_WAIT_S, SERVER_SHUTDOWN, Connection
from proto_server.server.transport.handshake import (
    BadRequestHead,
    ReplayStream,
    RequestHead,
    accept_upgrade,
    read_request_head,
    upgrade_refusal,
)
from proto_server.server.transport.http import LINGER_S, Shutdown, error_body, send_error
from proto_server.server.transport.sendtimeout import SendTimeoutStream
from proto_server.server.transport.writer import EventBound
from proto_server.wire.errors import ProtocolError

RESPONSES_PATH = "/v1/responses"
#: Codex 0.171 reads the largest frame the server takes from this upgrade-response header.
MAX_MESSAGE_BYTES_HEADER = b"x-codex-websocket-max-message-bytes"


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
    """The listener, the handshake and shutdown; Responses are built by `responses`."""

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
        self.responses = Responses(
            generator,
            config,
            renderer=renderer,
            store=store,
            compaction_secret=compaction_secret,
            on_rollout=lambda opened: self._count(rollouts=opened),
        )
        #: A socket bound by someone else (the supervisor of `--workers`): accept on it instead.
        self._listener = listener
        self.open_connections = 0
        self.open_rollouts = 0
        #: Connections ended by an unexpected exception (logged as `connection.crashed`).
        self.crashed_connections = 0
        #: Draining, then stopping (with the deadline `shutdown()` sets once it stops listening),
        #: as the HTTP connections and the WebSockets accepted since see it.
        self._http = Shutdown()
        self._overflow = Overflow(self.responses, self._http)
        self._websockets: set[Connection] = set()
        self._listening = trio.CancelScope()
        self._handlers: trio.Nursery | None = None
        self._changed = trio.Event()

    @property
    def config(self) -> ServerConfig:
        return self.responses.config

    @property
    def draining(self) -> bool:
        """Set at the very start of `shutdown()`: from then on `/readyz` answers 503, while the
        server still accepts for `drain_delay_s` (so a balancer stops sending first)."""
        return self._http.draining

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

    # -- listening -------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen until cancelled or `shutdown()`; `nursery.start(server.serve)` returns the
        bound address."""
        config = self.config
        async with trio.open_nursery() as background:
            generator = self.responses.generator
            if isinstance(generator, SupervisedGenerator):  # its engines' probe
                await background.start(generator.supervise)
            await self._share_admission(background)
            async with trio.open_nursery() as handlers:
                self._handlers = handlers
                # until shutdown() stopped them; named for what it is: not a rollout
                runs = self.responses.background
                await handlers.start(runs.serve, name="background Responses")
                listeners = await handlers.start(self._listen, handlers)
                port = listeners[0].socket.getsockname()[1]
                address = BoundAddress(config.host, port)
                log.info("server.listening", extra={"url": address.ws_url})
                task_status.started(address)
            background.cancel_scope.cancel()

    async def _share_admission(self, background: trio.Nursery) -> None:
        """With --admission-shared, admit beside the other processes using the same store."""
        admission, config = self.responses.admission, self.config
        if admission is None or not config.admission_shared:
            return
        loads = self.responses.store.loads
        if loads is None:
            raise ValueError("--admission-shared needs a store that keeps the processes' loads")
        peer = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        await background.start(
            partial(admission.share, loads, peer=peer, interval_s=config.admission_sync_interval_s)
        )

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

    async def shutdown(
        self,
        grace_s: float | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Stop gracefully: first be not ready (`/readyz` 503) while still accepting and
        serving for `drain_delay_s`, so a balancer's health check takes this process out of
        rotation before its port closes (a client the balancer still sends meanwhile is served);
        then accept no more connections; let streaming segments finish within `grace_s`
        (default `shutdown_grace_s`), and background Responses as long; end every open Response
        with `response.incomplete` (reason `server_shutdown`) and close its WebSocket with
        1001; return once every connection is closed, and `serve()` returns too. Started
        (`nursery.start`) once `/readyz` says 503."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._http.draining = True
        task_status.started()
        if self.config.drain_delay_s > 0:
            log.info("server.draining", extra={"delay_s": self.config.drain_delay_s})
            await trio.sleep(self.config.drain_delay_s)
        log.info(
            "server.stopping",
            extra={"grace_s": grace, "connections": self.open_connections},
        )
        self._listening.cancel()
        deadline = trio.current_time() + grace
        self._http.stop(deadline)
        for connection in list(self._websockets):
            connection.shut_down(deadline)
        self.responses.detached.stop()  # no client will reattach: cut what waits for one
        await self.responses.background.stop(deadline, SERVER_SHUTDOWN)
        with trio.move_on_at(deadline + CLOSE_WAIT_S + 1):
            while self.open_connections:
                await self._changed.wait()
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()  # whatever would not finish in time
        log.info("server.stopped", extra={"forced": self.open_connections})

    async def _handle(self, socket_stream: trio.SocketStream) -> None:
        # a connection open only for what it keeps for a reattach is no client's: not counted
        if self.open_connections - self.responses.detached.holding >= self.config.max_connections:
            await self._overflow.turn_away(socket_stream)
            return
        stream = SendTimeoutStream(socket_stream, self.config.send_timeout_s)
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
                head = await serve_http(self.responses, self._http, stream, head)
                if head is None:
                    return
                # an upgrade after HTTP on the same connection: its own handshake deadline
                deadline = trio.current_time() + self.config.handshake_timeout_s
            if (refusal := upgrade_refusal(head)) is not None:
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

    async def _serve_websocket(
        self, stream: SendTimeoutStream, head: RequestHead, deadline: float
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
            owner = self.responses.tenants.owner(head.header(b"authorization"))
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
            try:
                dialect_name = select_dialect(head)
            except ProtocolError as refusal:
                await _reject(request, nursery, refusal)
                return
            ws, deflated = await accept_upgrade(
                request,
                extra_headers=[(MAX_MESSAGE_BYTES_HEADER, b"%d" % self.config.max_message_bytes)],
                deflate=self.config.permessage_deflate,
            )
            responses = self.responses
            connection = Connection(
                ws,
                budget=responses.connection_budget(),
                offload=responses.offload,
                queue_events=self.config.client_queue_events,
                merge_deltas=self.config.merge_deltas,
                observer=responses.observer,
                dialect=dialect_name,
                compressed=deflated,
                bound=EventBound(
                    self.config.max_event_bytes, omit_output=dialect_name in OUTPUT_FROM_ITEMS
                ),
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
            dialect = DIALECTS[dialect_name](
                responses, connection, nursery, owner=owner, multi_agent=multi_agent_beta(head)
            )
            self._websockets.add(connection)
            if self._http.deadline is not None:  # accepted just as the server began to stop
                connection.shut_down(self._http.deadline)
            try:
                async with contextlib.aclosing(dialect):
                    await connection.run(
                        nursery, dialect, lifetime_s=self.config.max_connection_lifetime_s
                    )
            finally:
                self._websockets.discard(connection)
                log.info("connection.closed", extra={"connection": connection.id})


async def _reject(request: WebSocketRequest, nursery: trio.Nursery, error: ProtocolError) -> None:
    """Refuse a WebSocket upgrade with a JSON error, then end the connection: trio-websocket
    would keep reading it, and a refused client would hold its place (`--max-connections`)."""
    json = [(b"content-type", b"application/json")]
    with trio.move_on_after(2 * LINGER_S):  # a client that does not read cannot stay
        await request.reject(error.status, extra_headers=json, body=error_body(error))
    nursery.cancel_scope.cancel()
