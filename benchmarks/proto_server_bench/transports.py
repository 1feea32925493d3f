"""The four clients, over raw sockets that count every byte in both directions.

1. `http-stateless`: every turn POSTs the whole history (what a client without state does).
2. `http-previous`: every turn POSTs the new items and `previous_response_id`, `store: true`:
   the server rebuilds the conversation from its persisted store.
3. `ws-launched`: one WebSocket, a `response.create` per turn with `previous_response_id` and the
   new items (Codex 0.171): served from the connection's warm rollout.
4. `ws-prototype`: one WebSocket, one Response; each turn is a `response.append` (Codex 0.107).

Like Codex, every request but the prototype's appends carries the tool definitions again. The
clients do what a real one must: encode the request, parse every event (orjson), keep what the
protocol makes them keep. HTTP is h11 over a keep-alive connection with Server-Sent Events; the
WebSockets are trio-websocket. Both wrap a `CountingStream`, so bytes include HTTP heads, SSE and
WebSocket framing.
"""

from __future__ import annotations

import abc
import time
from typing import Any, ClassVar

import attrs
import h11
import orjson
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.events import Request
from wsproto.extensions import PerMessageDeflate

from proto_server_bench.workload import MODEL, Workload

TURN_ENDS = frozenset(
    {
        "response.done",
        "response.completed",
        "response.failed",
        "response.incomplete",
        "response.cancelled",
        "error",
    }
)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class BenchError(Exception):
    """The server did not answer a benchmark request as the protocol says."""


class CountingStream(trio.abc.HalfCloseableStream):
    """A socket stream that counts the bytes it sends and receives."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner = inner
        self.sent = 0
        self.received = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)
        self.sent += len(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(max_bytes)
        self.received += len(data)
        return bytes(data)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.frozen
class ClientTurn:
    """One turn as the client lived it: measured wall time and CPU time, bytes each way."""

    wall_s: float
    cpu_s: float
    bytes_up: int
    bytes_down: int
    events: int


def _check(events: list[dict[str, Any]]) -> dict[str, Any]:
    last = events[-1]
    if last["type"] not in ("response.done", "response.completed"):
        raise BenchError(f"a turn ended with {orjson.dumps(last).decode()[:500]}")
    return last


class Transport(abc.ABC):
    name: ClassVar[str]
    label: ClassVar[str]

    def __init__(self, workload: Workload, nonce: str) -> None:
        self.workload = workload
        self.nonce = nonce
        self.stream: CountingStream | None = None

    def fields(self) -> dict[str, Any]:
        """What every create carries, as Codex sends it."""
        return {
            "model": MODEL,
            "tools": self.workload.tools,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "prompt_cache_key": self.nonce,
        }

    async def connect(self, nursery: trio.Nursery, host: str, port: int) -> None:
        self.stream = CountingStream(await trio.open_tcp_stream(host, port))
        await self._open(nursery, host, port)

    @abc.abstractmethod
    async def _open(self, nursery: trio.Nursery, host: str, port: int) -> None: ...

    @abc.abstractmethod
    async def turn(self, new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send one request with `new_items`; the events it got back, the last one ending it."""

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


# -- HTTP ----------------------------------------------------------------------------------------


