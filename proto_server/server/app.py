"""The server: one listener for HTTP and WebSocket, a nursery per connection.

server nursery (serve)
 └─ connection nursery (one per socket, _handle)
     ├─ trio-websocket's reader
     ├─ writer and reader (connection.py)
     └─ rollout nursery (rollout.py): generator task + sampling loop
"""

from __future__ import annotations

import time
from functools import partial
from typing import Literal

import attrs
import h11
import orjson
import trio
from trio_websocket import wrap_server_stream

from proto_server.core.conversation import Conversation
from proto_server.core.ids import new_id
from proto_server.core.render import O200kRenderer, Renderer
from proto_server.core.request import input_items, response_settings
from proto_server.core.response import ResponseMachine
from proto_server.engine.base import TokenGenerator
from proto_server.server.config import ServerConfig
from proto_server.server.connection import Connection
from proto_server.server.handshake import (
    BadRequestHead,
    ReplayStream,
    RequestHead,
    read_request_head,
)
from proto_server.server.logs import log
from proto_server.server.prototype import PrototypeDialect
from proto_server.server.rollout import Rollout
from proto_server.wire.events import ResponseCreate

RESPONSES_PATH = "/v1/responses"
PROTOTYPE_BETA = "responses_websockets=2026-02-04"
DialectName = Literal["prototype", "launched"]


def select_dialect(head: RequestHead) -> DialectName:
    """Prototype if the client opts in: Codex's beta header, or this project's own opt-in."""
    beta = head.header(b"openai-beta") or ""
    if PROTOTYPE_BETA in beta.replace(" ", "").split(","):
        return "prototype"
    if (head.header(b"x-proto-dialect") or "").lower() == "prototype":
        return "prototype"
    _, _, query = head.target.partition("?")
    if "dialect=prototype" in query.split("&"):
        return "prototype"
    return "launched"


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
    ) -> None:
        self.config = config or ServerConfig()
        self.generator = generator
        self.renderer = renderer or O200kRenderer()
        self.open_connections = 0
        self.open_rollouts = 0
        self._changed = trio.Event()

    def _count(self, *, connections: int = 0, rollouts: int = 0) -> None:
        self.open_connections += connections
        self.open_rollouts += rollouts
        self._changed.set()
        self._changed = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no connection and no rollout is open (every one has released its state)."""
        while self.open_connections or self.open_rollouts:
            await self._changed.wait()

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen until cancelled; `nursery.start(server.serve)` returns the bound address."""
        config = self.config
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._handle, config.port, host=config.host)
            )
            port = listeners[0].socket.getsockname()[1]
            address = BoundAddress(config.host, port)
            log.info("server.listening", extra={"url": address.ws_url})
            task_status.started(address)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self._count(connections=1)
        try:
            head = None
            with trio.move_on_after(self.config.handshake_timeout_s):
                try:
                    head = await read_request_head(
                        stream, max_bytes=self.config.max_request_head_bytes
                    )
                except BadRequestHead as exc:
                    await _send_plain(stream, 400, f"Malformed HTTP request: {exc}.")
                    return
            if head is None:
                return
            if head.is_websocket:
                await self._serve_websocket(stream, head)
            else:
                await self._serve_http(stream, head)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away; everything it started is already cancelled
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._count(connections=-1)

    async def _serve_websocket(self, stream: trio.SocketStream, head: RequestHead) -> None:
        async with trio.open_nursery() as nursery:
            request = await wrap_server_stream(
                nursery,
                ReplayStream(stream, head.raw),
                max_message_size=self.config.max_message_bytes,
            )
            if head.path.rstrip("/") not in (RESPONSES_PATH, "/responses"):
                await request.reject(
                    404,
                    body=f"No WebSocket endpoint at {head.path}; use {RESPONSES_PATH}.".encode(),
                )
                return
            dialect_name = select_dialect(head)
            if dialect_name != "prototype":
                await request.reject(
                    400,
                    body=b"This server speaks the prototype dialect on the WebSocket: send "
                    b"'OpenAI-Beta: responses_websockets=2026-02-04', 'X-Proto-Dialect: prototype' "
                    b"or ?dialect=prototype.",
                )
                return
            ws = await request.accept()
            connection = Connection(ws, queue_events=self.config.client_queue_events)
            log.info(
                "connection.opened",
                extra={"connection": connection.id, "dialect": dialect_name, "path": head.target},
            )
            dialect = PrototypeDialect(self, connection, nursery)
            try:
                await connection.run(nursery, dialect)
            finally:
                log.info("connection.closed", extra={"connection": connection.id})

    async def _serve_http(self, stream: trio.SocketStream, head: RequestHead) -> None:
        if head.path == "/healthz":
            await _send_json(stream, head.connection, 200, {"status": "ok"})
            return
        await _send_json(
            stream,
            head.connection,
            404,
            {
                "error": {
                    "type": "invalid_request_error",
                    "code": "not_found",
                    "message": f"Nothing is served at {head.request.method.decode()} {head.path}. "
                    f"Open a WebSocket at {RESPONSES_PATH}.",
                    "param": None,
                }
            },
        )

    def open_rollout(self, create: ResponseCreate, connection: Connection) -> Rollout:
        """A new Response with a fresh conversation and generator session, not yet running."""
        settings = response_settings(create, default_model=self.config.default_model)
        conversation = Conversation(
            self.renderer, instructions=settings.instructions, tools=settings.tools
        )
        conversation.extend(input_items(create))
        machine = ResponseMachine(
            response_id=new_id("resp"),
            created_at=int(time.time()),
            settings=settings,
            conversation=conversation,
        )
        self._count(rollouts=1)
        log.debug(
            "rollout.opened",
            extra={"connection": connection.id, "response": machine.id, "open": self.open_rollouts},
        )
        return Rollout(
            machine,
            self.generator.open_session(conversation),
            connection.events,
            chunk_queue=self.config.chunk_queue,
            on_exit=self._rollout_closed,
        )

    def _rollout_closed(self, rollout: Rollout) -> None:
        self._count(rollouts=-1)


async def _send_json(
    stream: trio.abc.Stream, conn: h11.Connection, status: int, body: object
) -> None:
    data = orjson.dumps(body)
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
    await stream.send_all(conn.send(h11.Data(data=data)) or b"")
    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")


async def _send_plain(stream: trio.abc.Stream, status: int, text: str) -> None:
    body = text.encode()
    await stream.send_all(
        b"HTTP/1.1 %d Bad Request\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, len(body), body)
    )
