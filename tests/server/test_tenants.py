"""API keys are tenants: a stored response belongs to the key that created it. Another key
cannot read it, continue it (HTTP or WebSocket) or compact it; the same key still can. Nor does
it find the other's prompts in the engine's prefix cache."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import trio

from proto_server.engine.default_model import DefaultModel
from proto_server.engine.prefix_cache import PrefixCache
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.rollouts.responses import Responses
from proto_server.server.store import ANONYMOUS, SQLiteStore, owner_id

from ..support.clients import connect, turn
from ..support.frames import THREE_SEGMENTS, answers, body, launched_create
from ..support.servers import FAST, StartServer

K1 = {"Authorization": "Bearer k1"}
K2 = {"Authorization": "Bearer k2"}


async def stored_by_k1(http: httpx.AsyncClient, url: str) -> dict:  # type: ignore[type-arg]
    answer = await http.post(url, json=body(store=True, input="my secret plan"), headers=K1)
    assert answer.status_code == 200
    return answer.json()  # type: ignore[no-any-return]


async def test_another_key_cannot_get_continue_or_compact_a_stored_response(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1", "k2"))
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            first = await stored_by_k1(http, url)
            calls = [{"type": "response.output_item.done", "item": i} for i in first["output"]]
            follow_up = body(store=True, previous_response_id=first["id"], input=answers(calls))

            got = await http.get(f"{url}/{first['id']}", headers=K2)
            assert got.status_code == 404
            assert got.json()["error"]["code"] == "response_not_found"

            chained = await http.post(url, json=follow_up, headers=K2)
            assert chained.status_code == 400
            assert chained.json()["error"]["code"] == "previous_response_not_found"

            compact = {"model": "m", "previous_response_id": first["id"], "input": []}
            compacted = await http.post(f"{url}/compact", json=compact, headers=K2)
            assert compacted.status_code == 400
            assert compacted.json()["error"]["code"] == "previous_response_not_found"
            assert "my secret plan" not in compacted.text

            # the owner still can, every way
            assert (await http.get(f"{url}/{first['id']}", headers=K1)).json() == first
            mine = await http.post(f"{url}/compact", json=compact, headers=K1)
            assert mine.status_code == 200 and "my secret plan" in mine.text
            again = await http.post(url, json=follow_up, headers=K1)
            assert again.status_code == 200 and again.json()["status"] == "completed"


async def test_another_key_cannot_continue_it_over_a_websocket(start_server: StartServer) -> None:
    running = await start_server(THREE_SEGMENTS, api_keys=("k1", "k2"))
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            first = await stored_by_k1(http, url)
        calls = [{"type": "response.output_item.done", "item": i} for i in first["output"]]
        frame = launched_create(store=True, previous_response_id=first["id"], input=answers(calls))
        async with connect(running.address.ws_url, **K2) as client:
            (refused,) = await turn(client, frame)
            assert refused["type"] == "error"
            assert refused["error"]["code"] == "previous_response_not_found"
        async with connect(running.address.ws_url, **K1) as client:
            events = await turn(client, frame)
            assert events[-1]["type"] == "response.completed"
            # and what k1 stores over the WebSocket is k1's too
            second = events[-1]["response"]["id"]
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/{second}", headers=K2)).status_code == 404
            assert (await http.get(f"{url}/{second}", headers=K1)).status_code == 200


async def test_the_store_keeps_an_owner_id_never_the_key(
    start_server: StartServer, tmp_path: Path
) -> None:
    path = tmp_path / "responses.sqlite3"
    running = await start_server(THREE_SEGMENTS, api_keys=("k1-secret",), store=SQLiteStore(path))
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{running.address.http_url}/responses",
                json=body(store=True),
                headers={"Authorization": "Bearer k1-secret"},
            )
    assert answer.status_code == 200
    db = sqlite3.connect(path)
    (owner,) = db.execute("SELECT owner FROM responses").fetchone()
    db.close()
    assert owner == owner_id("k1-secret") != ANONYMOUS
    assert "k1-secret" not in owner
    for file in tmp_path.iterdir():  # noqa: ASYNC240 (the database, its WAL, its shared memory)
        assert b"k1-secret" not in file.read_bytes(), file


async def test_a_prompt_another_key_sent_is_not_warm_for_this_one(nursery: trio.Nursery) -> None:
    """Keys share no cached prefix: a shared cache would tell one, by `cached_tokens` (and time
    to first token), what another sent. The same key still finds its own."""
    gpu = SimulatedGenerator(DefaultModel(), FAST, prefix_cache=PrefixCache())
    server = ProtoServer(gpu, ServerConfig(port=0, api_keys=("k1", "k2")))
    address = await nursery.start(server.serve)
    secret = {"model": "m", "input": "my secret plan " * 100, "store": False}
    cached = []
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(30):
            for key in (K1, K2, K1):
                answer = await http.post(f"{address.http_url}/responses", json=secret, headers=key)
                assert answer.status_code == 200, answer.text
                cached.append(answer.json()["usage"]["input_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] == 0 and cached[2] >= 64 * 4  # 300+ tokens


def test_each_key_has_its_own_unguessable_salt_the_same_in_every_worker() -> None:
    """Derived from the server's kept secret: the same for a key in every process that holds
    it (a tenant's prefix stays warm across workers and restarts), another for another key or
    another secret, and none without auth (one tenant: everything shared, as before)."""
    one, again = Responses(gpu := SimulatedGenerator(DefaultModel())), Responses(gpu)
    kept = [Responses(gpu, compaction_secret=b"s" * 32) for _ in range(2)]
    k1, k2 = owner_id("k1"), owner_id("k2")
    salts = [responses.tenants.cache_salt for responses in (*kept, one, again)]
    assert salts[0](k1) == salts[1](k1) != salts[0](k2)
    assert salts[2](k1) != salts[3](k1)  # no kept secret: a random one each
    salt = salts[0](k1)
    assert salt is not None and len(salt) == 43 and not set(salt) & set("@/\\\0=")
    assert salts[0](ANONYMOUS) is None
