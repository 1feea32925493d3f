"""API keys are tenants: a stored response belongs to the key that created it. Another key
cannot read it, continue it (HTTP or WebSocket) or compact it; the same key still can."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import trio

from proto_server.server.store import ANONYMOUS, SQLiteStore, owner_id

from .helpers import THREE_SEGMENTS, StartServer, answers, body, connect, launched_create, turn

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