class _Http(Transport):
    async def _open(self, nursery: trio.Nursery, host: str, port: int) -> None:
        self._host = f"{host}:{port}"
        self._conn = h11.Connection(h11.CLIENT)

    async def post(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """POST /v1/responses with `stream: true`; every Server-Sent Event, parsed."""
        assert self.stream is not None
        data = orjson.dumps(body)
        conn = self._conn
        headers = [
            ("host", self._host),
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
            ("content-length", str(len(data))),
        ]
        await self.stream.send_all(
            (conn.send(h11.Request(method="POST", target="/v1/responses", headers=headers)) or b"")
            + (conn.send(h11.Data(data=data)) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )
        events: list[dict[str, Any]] = []
        pending = b""
        status = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                received = await self.stream.receive_some(65536)
                if not received:
                    raise BenchError("the server closed the HTTP connection mid-response")
                conn.receive_data(received)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                pending += event.data
                if status != 200:
                    continue
                *blocks, pending = pending.split(b"\n\n")
                for block in blocks:
                    _, _, payload = block.partition(b"\ndata: ")
                    events.append(orjson.loads(payload))
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                if status != 200:
                    raise BenchError(f"POST /v1/responses answered {status}: {pending[:500]!r}")
                return events
            else:
                raise BenchError(f"unexpected HTTP event {event!r}")


class HttpStateless(_Http):
    name = "http-stateless"
    label = "HTTP, full history"

    def __init__(self, workload: Workload, nonce: str) -> None:
        super().__init__(workload, nonce)
        self.history: list[dict[str, Any]] = []

    async def turn(self, new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.history.extend(new_items)
        body = {**self.fields(), "input": self.history, "store": False, "stream": True}
        events = await self.post(body)
        _check(events)
        self.history.extend(e["item"] for e in events if e["type"] == "response.output_item.done")
        return events


class HttpPrevious(_Http):
    name = "http-previous"
    label = "HTTP + previous_response_id"

    def __init__(self, workload: Workload, nonce: str) -> None:
        super().__init__(workload, nonce)
        self.previous: str | None = None

    async def turn(self, new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {**self.fields(), "input": new_items, "store": True, "stream": True}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        events = await self.post(body)
        self.previous = _check(events)["response"]["id"]
        return events


# -- WebSocket -----------------------------------------------------------------------------------


async def open_websocket(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    deflate: bool = False,
    receive_buffer_size: int = 65536,
) -> WebSocketConnection:
    """trio-websocket's `wrap_client_stream`, offering permessage-deflate if `deflate` (as Codex
    0.171 does): trio-websocket 0.12 offers no extensions, so its handshake request is replaced
    by one that does before the connection starts."""
    ws = WebSocketConnection(
        stream,
        WSConnection(ConnectionType.CLIENT),
        host=host,
        path=resource,
        message_queue_size=64,
        max_message_size=MAX_MESSAGE_BYTES,
        receive_buffer_size=receive_buffer_size,
    )
    if deflate:
        ws._initial_request = Request(host=host, target=resource, extensions=[PerMessageDeflate()])
    nursery.start_soon(ws._reader_task)
    await ws._open_handshake.wait()
    return ws


class _WebSocket(Transport):
    resource: ClassVar[str] = "/v1/responses"
    deflate: ClassVar[bool] = False

    async def _open(self, nursery: trio.Nursery, host: str, port: int) -> None:
        assert self.stream is not None
        self.ws: WebSocketConnection = await open_websocket(
            nursery, self.stream, host, self.resource, deflate=self.deflate
        )

    async def exchange(self, frame: dict[str, Any]) -> list[dict[str, Any]]:
        await self.ws.send_message(orjson.dumps(frame).decode())
        events = []
        try:
            while True:
                event = orjson.loads(await self.ws.get_message())
                events.append(event)
                if event["type"] in TURN_ENDS:
                    return events
        except ConnectionClosed as exc:
            raise BenchError(f"the server closed the WebSocket: {exc.reason}") from None

    async def aclose(self) -> None:
        with trio.move_on_after(2):
            await self.ws.aclose()
        await super().aclose()


class WsLaunched(_WebSocket):
    name = "ws-launched"
    label = "WebSocket, launched dialect"

    def __init__(self, workload: Workload, nonce: str) -> None:
        super().__init__(workload, nonce)
        self.previous: str | None = None

    async def turn(self, new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        frame = {"type": "response.create", **self.fields(), "input": new_items, "store": False}
        if self.previous is not None:
            frame["previous_response_id"] = self.previous
        events = await self.exchange(frame)
        self.previous = _check(events)["response"]["id"]
        return events


class WsLaunchedDeflate(WsLaunched):
    """`ws-launched` offering permessage-deflate, as Codex 0.171 does (`bench.deflate`)."""

    name = "ws-launched-deflate"
    label = "WebSocket, launched dialect, permessage-deflate offered"
    deflate = True


class WsPrototype(_WebSocket):
    name = "ws-prototype"
    label = "WebSocket, prototype dialect"
    resource = "/v1/responses?dialect=prototype"

    def __init__(self, workload: Workload, nonce: str) -> None:
        super().__init__(workload, nonce)
        self.created = False

    async def turn(self, new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.created:
            frame: dict[str, Any] = {"type": "response.append", "input": new_items}
        else:
            frame = {"type": "response.create", **self.fields(), "input": new_items, "store": False}
            self.created = True
        events = await self.exchange(frame)
        _check(events)
        return events


TRANSPORTS: tuple[type[Transport], ...] = (HttpStateless, HttpPrevious, WsLaunched, WsPrototype)
BASELINE = HttpStateless.name


async def run_rollout(
    transport_type: type[Transport], host: str, port: int, workload: Workload, nonce: str
) -> list[ClientTurn]:
    """The whole rollout through one transport; each turn as the client measured it.

    A turn runs from the moment the client has its new items (the tool ran instantly) to the
    event that ends it; the first turn includes opening the connection.
    """
    turns: list[ClientTurn] = []
    async with trio.open_nursery() as nursery:
        transport = transport_type(workload, nonce)
        new_items = workload.opening(nonce)
        up = down = 0
        for index in range(workload.turns):
            wall, cpu = time.perf_counter(), time.process_time()
            if index == 0:
                await transport.connect(nursery, host, port)
            events = await transport.turn(new_items)
            stream = transport.stream
            assert stream is not None
            turns.append(
                ClientTurn(
                    wall_s=time.perf_counter() - wall,
                    cpu_s=time.process_time() - cpu,
                    bytes_up=stream.sent - up,
                    bytes_down=stream.received - down,
                    events=len(events),
                )
            )
            up, down = stream.sent, stream.received
            if index < len(workload.rounds):
                calls = [
                    e["item"]
                    for e in events
                    if e["type"] == "response.output_item.done"
                    and e["item"]["type"] == "function_call"
                ]
                if len(calls) != 1:
                    raise BenchError(f"turn {index + 1} made {len(calls)} tool calls, not 1")
                new_items = [workload.tool_output(index, calls[0]["call_id"])]
        await transport.aclose()
        nursery.cancel_scope.cancel()
    return turns
