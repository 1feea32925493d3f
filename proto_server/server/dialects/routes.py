"""The HTTP routes on the same port: the stateless Responses API, health, readiness, metrics.

    POST   /v1/responses                  stream: true -> Server-Sent Events; else one Response;
                                          background: true -> run by the process (streams.py)
    GET    /v1/responses/{id}             a stored (or running background) Response; with
                                          ?stream=true&starting_after=N, a reattach to one in
                                          flight (streams.py)
    POST   /v1/responses/{id}/cancel      a running Response cancelled, whoever streams it
    GET    /v1/responses/{id}/input_items what it was given as input, paged as OpenAI pages it
    DELETE /v1/responses/{id}             a stored Response deleted (a chain through it breaks)
    POST   /v1/responses/input_tokens     the prompt tokens a create would be served with
    GET    /v1/models[/{id}]              the engine's models (vLLM), else the served model
    POST   /v1/responses/compact          a compacted history to start a new chain from
                                          (compacting.py)
    GET  /healthz                 liveness
    GET  /readyz                  readiness: 503 while shutting down, or the store or engine
                                  does not answer (with engine replicas: none does; the body
                                  lists each replica)
    GET  /metrics                 the Prometheus scrape (metrics.py), behind auth when it is on
    /admin/...                    a pause for a weight update, behind --admin-key (admin.py)

Every request is cold, as a stateless API must be: the whole history is rendered and prefilled
again; `previous_response_id` is served from the persisted store, which answers each API key
with only its own responses. Connections are kept alive; a store that cannot answer is a 503
(`store_unavailable`) and the connection stays open.

The h11 plumbing they stand on is http.py; the SSE framing, sse.py; a connection's requests one
after another, keepalive.py. Each route is a method of one `Exchange` (a request and its
answer: its owner once authorized, its body limit, the connection's budget), and `serve` is
the route table.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import orjson
import trio

from proto_server.core.paging import PageQuery, page, parse_page_query
from proto_server.core.response.status import TERMINAL_EVENTS
from proto_server.engine.base import ListedGenerator, ProbedGenerator
from proto_server.engine.replicas import ReplicatedGenerator
from proto_server.server.dialects.admin import AdminRequest, is_admin, serve_admin
from proto_server.server.dialects.compacting import compaction
from proto_server.server.dialects.streams import (
    create_background,
    not_in_flight,
    serve_reattach,
    starting_after,
    stream_created,
)
from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.process.memory import MemoryBudget, preparing_bytes
from proto_server.server.rollouts.inflight import cancelled, check_cancellable
from proto_server.server.rollouts.responses import Responses
from proto_server.server.rollouts.turns import TurnSource
from proto_server.server.store import (
    ANONYMOUS,
    ProbedStore,
    StoredResponse,
    chain_items,
    history_of,
)
from proto_server.server.transport.http import (
    Shutdown,
    read_body,
    send_error,
    send_json,
)
from proto_server.server.transport.outbox import LaneSink, Outgoing
from proto_server.server.transport.writer import (
    ECHOED_VALUE_BYTES,
    response_bytes,
)
from proto_server.wire.converter import converter, decode_request_body, encode_json_bytes
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import ResponseCreate, ServerEvent
from proto_server.wire.items import Item, item_id, listed
from proto_server.wire.response import Response

RESPONSES = "/v1/responses/"
INPUT = "/input_items"
CANCEL = "/cancel"


def _not_stored(response_id: str) -> ProtocolError:
    return ProtocolError(
        "response_not_found",
        f"No stored response {quoted(response_id)}: only store: true responses are kept, "
        "until the retention limit or until deleted.",
        status=404,
    )


def unauthorized() -> ProtocolError:
    return ProtocolError(
        "invalid_api_key",
        "Missing or wrong API key. Send `Authorization: Bearer <key>` with one of the keys the "
        "server was started with (--api-key or PROTO_SERVER_API_KEYS).",
        status=401,
    )


class Exchange:
    def __init__(
        self,
        responses: Responses,
        shutdown: Shutdown,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        budget: MemoryBudget,
    ) -> None:
        self.responses = responses
        self.shutdown = shutdown
        self.budget = budget
        self.stream = stream
        self.conn = conn
        self.method = request.method.decode()
        path, _, self.query = request.target.decode("latin-1").partition("?")
        self.path = path.rstrip("/")
        self.authorization = next(
            (v.decode("latin-1") for k, v in request.headers if k == b"authorization"), None
        )
        length = next((v for k, v in request.headers if k == b"content-length"), None)
        self.declared_length = None if length is None else int(length)  # h11 checked it
        self.owner = ANONYMOUS  # whose stored responses it may see, once authorized

    async def serve(self) -> None:
        route = (self.method, self.path)
        if route == ("GET", "/healthz"):
            await self._json(200, {"status": "ok"})
            return
        if route == ("GET", "/readyz"):
            await self._ready()
            return
        if is_admin(self.path):  # a key of their own, never a client's
            admin = AdminRequest(method=self.method, path=self.path, query=self.query,
                                 authorization=self.authorization, body=self._body)  # fmt: skip
            await serve_admin(self.responses, self.stream, self.conn, admin)
            return
        owner = self.responses.tenants.owner(self.authorization)  # before the route: see app.py
        if owner is None:
            raise unauthorized()
        self.owner = owner
        if route == ("GET", "/metrics"):  # behind auth when auth is on, like the API
            body = await trio.to_thread.run_sync(metrics.exposition)
            await send_json(
                self.stream, self.conn, 200, body, ("content-type", metrics.CONTENT_TYPE)
            )
        elif route == ("POST", "/v1/responses"):
            await self._create()
        elif route == ("POST", "/v1/responses/compact"):
            await self._compact()
        elif route == ("POST", "/v1/responses/input_tokens"):
            await self._input_tokens()
        elif (
            self.method == "POST" and self.path.startswith(RESPONSES) and self.path.endswith(CANCEL)
        ):
            await self._cancel(self.path.removeprefix(RESPONSES).removesuffix(CANCEL))
        elif route == ("GET", "/v1/models"):
            await self._json(200, {"object": "list", "data": await self._models()})
        elif self.method == "GET" and self.path.startswith("/v1/models/"):
            await self._retrieve_model(self.path.removeprefix("/v1/models/"))
        elif self.method == "GET" and self.path.startswith(RESPONSES) and self.path.endswith(INPUT):
            await self._input_items(self.path.removeprefix(RESPONSES).removesuffix(INPUT))
        elif self.method == "GET" and self.path.startswith(RESPONSES):
            await self._retrieve(self.path.removeprefix(RESPONSES))
        elif self.method == "DELETE" and self.path.startswith(RESPONSES):
            await self._delete(self.path.removeprefix(RESPONSES))
        else:
            raise ProtocolError(
                "not_found",
                f"Nothing is served at {self.method} {self.path}. Try POST /v1/responses, or a "
                "WebSocket at /v1/responses.",
                status=404,
            )

    async def _ready(self) -> None:
        """200 when this process should get new clients: it is not shutting down, the store
        answers and the generator's engine answers; else 503 saying why (the first code)."""
        problems: list[tuple[str, str]] = []
        if self.shutdown.draining:
            problems.append(("server_shutting_down", "the server is shutting down"))
        else:
            store, generator = self.responses.store, self.responses.generator
            if isinstance(store, ProbedStore) and (problem := await store.readiness()):
                problems.append(("store_unavailable", problem))
            if isinstance(generator, ProbedGenerator) and (problem := await generator.readiness()):
                problems.append(("engine_unavailable", problem))
        engines = self.responses.generator
        replicas = (
            [attrs.asdict(state) for state in engines.states()]
            if isinstance(engines, ReplicatedGenerator)
            else None
        )  # as the readiness check above just saw them
        if not problems:
            ready: dict[str, Any] = {"status": "ready"}
            if replicas is not None:
                ready["engines"] = replicas
            await self._json(200, ready)
            return
        message = "; ".join(why for _, why in problems)
        unready = ProtocolError(
            problems[0][0], f"Not ready: {message}.", error_type="server_error", status=503
        )
        await send_error(self.stream, unready, self.conn)

    async def _json(self, status: int, body: Any) -> int:
        """Answer with `body` as JSON; the bytes it took."""
        encoded = orjson.dumps(body)
        await send_json(self.stream, self.conn, status, encoded)
        return len(encoded)

    async def _body(self) -> bytes:
        config = self.responses.config
        return await read_body(
            self.stream,
            self.conn,
            config.max_message_bytes,
            config.handshake_timeout_s,
            self.declared_length,
        )

    async def _history(self, previous: str | None) -> list[Item]:
        if previous is None:
            return []
        return await history_of(self.responses.store, previous, owner=self.owner)

    async def _decode(self, body: bytes) -> ResponseCreate:
        """The body as a create, decoded off the event loop when it is large, while the process
        budget holds the peak memory that may take."""
        with self.responses.memory.reserve(preparing_bytes(body), "This request"):
            return await self.responses.offload.run(
                decode_request_body, body, ResponseCreate, size=len(body)
            )

    async def _create(self) -> None:
        responses = self.responses
        body = await self._body()
        observer = responses.observer
        if observer is not None:
            observer.received()
        create = await self._decode(body)
        if observer is not None:
            observer.decoded()
        await responses.check(create, size=len(body))
        history = await self._history(create.previous_response_id)
        if create.background:
            queued = await create_background(
                responses, self.stream, self.conn, create, history, owner=self.owner,
                size=len(body),
            )  # fmt: skip
            if queued is not None:
                await self._response_json(queued)
            return
        send, receive = trio.open_memory_channel[Outgoing](responses.config.client_queue_events)
        kept = responses.keeper(self.owner) if create.stream else None
        loop = await responses.begin(
            create,
            LaneSink(send, kept=kept),
            budget=self.budget,
            history=history,
            source=TurnSource.STORE if history else TurnSource.FRESH,
            size=len(body),
            owner=self.owner,
        )
        log.debug("http.create", extra={"response": loop.machine.id, "stream": create.stream})
        if kept is not None:
            kept.response_id = loop.machine.id
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop.run_and_close)
            async with receive:
                if create.stream:
                    await stream_created(
                        responses, self.stream, self.conn, receive, loop, kept, nursery.cancel_scope
                    )
                else:
                    await self._final_response(receive, nursery.cancel_scope)

    async def _final_response(
        self, receive: trio.MemoryReceiveChannel[Outgoing], response: trio.CancelScope
    ) -> None:
        """One JSON body at the end. Until then the socket is watched, as a stream's writes
        watch it: a client that leaves cancels `response` (the model stops, its state is
        released)."""
        final: ServerEvent | None = None
        async with trio.open_nursery() as watching:
            watching.start_soon(self._watch_client, response)
            async for outgoing in receive:
                final = outgoing.event
                if isinstance(final, TERMINAL_EVENTS):
                    break
            watching.cancel_scope.cancel()
        if not isinstance(final, TERMINAL_EVENTS):
            return
        started = time.perf_counter()
        # echoing a large Response (its tools, its output) is work for a worker thread
        size = await self._response_json(final.response)
        metrics.sent(final, dialect="http", transport="json", size=size,
                     seconds=time.perf_counter() - started)  # fmt: skip
        if self.responses.observer is not None:
            self.responses.observer.sent(final, 1)

    async def _watch_client(self, response: trio.CancelScope) -> None:
        """Cancel `response` when the client goes away. What it sends meanwhile (a pipelined
        next request) goes to h11 for later, up to a request head's worth; past that the
        socket is left unread, so a client that floods it is slowed by TCP, not buffered."""
        kept = 0
        while kept < self.responses.config.max_request_head_bytes:
            try:
                data = await self.stream.receive_some()
            except trio.BrokenResourceError:
                data = b""
            if not data:
                log.info("http.client_left", extra={"path": self.path})
                response.cancel()
                return
            self.conn.receive_data(bytes(data))
            kept += len(data)

    async def _stored(self, response_id: str) -> StoredResponse:
        """The owner's stored Response, or a 404."""
        stored = await self.responses.store.get(response_id, owner=self.owner)
        if stored is None:
            raise _not_stored(response_id)
        return stored

    async def _response_json(self, response: Response) -> int:
        """Answer with `response` as JSON; the bytes it took. Echoing a large one (its tools,
        its output) is work for a worker thread."""
        encoded = await self.responses.offload.run(
            encode_json_bytes, response, size=response_bytes(response)
        )
        await send_json(self.stream, self.conn, 200, encoded)
        return len(encoded)

    async def _retrieve(self, response_id: str) -> None:
        after = starting_after(self.query)
        if after is not None:  # a reattach (streams.py)
            kept = self.responses.detached.find(response_id, self.owner)
            if kept is None:
                raise not_in_flight(response_id)
            await serve_reattach(self.responses, self.stream, self.conn, kept, after)
            return
        running = self.responses.in_flight.find(response_id, self.owner)
        polled = running.snapshot() if running is not None else None
        if polled is not None and polled.background:  # not stored until it ends
            await self._response_json(polled)
            return
        stored = await self._stored(response_id)
        await self._response_json(stored.response)

    async def _cancel(self, response_id: str) -> None:
        """Cancel `response_id` if it runs (a background one, or one a connection of the same
        key streams), answering with it ended; one that ended already, see
        `check_cancellable`."""
        await self._body()  # none is needed
        running = self.responses.in_flight.find(response_id, self.owner)
        if running is not None:
            log.info("http.cancel", extra={"response": response_id})
            await self._response_json(await cancelled(running))
            return
        stored = await self._stored(response_id)
        check_cancellable(stored.response)
        await self._response_json(stored.response)

    async def _input_items(self, response_id: str) -> None:
        """What the Response was given as input: the items of the chain it continued (their
        inputs and outputs, as far as the chain is still stored) and its own input items."""
        query = parse_page_query(self.query)
        stored = await self._stored(response_id)
        chain = await self.responses.store.chain(response_id, owner=self.owner)
        given = chain or [stored]
        size = ECHOED_VALUE_BYTES * sum(len(one.items) for one in given)
        listing = await self.responses.offload.run(input_listing, stored, given, query, size=size)
        await send_json(self.stream, self.conn, 200, listing)

    async def _delete(self, response_id: str) -> None:
        if not await self.responses.store.delete(response_id, owner=self.owner):
            raise _not_stored(response_id)
        log.info("http.deleted", extra={"response": response_id})
        await self._json(200, {"id": response_id, "object": "response", "deleted": True})

    async def _input_tokens(self) -> None:
        """The prompt a create of this body would be served with, counted: its history, its
        items (references resolved) and instructions and tools, rendered as a create is."""
        body = await self._body()
        create = await self._decode(body)
        responses = self.responses
        await responses.check(create, size=len(body))
        history = await self._history(create.previous_response_id)
        tokens = await responses.input_tokens(
            create, history, owner=self.owner, budget=self.budget, size=len(body)
        )
        await self._json(200, {"object": "response.input_tokens", "input_tokens": tokens})

    def _model(self) -> dict[str, Any]:
        """The one model this process serves, as an OpenAI Model object."""
        return {
            "id": self.responses.config.default_model,
            "object": "model",
            "created": self.responses.started_at,
            "owned_by": "proto-server",
        }

    async def _models(self) -> list[dict[str, Any]]:
        """The engine's models as it lists them (vLLM), or the one this process serves."""
        generator = self.responses.generator
        if not isinstance(generator, ListedGenerator):
            return [self._model()]
        models = await generator.engine_models()
        if models is None:
            raise ProtocolError(
                "engine_unavailable",
                "The engine did not list its models; retry shortly (GET /readyz says why).",
                error_type="server_error",
                status=503,
            )
        return models

    async def _retrieve_model(self, model_id: str) -> None:
        models = await self._models()
        for model in models:
            if model.get("id") == model_id:
                await self._json(200, model)
                return
        served = ", ".join(quoted(str(model.get("id"))) for model in models)
        raise ProtocolError(
            "model_not_found",
            f"No model {quoted(model_id)}: this server serves {served}.",
            status=404,
        )

    async def _compact(self) -> None:
        body = await self._body()
        create = await self._decode(body)
        if not create.model:
            raise ProtocolError(
                "invalid_field", "`model` is required by /v1/responses/compact.", param="model"
            )
        history = await self._history(create.previous_response_id)
        await self._json(200, await compaction(self.responses, create, history, len(body)))


def input_listing(
    stored: StoredResponse, chain: Sequence[StoredResponse], query: PageQuery
) -> bytes:
    """The page `query` asks for of the items `stored` was given (`chain`: the Responses it
    continued, and itself), as JSON."""
    outputs = {item_id(item) for item in stored.response.output}
    items = [
        converter.unstructure(listed(item))
        for item in chain_items(chain)
        if item_id(item) not in outputs
    ]
    return orjson.dumps(page(items, query))
