"""`item_reference`s are charged by what they expand to: a small request naming a large item many
times is refused before anything renders the expansion, over HTTP (from the store), over
`/v1/responses/input_tokens` and over a launched WebSocket with `store: false` (from its warm
conversation), and the connection goes on serving. Many different stored items, each named
once, are refused before the store reads them, on SQLite and on PostgreSQL.

A renderer that counts the large items it is asked to render says whether the expansion was
rendered: the refusal must not depend on it (before, each of these rendered it first: a 5 KB
body naming a 4 MB item 100 times was refused after 12.5 s, the event loop blocked throughout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

from proto_server.core.conversation import item_bytes
from proto_server.core.render import O200kRenderer
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.server.process.memory import MiB
from proto_server.server.store import ResponseStore
from proto_server.wire.items import Item

from ..support.clients import END, connect, turn
from ..support.frames import body, launched_create
from ..support.servers import FAST, Running
from ..support.stores import counting_decodes

#: The large item: tokenizing it costs tens of milliseconds, a hundred of it seconds.
BIG_TEXT = "word " * (64 * 1024 // 5)


class CountingRenderer(O200kRenderer):
    """o200k, counting the large items it renders (from the worker threads too)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = 0

    def render_item(self, item: Item, previous: Item | None = None) -> Sequence[int]:
        if item_bytes(item) > len(BIG_TEXT):
            self.big += 1
        return super().render_item(item, previous)


async def serve(
    nursery: trio.Nursery, store: ResponseStore | None = None, **config: Any
) -> tuple[Running, CountingRenderer]:
    renderer = CountingRenderer()
    server = ProtoServer(
        SimulatedGenerator(DefaultModel(), FAST),
        ServerConfig(port=0, **config),
        renderer=renderer,
        store=store,
    )
    return Running(server, await nursery.start(server.serve)), renderer


def references(item_id: str, times: int) -> list[dict[str, Any]]:
    return [{"type": "item_reference", "id": item_id}] * times


def each_once(item_ids: Sequence[str]) -> list[dict[str, Any]]:
    return [{"type": "item_reference", "id": item_id} for item_id in item_ids]


async def stored_big_item(http: httpx.AsyncClient, url: str) -> str:
    """The id of a stored user message holding `BIG_TEXT`."""
    user = {"type": "message", "role": "user", "content": BIG_TEXT}
    stored = await http.post(url, json=body(store=True, tools=[], input=[user]))
    assert stored.status_code == 200, stored.text
    listed = await http.get(f"{url}/{stored.json()['id']}/input_items")
    return str(listed.json()["data"][0]["id"])


def assert_refused(error: dict[str, Any], code: str, times: int) -> None:
    assert error["code"] == code, error
    assert f"{times:,} item_references expanding to" in error["message"], error


async def test_a_stored_item_referenced_many_times_is_refused_unrendered(
    nursery: trio.Nursery,
) -> None:
    # 100 references to a 64 KiB item: 6.4 MB expanded, over the 1 MiB a request may carry
    running, renderer = await serve(nursery, max_message_bytes=MiB)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(30):
        async with httpx.AsyncClient() as http:
            item_id = await stored_big_item(http, url)
            rendered = renderer.big
            refused = await http.post(url, json=body(tools=[], input=references(item_id, 100)))
            assert renderer.big == rendered  # refused before the expansion was rendered
            # the same connection goes on serving, the item referenced within the limit too
            served = await http.post(url, json=body(tools=[], input=references(item_id, 2)))
    assert refused.status_code == 413, refused.text
    assert_refused(refused.json()["error"], "message_too_large", 100)
    assert "--max-message-bytes" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "input"
    assert served.status_code == 200 and served.json()["status"] == "completed", served.text
    assert renderer.big == rendered + 2


async def test_many_different_stored_items_are_refused_before_the_store_reads_them(
    store: ResponseStore, nursery: trio.Nursery
) -> None:
    # 20 stored 64 KiB items, each named once: 1.3 MB of stored JSON, over the 1 MiB a request
    # may carry; before, the store read and decoded all of them, then they were found too large
    running, renderer = await serve(nursery, store, max_message_bytes=MiB)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(60):
        async with httpx.AsyncClient() as http:
            item_ids = [await stored_big_item(http, url) for _ in range(20)]
            rendered = renderer.big
            with counting_decodes() as decoded:
                refused = await http.post(url, json=body(tools=[], input=each_once(item_ids)))
                assert decoded == [0]  # not one of them read
                served = await http.post(url, json=body(tools=[], input=each_once(item_ids[:8])))
                assert decoded == [8]
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "message_too_large" and error["param"] == "input", error
    assert "20 stored items whose responses hold 1.3 MiB" in error["message"], error
    assert "--max-message-bytes" in error["message"], error
    assert served.status_code == 200 and served.json()["status"] == "completed", served.text
    assert renderer.big == rendered + 8


async def test_input_tokens_counts_no_expansion_past_the_budgets(nursery: trio.Nursery) -> None:
    # the process budget holds room to prepare the expansion (48x it), as it does a body's bytes
    running, renderer = await serve(nursery, max_message_bytes=MiB, max_memory_bytes=8 * MiB)
    url = f"{running.address.http_url}/responses"
    with trio.fail_after(30):
        async with httpx.AsyncClient() as http:
            item_id = await stored_big_item(http, url)
            rendered = renderer.big
            answers = [
                await http.post(
                    f"{url}/input_tokens", json=body(tools=[], input=references(item_id, times))
                )
                for times in (100, 4)
            ]
            assert renderer.big == rendered
            counted = await http.post(
                f"{url}/input_tokens", json=body(tools=[], input=references(item_id, 1))
            )
    too_large, too_much = answers
    assert too_large.status_code == 413, too_large.text
    assert_refused(too_large.json()["error"], "message_too_large", 100)
    assert too_much.status_code == 503, too_much.text
    assert_refused(too_much.json()["error"], "server_busy", 4)
    assert "--max-memory" in too_much.json()["error"]["message"]
    assert counted.status_code == 200 and counted.json()["input_tokens"] > len(BIG_TEXT) // 5


async def test_a_warm_conversations_own_item_referenced_many_times_is_refused_unrendered(
    nursery: trio.Nursery,
) -> None:
    # store: false, launched: the item is the warm conversation's own; 20 references to it
    # (1.3 MB) fit what a request may carry (16 MiB), not the connection's 1 MiB
    running, renderer = await serve(nursery, max_connection_memory_bytes=MiB)
    big = {"type": "message", "id": "msg_big", "role": "user", "content": BIG_TEXT}
    with trio.fail_after(30):
        async with connect(running.address.ws_url) as client:
            first = await turn(client, launched_create(tools=[], input=[big]))
            assert first[-1]["type"] == "response.completed", first[-1]
            rendered = renderer.big
            warm = first[-1]["response"]["id"]
            again = references("msg_big", 20)
            refused = await turn(client, launched_create(previous_response_id=warm, input=again))
            assert renderer.big == rendered
            served = await turn(client, launched_create(tools=[], input="still there?"))
    assert refused[-1]["type"] == "error", refused[-1]
    assert_refused(refused[-1]["error"], "connection_memory_limit", 20)
    assert "--max-connection-memory" in refused[-1]["error"]["message"]
    assert served[-1]["type"] == "response.completed", served[-1]
    assert [event["type"] for event in served if event["type"] in END] == ["response.completed"]
