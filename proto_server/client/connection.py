"""`connect(url, dialect=...)`: one connection to a proto-server (or any Responses server).

    async with connect("http://127.0.0.1:8000/v1", dialect="prototype") as connection:
        rollout = await connection.create("fix the bug", tools=[EXEC_COMMAND])
        await rollout.step()                  # events until the suspension
        await rollout.append({call_id: "output"})
        await rollout.step()                  # ... until response.completed

The dialects: `prototype` (a WebSocket that opts in with `X-Proto-Dialect: prototype`; one
Response per rollout, resumed by `response.append`), `launched` (a WebSocket without the
opt-in; each turn is a `response.create` chained by `previous_response_id` carrying only the new
items), and `http` (`POST /v1/responses` with `stream: true` and the whole history every turn,
as a stateless client does). Events are decoded by the project's own converter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from proto_server.client.dialects import Dialect, rules
from proto_server.client.http import HttpWire
from proto_server.client.rollout import Rollout, wire_json
from proto_server.client.segment import Received, Sent
from proto_server.wire.converter import decode_server_event
from proto_server.wire.events import ServerEvent
from proto_server.wire.items import Item
from proto_server.wire.tools import Tool

#: Events trio-websocket buffers before the server's stream waits for this client.
MESSAGE_QUEUE = 256


class Wire(Protocol):
    async def send(self, body: Mapping[str, Any]) -> int: ...

    async def receive(self) -> tuple[int | None, ServerEvent, int]: ...


class WebSocketWire:
    def __init__(self, ws: WebSocketConnection) -> None:
        self._ws = ws

    async def send(self, body: Mapping[str, Any]) -> int:
        frame = orjson.dumps(body)
        await self._ws.send_message(frame.decode())
        return len(frame)

    async def receive(self) -> tuple[int | None, ServerEvent, int]:
        frame = await self._ws.get_message()
        sequence_number, event = decode_server_event(frame)
        size = len(frame.encode()) if isinstance(frame, str) else len(frame)
        return sequence_number, event, size


def endpoints(url: str) -> tuple[str, str]:
    """(WebSocket URL, HTTP URL) of the Responses endpoint, from either or from the base URL.

    `http://host:port/v1`, `http://host:port/v1/responses` and `ws://host:port/v1/responses`
    all name the same endpoint, as clients derive one from the other.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise ValueError(
            f"{url!r} is not a server URL; give e.g. http://127.0.0.1:8000/v1 or "
            "ws://127.0.0.1:8000/v1/responses."
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/responses"):
        path += "/responses"
    secure = parts.scheme in ("https", "wss")
    host = parts.netloc
    return (
        f"{'wss' if secure else 'ws'}://{host}{path}",
        f"{'https' if secure else 'http'}://{host}{path}",
    )


class Connection:
    """One connection; rollouts run on it one at a time."""

    def __init__(self, wire: Wire, dialect: Dialect) -> None:
        self.dialect = dialect
        self._wire = wire
        self.rollouts: list[Rollout] = []
        #: The last Response this connection saw end: a launched follow-up chains onto it.
        self.last_response_id: str | None = None
        #: Everything sent and received, in order: a recorded stream, e.g. for a checker.
        self.transcript: list[Sent | Received] = []

    async def create(
        self,
        input: str | Sequence[Item | Mapping[str, Any]],
        *,
        model: str | None = None,
        tools: Sequence[Tool | Mapping[str, Any]] = (),
        instructions: str | None = None,
        previous_response_id: str | None = None,
        **fields: Any,
    ) -> Rollout:
        """Start a rollout: send its `response.create` (or POST) and return its handle.

        `fields` are sent as given (e.g. `store=True`, `generate=False` for a launched warm-up).
        """
        current = self.rollouts[-1] if self.rollouts else None
        if current is not None and not current.state.ended:
            raise RuntimeError(
                f"rollout {current.response_id} is still {current.state.value} on this "
                "connection; finish it, or cancel() it, before creating another."
            )
        settings: dict[str, Any] = {"model": model, "instructions": instructions, **fields}
        settings = {key: value for key, value in settings.items() if value is not None}
        if tools:
            settings["tools"] = [wire_json(tool) for tool in tools]
        items = input if isinstance(input, str) else [wire_json(item) for item in input]
        rollout = Rollout(self, settings, items, previous_response_id)
        self.rollouts.append(rollout)
        await rollout.start()
        return rollout

    async def resume(
        self, response_id: str, outputs: Mapping[str, str] | Sequence[Item | Mapping[str, Any]]
    ) -> Rollout:
        """Resume, on this new connection, a prototype Response that suspended on another
        (dropped, or its server process gone): `response.append` naming it, with the outputs
        of the calls it waits on (`{call_id: output}` or items). The server rebuilds it cold from
        its store; the rollout goes on with the same id and output indices. A refusal
        (`response_not_found`, `response_already_resumed`, ...) ends the rollout `failed` with
        the error in `rollout.tracker.error`."""
        if self.dialect != "prototype":
            raise ValueError("resume() is the prototype dialect's: connect with it")
        current = self.rollouts[-1] if self.rollouts else None
        if current is not None and not current.state.ended:
            raise RuntimeError(f"rollout {current.response_id} is still open on this connection")
        if isinstance(outputs, Mapping):
            items: list[Any] = [
                {"type": "function_call_output", "call_id": call_id, "output": text}
                for call_id, text in outputs.items()
            ]
        else:
            items = [wire_json(item) for item in outputs]
        rollout = Rollout(self, {}, items, None)
        rollout.tracker.resumed = True
        self.rollouts.append(rollout)
        await rollout._send({"type": "response.append", "response_id": response_id, "input": items})
        return rollout

    async def reattach(self, response_id: str, *, starting_after: int = -1) -> Rollout:
        """Take up, on this new connection, a prototype Response whose connection dropped while
        it streamed (the server keeps it for `--reattach-grace`): `response.reattach` naming
        it and the last `sequence_number` this client saw. The server replays what it kept
        after that, then streams the rest live; the rollout goes on with the same id and
        numbers (`step()`, `append()`). A refusal (`response_not_found`,
        `reattach_events_lost`) ends the rollout `failed` with the error in
        `rollout.tracker.error`."""
        if self.dialect != "prototype":
            raise ValueError(
                "reattach() is the prototype dialect's: connect with it (over HTTP, GET "
                "/v1/responses/{id}?stream=true&starting_after=N)"
            )
        current = self.rollouts[-1] if self.rollouts else None
        if current is not None and not current.state.ended:
            raise RuntimeError(f"rollout {current.response_id} is still open on this connection")
        rollout = Rollout(self, {}, [], None)
        rollout.tracker.resumed = True
        self.rollouts.append(rollout)
        body = {"type": "response.reattach", "response_id": response_id}
        await rollout._send({**body, "starting_after": starting_after})
        return rollout

    async def send(self, body: Mapping[str, Any]) -> int:
        """Send one client event (WebSocket) or request body (HTTP) as given; bytes sent.

        The low-level door, for experiments and deliberately broken clients: a rollout's own
        bookkeeping does not see what goes through here.
        """
        at = trio.current_time()
        size = await self._wire.send(body)
        self.transcript.append(Sent(body, at, size))
        return size

    async def receive(self) -> Received:
        """The next server event, stamped with the trio clock and its size on the wire."""
        sequence_number, event, size = await self._wire.receive()
        received = Received(sequence_number, event, trio.current_time(), size)
        self.transcript.append(received)
        return received

    async def abort(self) -> None:
        """HTTP: drop the response being streamed (the only way to cancel a stateless turn)."""
        if isinstance(self._wire, HttpWire):
            await self._wire.abort()


@asynccontextmanager
async def connect(
    url: str, *, dialect: Dialect = "prototype", headers: Mapping[str, str] | None = None
) -> AsyncIterator[Connection]:
    """Open a connection in `dialect` to the server at `url`; closed when the block ends."""
    chosen = rules(dialect)
    ws_url, http_url = endpoints(url)
    extra = {**chosen.headers, **(headers or {})}
    if chosen.over_http:
        parts = urlsplit(http_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"{http_url}: this client speaks plain http:// only.")
        wire = HttpWire(parts.hostname, parts.port or 80, parts.path, extra)
        try:
            yield Connection(wire, dialect)
        finally:
            with trio.CancelScope(shield=True):
                await wire.aclose()
        return
    async with open_websocket_url(
        ws_url,
        extra_headers=[(name.encode(), value.encode()) for name, value in extra.items()],
        message_queue_size=MESSAGE_QUEUE,
    ) as ws:
        yield Connection(WebSocketWire(ws), dialect)
