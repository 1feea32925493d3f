"""Plain HTTP on the same port: SSE, JSON, stored responses, compaction, auth, restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h11
import httpx
import orjson
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected

from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator, TimingModel
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.store import SQLiteStore

from ..support.clients import connect, sse, turn
from ..support.frames import THREE_SEGMENTS, USER, answers, body, launched_create
from ..support.servers import FAST, StartServer
from ..support.stores import CheckpointStore

IDS = {
    "id", "item_id", "call_id", "previous_response_id", "created_at", "completed_at",
    "sequence_number",
}  # fmt: skip


def without_ids(value: Any) -> Any:
    """The stream as a client compares it: ids and clocks differ between runs."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in IDS}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


async def test_sse_carries_the_same_events_as_the_websocket(start_server: StartServer) -> None:
    # frame for frame: a writer that fell behind would merge deltas, differently on each side
    running = await start_server(THREE_SEGMENTS, merge_deltas=False)
    url = f"{running.address.http_url}/responses"
    ws_turns, http_turns = [], []
    async with connect(running.address.ws_url) as client:
        previous, new = None, [USER]
        for _ in range(3):
            events = await turn(client, launched_create(previous_response_id=previous, input=new))
            ws_turns.append(events)
            previous, new = events[-1]["response"]["id"], answers(events)
    async with httpx.AsyncClient() as http:
        previous, new = None, [USER]
        for _ in range(3):
            events = await sse(
                http, url, body(previous_response_id=previous, input=new, store=True)
            )
            http_turns.append(events)
            previous, new = events[-1]["response"]["id"], answers(events)
    for ws_events, http_events in zip(ws_turns, http_turns, strict=True):
        assert [e["sequence_number"] for e in http_events] == list(range(len(http_events)))
        # same events; only store (true over HTTP here) and usage's cache accounting differ
        for event in ws_events + http_events:
            if "response" in event:
                event["response"].pop("store")
                event["response"].pop("usage")
        assert without_ids(http_events) == without_ids(ws_events)
    # the HTTP path is cold every time: everything is rendered and re-read
    assert [t.source for t in running.server.responses.turns][3:] == ["fresh", "store", "store"]
    assert all(t.cached_tokens == 0 for t in list(running.server.responses.turns)[3:])


async def test_json_mode_get_and_errors(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    async with httpx.AsyncClient() as http:
        answer = await http.post(url, json=body(store=True))
        assert answer.status_code == 200
        response = answer.json()
        assert response["object"] == "response" and response["status"] == "completed"
        for field in (
            "temperature",
            "top_p",
            "tool_choice",
            "incomplete_details",
            "error",
            "metadata",
            "instructions",
            "parallel_tool_calls",
            "text",
            "truncation",
        ):
            assert field in response, field  # fmt: skip
        (tool,) = response["tools"]
        assert tool["strict"] is False and tool["description"] and tool["parameters"]

        stored = await http.get(f"{url}/{response['id']}")
        assert stored.status_code == 200 and stored.json() == response
        missing = await http.get(f"{url}/resp_nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "response_not_found"

        refused = await http.post(url, json=body(background=True, store=False))
        assert refused.status_code == 400  # a background Response is polled from the store
        assert refused.json()["error"]["param"] == "store"
        broken = await http.post(url, content=b"{nope")
        assert (broken.status_code, broken.json()["error"]["code"]) == (400, "invalid_json")
        unknown = await http.post(url, json=body(previous_response_id="resp_x"))
        assert unknown.json()["error"]["code"] == "previous_response_not_found"
        nowhere = await http.get(f"{running.address.http_url}/embeddings")
        assert nowhere.status_code == 404
        # one keep-alive connection served all of that
        assert running.server.open_connections == 1


async def test_function_tools_are_echoed_complete(start_server: StartServer) -> None:
    running = await start_server()
    bare = {"type": "function", "name": "f"}
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{running.address.http_url}/responses", json=body(tools=[bare]))
    (tool,) = answer.json()["tools"]
    assert tool == {
        "type": "function", "name": "f", "description": None,
        "parameters": {"type": "object"}, "strict": True,
    }  # fmt: skip


async def test_each_sse_event_is_one_chunk(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    payload = orjson.dumps({**body(), "stream": True})
    stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target="/v1/responses",
        headers=[
            ("host", "x"),
            ("content-length", str(len(payload))),
            ("content-type", "application/json"),
        ],
    )
    await stream.send_all(
        conn.send(request) + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage())
    )
    chunks: list[bytes] = []
    current = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some())
        elif isinstance(event, h11.Data):
            current += event.data
            if event.chunk_end:
                chunks.append(current)
                current = b""
        elif isinstance(event, h11.EndOfMessage):
            break
    await stream.aclose()
    assert len(chunks) > 5
    assert all(c.count(b"event: ") == 1 and c.endswith(b"\n\n") for c in chunks)


