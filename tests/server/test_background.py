"""Background mode (`background: true` over HTTP) and `POST /v1/responses/{id}/cancel`: a
Response run by the process, polled, streamed from any event on, and cancelled by id; only by
the key that created it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import trio
import trio.testing
from openai import AsyncOpenAI

from proto_server.engine.simulated import TimingModel
from proto_server.testing import StreamChecker, o200k_count
from proto_server.testing.schema import wire_schema

from ..support.clients import connect
from ..support.frames import body
from ..support.servers import StartServer
from ..support.stores import CheckpointStore
from .test_reattach import reattach, stream_until

SLOW = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=50)
#: 8 s of text at 50 tokens/s.
LONG_TEXT = {"segments": [{"text": "word " * 400}]}
KEYS = ("k1", "k2")


def headers(key: str = "k1") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def payload(**fields: Any) -> dict[str, Any]:
    return {**body(tools=[]), "background": True, **fields}


def in_flight(running: Any) -> list[Any]:
    """The Responses the server runs now."""
    return list(running.server.responses.in_flight._running.values())


def checked(create: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """`events`, as one stream answering `create`, pass the stream checker and the schema."""
    checker = StreamChecker(
        dialect="launched", count_tokens=o200k_count, schema=wire_schema(), transport="sse"
    )
    checker.sent({"type": "response.create", **create})
    for event in events:
        checker.received(event)
    checker.finish()


async def start(start_server: StartServer, **config: Any) -> tuple[Any, str]:
    running = await start_server(
        LONG_TEXT, timing=SLOW, store=CheckpointStore(), api_keys=KEYS, **config
    )
    return running, f"{running.address.http_url}/responses"


async def test_a_background_response_answers_at_once_and_is_polled_to_its_end(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server)
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            created = await http.post(url, json=payload())
            assert trio.current_time() < 1  # not after its 8 s of text
            assert created.status_code == 200
            response = created.json()
            wire_schema().check_response(response)
            assert (response["status"], response["background"]) == ("queued", True)
            await trio.sleep(2)
            polled = (await http.get(f"{url}/{response['id']}")).json()
            wire_schema().check_response(polled)
            assert (polled["status"], polled["background"]) == ("in_progress", True)
            await running.server.wait_idle()
            done = (await http.get(f"{url}/{response['id']}")).json()
    wire_schema().check_response(done)
    assert (done["status"], done["background"]) == ("completed", True)
    assert done["output"][0]["content"][0]["text"] == "word " * 400
    (turn,) = running.server.responses.turns
    assert turn.status == "completed"


async def test_a_background_stream_outlives_its_client_and_resumes_after_any_event(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    """Its client leaves: no grace lapses (1 s here), it runs to its end, and its stream is
    taken up after the last event seen; once ended, replayed whole for --reattach-grace."""
    running, _ = await start(start_server, reattach_grace_s=1)
    port = running.address.port
    create = payload(stream=True)
    with trio.fail_after(60):
        seen = await stream_until(port, create, "response.output_text.delta", 5)
        response_id = seen[0]["response"]["id"]
        assert seen[0]["response"]["background"] is True
        await trio.sleep(3)  # past the grace: a foreground stream would have been cut
        status, rest, _ = await reattach(port, response_id, seen[-1]["sequence_number"])
        assert status == 200
        checked(create, seen + rest)
        status, whole, _ = await reattach(port, response_id, -1)  # ended, within the grace
        assert status == 200 and whole == seen + rest
        await trio.sleep(2)  # its events are let go; the store has it
        status, _, error = await reattach(port, response_id, -1)
        assert status == 404 and error is not None and error["code"] == "response_not_found"
    (turn,) = running.server.responses.turns
    assert turn.status == "completed"
    assert running.server.responses.memory.used == 0  # what was kept is no longer counted


async def test_a_background_response_is_cancelled_and_stays_cancelled(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server)
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            response_id = (await http.post(url, json=payload())).json()["id"]
            await trio.sleep(1)
            cancelled = await http.post(f"{url}/{response_id}/cancel")
            assert cancelled.status_code == 200
            wire_schema().check_response(cancelled.json())
            assert cancelled.json()["status"] == "cancelled"
            assert trio.current_time() < 2  # cut short, not at the end of its text
            # cancelling it again is the Response as it ended, as OpenAI answers
            again = await http.post(f"{url}/{response_id}/cancel")
            assert (again.status_code, again.json()["status"]) == (200, "cancelled")
            stored = (await http.get(f"{url}/{response_id}")).json()
            assert stored["status"] == "cancelled"
            missing = await http.post(f"{url}/resp_nope/cancel")
            assert (missing.status_code, missing.json()["error"]["code"]) == (
                404, "response_not_found",
            )  # fmt: skip
    (turn,) = running.server.responses.turns
    assert turn.status == "cancelled"


async def test_a_foreground_response_is_cancelled_by_id_from_another_connection(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server)
    events: list[dict[str, Any]] = []
    begun = trio.Event()

    async def read(http: httpx.AsyncClient) -> None:
        create = {**body(tools=[]), "stream": True}
        async with http.stream("POST", url, json=create) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(orjson.loads(line.removeprefix("data: ")))
                    begun.set()

    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers(), timeout=None) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, http)
                await begun.wait()
                response_id = events[0]["response"]["id"]
                cancelled = await http.post(f"{url}/{response_id}/cancel")
            assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
            assert events[-1]["type"] == "response.cancelled"  # its stream says so
            # one awaited as one JSON body: that body is the Response cancelled
            async with trio.open_nursery() as nursery:
                answers: list[dict[str, Any]] = []

                async def await_json() -> None:
                    answers.append((await http.post(url, json=body(tools=[]))).json())

                nursery.start_soon(await_json)
                await trio.sleep(1)
                (running_id,) = [t.response_id for t in in_flight(running)]
                await http.post(f"{url}/{running_id}/cancel")
            assert answers[0]["status"] == "cancelled"
            # a foreground one that ended is not cancelled, as OpenAI refuses it
            ended = (await http.post(url, json=body(tools=[]), timeout=None)).json()
            refused = await http.post(f"{url}/{ended['id']}/cancel")
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "response_not_cancellable"
        # over a WebSocket of the same key too
        async with connect(running.address.ws_url, authorization="Bearer k1") as ws:
            await ws.send({"type": "response.create", **body(tools=[], store=False)})
            ws_id = (await ws.receive())["response"]["id"]
            async with httpx.AsyncClient(headers=headers()) as http:
                cancelled = await http.post(f"{url}/{ws_id}/cancel")
            assert cancelled.json()["status"] == "cancelled"
            await ws.until("response.cancelled")


async def test_only_the_key_that_created_it_polls_streams_or_cancels_it(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server)
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            response_id = (await http.post(url, json=payload())).json()["id"]
            await trio.sleep(1)
            other = headers("k2")
            for answer in (
                await http.get(f"{url}/{response_id}", headers=other),
                await http.post(f"{url}/{response_id}/cancel", headers=other),
            ):
                assert answer.status_code == 404
                assert answer.json()["error"]["code"] == "response_not_found"
            status, _, error = await reattach(running.address.port, response_id, -1, key="k2")
            assert status == 404 and error is not None
            await running.server.wait_idle()
    (turn,) = running.server.responses.turns
    assert turn.status == "completed"  # untouched by the other key


async def test_a_response_waiting_for_admission_is_queued_and_cancelled(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server, kv_capacity_tokens=1)  # one runs at a time
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            first = (await http.post(url, json=payload())).json()["id"]
            second = (await http.post(url, json=payload())).json()["id"]
            await trio.sleep(1)
            assert (await http.get(f"{url}/{first}")).json()["status"] == "in_progress"
            assert (await http.get(f"{url}/{second}")).json()["status"] == "queued"
            cancelled = await http.post(f"{url}/{second}/cancel")
            assert cancelled.json()["status"] == "cancelled"
            assert trio.current_time() < 2
            await running.server.wait_idle()
            assert (await http.get(f"{url}/{first}")).json()["status"] == "completed"


async def test_what_background_mode_refuses(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server, max_background=1)
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            unstored = await http.post(url, json=payload(store=False))
            assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "store"
            assert (await http.post(url, json=payload())).status_code == 200
            full = await http.post(url, json=payload())
            assert full.status_code == 429
            assert full.json()["error"]["code"] == "too_many_background_responses"
            wire_schema().check_body("/v1/responses", 429, full.json())
        # over a WebSocket, as over OpenAI's: there is none
        async with connect(running.address.ws_url, authorization="Bearer k1") as ws:
            await ws.send({"type": "response.create", **payload()})
            (event,) = await ws.until("error")
            error = event["error"]
            assert (error["code"], error["param"]) == ("invalid_field", "background")


async def test_openai_python_creates_retrieves_streams_and_cancels_in_the_background(
    start_server: StartServer,
) -> None:
    """On the real clock (the SDK's worker threads would let the autojump clock run ahead)."""
    running = await start_server(
        LONG_TEXT,
        timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=400),  # 1 s of text
        store=CheckpointStore(),
        api_keys=KEYS,
    )
    client = AsyncOpenAI(base_url=running.address.http_url, api_key="k1", max_retries=0)
    with trio.fail_after(30):
        created = await client.responses.create(model="test-model", input="write", background=True)
        assert (created.status, created.background) == ("queued", True)
        stream = await client.responses.retrieve(created.id, stream=True, starting_after=3)
        numbers, kinds = [], []
        async for event in stream:
            numbers.append(event.sequence_number)
            kinds.append(event.type)
        assert numbers == list(range(4, 4 + len(numbers)))
        assert kinds[-1] == "response.completed"
        polled = await client.responses.retrieve(created.id)
        assert (polled.status, polled.output_text) == ("completed", "word " * 400)
        # streamed: the SDK's stream closed early leaves it running, taken up after the last
        streamed = await client.responses.create(
            model="test-model", input="write", background=True, stream=True
        )
        first = []
        async for event in streamed:
            first.append(event)
            if len(first) == 5:
                break
        await streamed.close()
        last = first[-1].sequence_number
        rest = await client.responses.retrieve(
            first[0].response.id, stream=True, starting_after=last
        )
        tail = [event async for event in rest]
        assert [event.sequence_number for event in tail] == list(
            range(last + 1, last + 1 + len(tail))
        )
        assert tail[-1].type == "response.completed"
        other = await client.responses.create(model="test-model", input="x", background=True)
        cancelled = await client.responses.cancel(other.id)
        assert (cancelled.status, cancelled.background) == ("cancelled", True)
    await client.close()


async def test_a_stopping_server_ends_its_background_responses_after_its_grace(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    running, url = await start(start_server)
    with trio.fail_after(60):
        async with httpx.AsyncClient(headers=headers()) as http:
            response_id = (await http.post(url, json=payload())).json()["id"]
        await trio.sleep(1)
        await running.server.shutdown(grace_s=2)
        await running.server.wait_idle()
    assert trio.current_time() < 8  # not its end (8 s of text)
    (turn,) = running.server.responses.turns
    assert turn.status == "incomplete"
    responses = running.server.responses
    owner = responses.tenants.owner("Bearer k1")
    assert owner is not None
    stored = await responses.store.get(response_id, owner=owner)
    assert stored is not None and stored.response.status == "incomplete"
    assert stored.response.incomplete_details == {"reason": "server_shutdown"}
