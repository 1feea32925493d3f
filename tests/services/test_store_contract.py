"""What every persisted store does, SQLite's and PostgreSQL's alike (`open_store` opens each,
the PostgreSQL ones marked `postgres`): chains, retention, owners, item ids and deletion,
lookups by id within a byte bound, and the loads of the processes that share it."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from proto_server.core.shared_capacity import Load
from proto_server.server.store import (
    SQLiteStore,
    StoredResponse,
    StoreRetention,
    chain_items,
    owner_id,
)
from proto_server.wire.errors import ProtocolError
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message

from ..support.stores import OpenStore, count, counting_decodes, identified, stored


async def test_a_chain_comes_back_in_order(store: Any) -> None:
    call = FunctionCall(id="fc_1", call_id="call_1", name="f", arguments="{}", status="completed")
    await store.put(
        StoredResponse(
            response=stored("resp_1").response, items=(Message(role="user", content="a"), call)
        )
    )
    await store.put(
        StoredResponse(
            response=stored("resp_2", "resp_1").response,
            items=(FunctionCallOutput(call_id="call_1", output="ok"),),
        )
    )
    await store.put(stored("resp_3", "resp_2", text="t resp_3"))
    chain = await store.chain("resp_3")
    assert chain is not None
    assert [s.response.id for s in chain] == ["resp_1", "resp_2", "resp_3"]
    assert chain_items(chain) == [
        Message(role="user", content="a"), call, FunctionCallOutput(call_id="call_1", output="ok"),
        *stored("resp_3", "resp_2", text="t resp_3").items,
    ]  # fmt: skip
    assert await store.get("resp_1") == chain[0]
    assert await store.get("resp_2") == chain[1]
    assert await store.chain("resp_unknown") is None


async def test_a_broken_chain_is_a_miss(store: Any) -> None:
    await store.put(stored("resp_2", "resp_1"))  # its previous was never stored
    assert await store.chain("resp_2") is None


async def test_retention_by_count_and_by_age(open_store: OpenStore) -> None:
    now = [1000.0]
    retention = StoreRetention(max_responses=2, max_age_s=100)
    store = await open_store(retention=retention, clock=lambda: now[0])
    for i in range(3):
        await store.put(stored(f"resp_{i}"))
        now[0] += 1
    assert await count(store) == 2
    assert await store.get("resp_0") is None
    now[0] += 1000
    await store.put(stored("resp_new"))
    assert await count(store) == 1


async def test_a_response_belongs_to_its_owner(store: Any) -> None:
    await store.put(attrs.evolve(stored("resp_1"), owner=owner_id("k1")))
    await store.put(attrs.evolve(stored("resp_2", "resp_1"), owner=owner_id("k1")))
    assert await store.get("resp_1", owner=owner_id("k1")) is not None
    assert await store.get("resp_1", owner=owner_id("k2")) is None
    assert await store.get("resp_1") is None  # the anonymous owner is an owner like any other
    chain = await store.chain("resp_2", owner=owner_id("k1"))
    assert chain is not None and len(chain) == 2
    assert await store.chain("resp_2", owner=owner_id("k2")) is None


async def test_items_are_found_by_id_for_their_owner_and_deleted_with_their_response(
    store: Any,
) -> None:
    k1, k2 = owner_id("k1"), owner_id("k2")
    for response_id, previous in [("resp_1", None), ("resp_2", "resp_1")]:
        await store.put(identified(response_id, previous, owner=k1))
    found = await store.items(["a_resp_1", "q_resp_2", "a_nowhere"], owner=k1)
    assert sorted(found) == ["a_resp_1", "q_resp_2"]
    assert found["a_resp_1"].content == "answer of resp_1"
    assert await store.items(["a_resp_1"], owner=k2) == {}  # another owner's: not found
    assert not await store.delete("resp_1", owner=k2)  # nor deleted
    assert await store.delete("resp_1", owner=k1)
    assert not await store.delete("resp_1", owner=k1)  # once
    assert await store.get("resp_1", owner=k1) is None
    assert await store.items(["a_resp_1", "q_resp_1"], owner=k1) == {}  # its items went with it
    assert await store.get("resp_2", owner=k1) is not None  # the next is kept, its chain broken
    assert await store.chain("resp_2", owner=k1) is None


async def test_many_ids_are_looked_up_a_batch_at_a_time_and_the_newest_holder_wins(
    store: Any,
) -> None:
    """Ids past one statement's batch are all looked up, and an item stored twice (a client
    replayed it, its id with it) is found in the newest response that holds it."""
    await store.put(identified("resp_1"))
    replayed = identified("resp_2")
    again = attrs.evolve(identified("resp_1").items[1], content="replayed")  # type: ignore[misc]
    await store.put(attrs.evolve(replayed, items=(*replayed.items, again)))
    wanted = [f"msg_{i}" for i in range(1_200)] + ["a_resp_1", "q_resp_2"]
    found = await store.items(wanted, owner="")
    assert sorted(found) == ["a_resp_1", "q_resp_2"]
    assert found["a_resp_1"].content == "replayed"


async def items_read_within(store: Any) -> None:
    """`items(max_bytes=...)` refuses ids whose responses hold more stored JSON than that (each
    response once, however many of its items are named) before it reads or decodes any of
    them, and finds those within it."""
    text = "x" * (64 * 1024)
    for i in range(8):
        plain = identified(f"resp_{i}")
        big = attrs.evolve(plain.items[1], content=text)  # type: ignore[misc]
        await store.put(attrs.evolve(plain, items=(plain.items[0], big)))
    answers = [f"a_resp_{i}" for i in range(8)]
    with counting_decodes() as decoded:
        with pytest.raises(ProtocolError) as refused:  # 8 x 64 KiB, over 256 KiB
            await store.items(answers, owner="", max_bytes=256 * 1024)
        assert decoded == [0]
        assert refused.value.detail.code == "message_too_large" and refused.value.status == 413
        assert "8 stored items whose responses hold 0.5 MiB" in str(refused.value)
        assert "--max-message-bytes" in str(refused.value)
        # three responses, each read once for its question and its answer: 192 KiB
        wanted = [*answers[:3], "q_resp_0", "q_resp_1", "q_resp_2", "a_nowhere"]
        found = await store.items(wanted, owner="", max_bytes=256 * 1024)
        assert sorted(found) == sorted(wanted[:-1])
        assert decoded == [3]
        assert found["a_resp_2"].content == text  # type: ignore[union-attr]
        assert len(await store.items(answers, owner="")) == 8  # no bound: all of them


async def test_items_past_a_byte_bound_are_refused_before_they_are_read(store: Any) -> None:
    await items_read_within(store)


async def test_an_in_memory_store_refuses_items_past_a_byte_bound_too() -> None:
    store = SQLiteStore(":memory:")
    await items_read_within(store)
    await store.aclose()


async def test_processes_sharing_the_database_see_each_others_loads_until_one_goes(
    open_store: OpenStore,
) -> None:
    now = [1000.0]  # both stores' clock
    first = await open_store(clock=lambda: now[0])
    second = await open_store(clock=lambda: now[0])
    assert await first.publish_load("a", Load(100, 0), stale_s=5) == []
    assert await second.publish_load("b", Load(20, 30, 10), stale_s=5) == [Load(100, 0, 0, "a")]
    assert await first.publish_load("a", Load(120, 0), stale_s=5) == [Load(20, 30, 10, "b")]
    now[0] += 6  # b is not heard from for longer than a's stale_s: gone, and forgotten
    assert await first.publish_load("a", Load(120, 0), stale_s=5) == []
    assert await second.publish_load("b", Load(0, 0), stale_s=5) == [Load(120, 0, 0, "a")]
    await first.withdraw("a")  # a stops: b shares the room alone at once
    assert await second.publish_load("b", Load(0, 0), stale_s=5) == []