async def test_a_store_true_chain_survives_a_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"

    async def run_server() -> tuple[trio.CancelScope, str, str]:
        server = ProtoServer(
            SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST),
            ServerConfig(port=0),
            store=SQLiteStore(path),
        )
        scope = trio.CancelScope()

        async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await server.serve(task_status=task_status)

        address = await nursery.start(serve)
        return scope, address.http_url, address.ws_url

    scope, http_url, _ = await run_server()
    async with httpx.AsyncClient() as http:
        first = (await http.post(f"{http_url}/responses", json=body(store=True))).json()
    scope.cancel()
    _, _, ws_url = await run_server()  # a new process would see the same file
    new = answers([{"type": "response.output_item.done", "item": i} for i in first["output"]])
    async with connect(ws_url) as client:
        second = await turn(
            client, launched_create(store=True, previous_response_id=first["id"], input=new)
        )
    assert second[-1]["type"] == "response.completed"
    assert [i["type"] for i in second[-1]["response"]["output"]] == ["function_call"] * 2


async def test_compaction_starts_a_new_chain(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS)
    url = f"{running.address.http_url}/responses"
    async with httpx.AsyncClient() as http:
        first = (await http.post(url, json=body(store=True))).json()
        calls = [{"type": "response.output_item.done", "item": i} for i in first["output"]]
        compacted = await http.post(
            f"{url}/compact",
            json={"model": "m", "previous_response_id": first["id"], "input": answers(calls)},
        )
        assert compacted.status_code == 200
        result = compacted.json()
        assert result["object"] == "response.compaction"
        kinds = [i["type"] for i in result["output"]]
        assert kinds[-1] == "compaction" and result["output"][-1]["encrypted_content"]
        assert result["usage"]["output_tokens"] < result["usage"]["input_tokens"]
        # a new chain: no previous_response_id, the compacted output plus new input
        fresh = await http.post(
            url,
            json=body(input=[*result["output"], {"role": "user", "content": "go on"}]),
        )
        assert fresh.status_code == 200 and fresh.json()["status"] == "completed"
        no_model = await http.post(f"{url}/compact", json={"input": "x"})
        assert (no_model.status_code, no_model.json()["error"]["param"]) == (400, "model")


@pytest.mark.parametrize(("key", "status"), [(None, 401), ("wrong", 401), ("k1", 200)])
async def test_http_needs_a_key_when_keys_are_set(
    start_server: StartServer, key: str | None, status: int
) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            f"{running.address.http_url}/responses", json=body(), headers=headers
        )
        health = await http.get(f"http://127.0.0.1:{running.address.port}/healthz")
    assert answer.status_code == status
    assert health.status_code == 200
    if status == 401:
        assert answer.json()["error"]["code"] == "invalid_api_key"


async def test_a_client_that_leaves_mid_stream_takes_nothing_down(
    start_server: StartServer,
) -> None:
    # without a grace to reattach in, it is cancelled at once (test_reattach: with one)
    running = await start_server(
        {"segments": [{"text": "word " * 400}]},
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50),
        reattach_grace_s=0,
    )
    url = f"{running.address.http_url}/responses"
    payload = {**body(tools=[]), "stream": True}
    async with httpx.AsyncClient() as http, http.stream("POST", url, json=payload) as answer:
        async for chunk in answer.aiter_text():
            if "output_text.delta" in chunk:
                break  # leave in the middle of the stream
    await running.server.wait_idle()
    assert running.server.open_rollouts == 0
    # the server is still serving
    async with httpx.AsyncClient() as http:
        health = await http.get(f"http://127.0.0.1:{running.address.port}/healthz")
    assert health.status_code == 200


async def read_answers(stream: trio.abc.ReceiveStream) -> list[h11.Event]:
    """Everything the server says until it closes: (informational) responses and bodies."""
    conn = h11.Connection(h11.CLIENT)

    def request() -> None:  # h11 reads answers only to requests it saw
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())

    request()
    events: list[h11.Event] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some()
            except trio.BrokenResourceError:  # reset after its answer: the answer counts
                data = b""
            conn.receive_data(data)
        elif isinstance(event, h11.ConnectionClosed | h11.PAUSED):
            return events
        else:
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    while await stream.receive_some():  # then only the end may come
                        raise AssertionError("bytes after a closing answer")
                    return events
                conn.start_next_cycle()
                request()


def statuses(events: list[h11.Event]) -> list[int]:
    kinds = (h11.InformationalResponse, h11.Response)
    return [e.status_code for e in events if isinstance(e, kinds)]


def post_head(length: int, *extra: str, target: str = "/v1/responses") -> bytes:
    lines = "".join(f"{line}\r\n" for line in extra)
    return (
        f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{lines}\r\n"
    ).encode()


class CountingStream(trio.abc.HalfCloseableStream):
    """The server's side of a connection, counting the bytes it reads."""

    def __init__(self, stream: trio.SocketStream, counts: list[int]) -> None:
        self.stream = stream
        self.counts = counts
        self.index = len(counts)
        counts.append(0)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        self.counts[self.index] += len(data)
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_a_refused_request_with_a_huge_body_is_answered_and_closed_unread(
    nursery: trio.Nursery,
) -> None:
    """401 before the body: the server says `Connection: close`, reads at most a bounded
    linger of it (not 100 GB for the whole handshake timeout), and closes."""
    server = ProtoServer(
        SimulatedGenerator(parse_script(THREE_SEGMENTS), FAST),
        ServerConfig(port=0, api_keys=("k1",), handshake_timeout_s=30),
        store=CheckpointStore(),
    )
    counts: list[int] = []
    handle = server._handle

    async def counting(stream: trio.SocketStream) -> None:
        await handle(CountingStream(stream, counts))  # type: ignore[arg-type]

    server._handle = counting  # type: ignore[method-assign]
    address = await nursery.start(server.serve)
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", address.port)
        async with stream, trio.open_nursery() as nursery:
            head = post_head(100_000_000_000)
            await stream.send_all(head + b"x" * 4096)

            async def keep_sending() -> None:
                try:
                    for _ in range(10_000):  # 640 MB at most
                        await stream.send_all(b"x" * 65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(keep_sending)
            events = await read_answers(stream)
            nursery.cancel_scope.cancel()
    (answer, _, _) = events
    assert isinstance(answer, h11.Response) and answer.status_code == 401
    assert (b"connection", b"close") in answer.headers
    assert counts[0] < len(head) + 4096 + 3 * 65536
    with trio.fail_after(5):
        await server.wait_idle()


async def test_expect_100_continue_is_answered_before_a_body_the_server_will_read(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",), max_message_bytes=4096)
    payload = orjson.dumps(body())
    expect = ("expect: 100-continue", "connection: close")
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
        async with stream:
            await stream.send_all(post_head(len(payload), "authorization: Bearer k1", *expect))
            assert await stream.receive_some() == b"HTTP/1.1 100 Continue\r\n\r\n"  # go on
            await stream.send_all(payload)
            served = await read_answers(stream)
        # refused before its body: the refusal and no 100, so the client never sends the body
        stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
        async with stream:
            await stream.send_all(post_head(len(payload), *expect))
            refused = await read_answers(stream)
        # so is one that says its body is over the limit
        stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
        async with stream:
            await stream.send_all(post_head(10_000, "authorization: Bearer k1", *expect))
            too_large = await read_answers(stream)
    assert statuses(served) == [200]
    assert statuses(refused) == [401]
    assert statuses(too_large) == [413]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/responses/compact"),
        ("GET", "/v1/models"),
        ("POST", "/v1"),
        ("GET", "/nowhere"),
    ],
)
async def test_without_a_key_every_path_is_refused_alike(
    start_server: StartServer, method: str, path: str
) -> None:
    """Auth before routing: a client without a key cannot tell a valid path from a wrong one."""
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",))
    root = f"http://127.0.0.1:{running.address.port}"
    async with httpx.AsyncClient() as http:
        refused = await http.request(method, f"{root}{path}", json=body())
        keyed = await http.request(
            method, f"{root}{path}", json=body(), headers={"Authorization": "Bearer k1"}
        )
        health = await http.get(f"{root}/healthz")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert keyed.status_code != 401
    assert health.status_code == 200


@pytest.mark.parametrize("path", ["/v1/responses", "/nowhere", "/v1/responses/resp_1"])
async def test_a_websocket_without_a_key_is_refused_alike_on_every_path(
    start_server: StartServer, path: str
) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",))
    url = f"ws://127.0.0.1:{running.address.port}{path}"
    with pytest.raises(ConnectionRejected) as refused:
        async with connect(url):
            pass
    assert refused.value.status_code == 401
    assert b"invalid_api_key" in (refused.value.body or b"")
    if path != "/v1/responses":
        with pytest.raises(ConnectionRejected) as missing:
            async with connect(url, Authorization="Bearer k1"):
                pass
        assert missing.value.status_code == 404


UPGRADE_WITHOUT_KEY = (
    b"GET /v1/responses HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
)


async def test_a_refused_upgrade_is_closed_and_frees_its_place(start_server: StartServer) -> None:
    """Before: a 401 upgrade stayed open, so two clients without a key filled a cap of two."""
    running = await start_server(THREE_SEGMENTS, api_keys=("k1",), max_connections=2)
    with trio.fail_after(5):
        for _ in range(3):
            stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
            await stream.send_all(UPGRADE_WITHOUT_KEY)
            answer = b""
            while chunk := await stream.receive_some():  # the server closes it
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in answer
            await stream.aclose()
        await running.server.wait_idle()
        async with httpx.AsyncClient() as http:
            health = await http.get(f"http://127.0.0.1:{running.address.port}/healthz")
        assert health.status_code == 200


SLOW_TEXT = {"segments": [{"text": "word " * 400}]}  # 8 s at 50 tokens/s
SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50)


async def test_a_json_request_whose_client_leaves_is_cancelled_like_a_stream(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(SLOW_TEXT, timing=SLOW, store=CheckpointStore())
    payload = orjson.dumps(body(tools=[]))
    with trio.fail_after(3):  # the Response alone would take 8 s
        stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
        await stream.send_all(post_head(len(payload)) + payload)
        await trio.sleep(1)
        assert running.server.open_rollouts == 1  # generating
        await stream.aclose()  # the client leaves mid-way
        await running.server.wait_idle()  # the rollout is released, the connection closed
    assert not running.server.responses.turns  # it never ran to its end


async def test_a_pipelined_request_behind_a_json_one_is_kept_and_served(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running = await start_server(SLOW_TEXT, timing=SLOW, store=CheckpointStore())
    payload = orjson.dumps(body(tools=[]))
    health = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", running.address.port)
        async with stream:
            await stream.send_all(post_head(len(payload)) + payload)
            await trio.sleep(1)
            await stream.send_all(health)  # while the first one is generating
            events = await read_answers(stream)
    assert statuses(events) == [200, 200]
    (first,) = [e for e in events if isinstance(e, h11.Data)][:1]
    assert orjson.loads(first.data)["status"] == "completed"
    assert events[-2] == h11.Data(data=b'{"status":"ok"}')
