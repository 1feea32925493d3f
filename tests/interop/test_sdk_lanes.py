"""The real openai-python SDK, unmodified, on lanes and on the multi-agent beta's inject.

`AsyncResponsesWebSocketSession` runs two lanes of multi-turn tool loops concurrently over one
socket and forks a third lane from one of them; `client.beta.responses.connect()` drives a
whole multi-tool rollout as ONE Response by `response.inject`. The SDK runs on asyncio in a
worker thread; the server runs in trio on 127.0.0.1, port 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import trio
from openai import AsyncOpenAI
from openai.lib.responses_websocket import (
    AsyncResponsesWebSocketLane,
    AsyncResponsesWebSocketSession,
    ResponsesWebSocketLimits,
)

from proto_server.engine.simulated import TimingModel
from proto_server.server.dialects.lanes import MULTI_AGENT_BETA
from proto_server.testing.checker import LaneChecker

from ..support.clients import in_thread
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.servers import StartServer

TERMINAL = {"response.completed", "response.failed", "response.incomplete"}
#: Slow enough that two lanes' Responses overlap in time, fast enough for a test.
PACED = TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=100)
LIMITS = ResponsesWebSocketLimits(
    max_lanes=8,
    max_events_per_lane=4096,
    max_events=8192,
    max_bytes_per_lane=64 * 1024 * 1024,
    max_bytes=128 * 1024 * 1024,
)
FINAL_TEXT = THREE_SEGMENTS["segments"][2]["text"]


def create(**fields: Any) -> dict[str, Any]:
    return {
        "type": "response.create",
        "model": "gpt-test",
        "input": "the tests fail; fix the bug",
        "tools": [EXEC_COMMAND],
        "store": False,
        **fields,
    }


def outputs(response: Any) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": f"ran {item.arguments}"}
        for item in response.output
        if item.type == "function_call"
    ]


class Lanes:
    """What each lane's consumer saw: its events (as JSON, for the checker) and when."""

    def __init__(self) -> None:
        self.events: dict[str, list[dict[str, Any]]] = {}
        #: each lane's frames and events in the order its consumer sent and saw them
        self.log: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        #: (stream_id, type) of every frame, in the order it came off the socket
        self.arrivals: list[tuple[str | None, str]] = []

    def watch(self, connection: Any) -> None:
        """Note each frame as the session's reader takes it off the socket (a lane's consumer
        may take its events later: `recv` does not yield while its queue holds events)."""
        receive = connection.recv_bytes

        async def recv_bytes() -> bytes:
            data: bytes = await receive()
            obj = json.loads(data)
            self.arrivals.append((obj.get("stream_id"), obj["type"]))
            return data

        connection.recv_bytes = recv_bytes

    async def send(
        self, name: str, lane: AsyncResponsesWebSocketLane, frame: dict[str, Any]
    ) -> None:
        self.log.setdefault(name, []).append(("sent", {**frame, "stream_id": name}))
        await lane.send(frame)

    async def collect(self, name: str, lane: AsyncResponsesWebSocketLane, until: set[str]) -> Any:
        while True:
            event = await lane.recv()
            self.events.setdefault(name, []).append(event.to_dict())
            self.log.setdefault(name, []).append(("received", event.to_dict()))
            if event.type in until:
                return event

    async def loop(
        self, name: str, lane: AsyncResponsesWebSocketLane, frame: dict[str, Any], **hooks: Any
    ) -> list[Any]:
        """A tool loop on one lane: create, run the tools, chain, until no tool is called."""
        responses = []
        while True:
            await self.send(name, lane, frame)
            await self.collect(name, lane, TERMINAL)
            response = await lane.get_final_response()
            responses.append(response)
            answered = outputs(response)
            if not answered:
                return responses
            if "after_first" in hooks and len(responses) == 1:
                await hooks["after_first"](response, answered)
            frame = create(previous_response_id=response.id, input=answered)


def two_lanes_and_a_fork(http_url: str) -> tuple[Lanes, dict[str, list[Any]]]:
    seen = Lanes()

    async def main() -> dict[str, list[Any]]:
        client = AsyncOpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
        async with client.responses.connect() as connection:
            seen.watch(connection)
            async with AsyncResponsesWebSocketSession(connection, limits=LIMITS) as session:
                a, b, fork = session.lane("a"), session.lane("b"), session.lane("fork")
                forked: list[asyncio.Task[list[Any]]] = []

                async def fork_from(parent: Any, answered: list[dict[str, Any]]) -> None:
                    # the SDK's rule for store: false: the fork must be in progress before the
                    # source lane advances past its parent
                    frame = create(previous_response_id=parent.id, input=answered)
                    await seen.send("fork", fork, frame)
                    await seen.collect("fork", fork, {"response.in_progress", *TERMINAL})

                    async def rest() -> list[Any]:
                        await seen.collect("fork", fork, TERMINAL)
                        first = await fork.get_final_response()
                        more = create(previous_response_id=first.id, input=outputs(first))
                        return [first, *await seen.loop("fork", fork, more)]

                    forked.append(asyncio.create_task(rest()))

                lane_a, lane_b = await asyncio.gather(
                    seen.loop("a", a, create(), after_first=fork_from),
                    seen.loop("b", b, create(input="and the other bug")),
                )
                return {"a": lane_a, "b": lane_b, "fork": await forked[0]}

    return seen, asyncio.run(main())


async def test_the_sdk_session_runs_two_lanes_concurrently_and_a_fork(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS, timing=PACED)
    with trio.fail_after(60):
        seen, responses = await in_thread(two_lanes_and_a_fork, running.address.http_url)
    assert [len(responses[lane]) for lane in ("a", "b", "fork")] == [3, 3, 2]
    for lane, chain in responses.items():
        assert [r.status for r in chain] == ["completed"] * len(chain), lane
        assert chain[-1].output_text == FINAL_TEXT
        for earlier, later in itertools.pairwise(chain):
            assert later.previous_response_id == earlier.id
    assert responses["fork"][0].previous_response_id == responses["a"][0].id
    # every event a lane's consumer got carries its lane, numbered per lane from 0, and holds
    # to the stream checker's promises
    for lane, events in seen.events.items():
        assert {e.get("stream_id") for e in events} == {lane}
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    checker = LaneChecker(dialect="launched")
    for log in seen.log.values():
        for what, obj in log:
            checker.sent(obj) if what == "sent" else checker.received(obj)
    checker.finish()
    # the two lanes ran at the same time: their first Responses overlapped on the socket
    arrivals = seen.arrivals
    a_start, b_start = (arrivals.index((lane, "response.created")) for lane in ("a", "b"))
    a_end, b_end = (arrivals.index((lane, "response.completed")) for lane in ("a", "b"))
    assert a_start < b_end and b_start < a_end
    # chained turns were warm on their own lanes; the fork started from lane a's Response
    # while lane a went on from it, warm
    sources = [t.source for t in running.server.responses.turns]
    assert sorted(sources) == sorted(["fresh"] * 2 + ["fork"] + ["cache"] * 5)


def inject_rollout(
    http_url: str, beta: bool
) -> tuple[list[Any], list[Any], list[tuple[str, dict[str, Any]]]]:
    """What a user writes with the beta client: one create, then inject each tool's output as
    soon as its call is done, until the ONE Response completes; then two injects it refuses."""

    log: list[tuple[str, dict[str, Any]]] = []  # the frames and events, in order

    async def main() -> tuple[list[Any], list[Any]]:
        client = AsyncOpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
        headers = {"OpenAI-Beta": MULTI_AGENT_BETA} if beta else {}
        events: list[Any] = []
        refusals: list[Any] = []
        async with client.beta.responses.connect(extra_headers=headers) as connection:
            log.append(("sent", create(multi_agent={"enabled": True})))
            await connection.response.create(
                model="gpt-test",
                input="the tests fail; fix the bug",
                tools=[EXEC_COMMAND],  # type: ignore[list-item]
                store=False,
                multi_agent={"enabled": True},
            )
            response_id = None
            async for event in connection:
                events.append(event)
                log.append(("received", event.to_dict()))
                if event.type == "response.created":
                    response_id = event.response.id
                if event.type == "response.output_item.done" and event.item.type == "function_call":
                    assert response_id is not None
                    answer = {
                        "type": "function_call_output",
                        "call_id": event.item.call_id,
                        "output": f"ran {event.item.arguments}",
                    }
                    inject = {"type": "response.inject", "response_id": response_id}
                    log.append(("sent", {**inject, "input": [answer]}))
                    await connection.response.inject(response_id=response_id, input=[answer])
                if event.type in TERMINAL or event.type == "error":
                    break
            if not beta:
                return events, refusals
            assert response_id is not None
            late = [{"type": "function_call_output", "call_id": "call_late", "output": "x"}]
            await connection.response.inject(response_id=response_id, input=late)
            await connection.response.inject(response_id="resp_unknown", input=late)
            async for event in connection:
                refusals.append(event)
                if len(refusals) == 2:
                    break
        return events, refusals

    events, refusals = asyncio.run(main())
    return events, refusals, log


async def test_the_beta_client_drives_a_multi_tool_rollout_as_one_response(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        events, refusals, log = await in_thread(inject_rollout, running.address.http_url, True)
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1
    assert "response.done" not in kinds  # the beta waits silently, still in_progress
    assert kinds.count("response.inject.created") == 3  # one call, then two
    final = events[-1]
    assert final.type == "response.completed"
    response = final.response
    assert response.id == events[0].response.id
    assert [item.type for item in response.output] == [
        "message", "function_call", "function_call", "function_call", "message"
    ]  # fmt: skip
    assert response.output[-1].content[0].text == FINAL_TEXT
    # resumed warm: each segment after the first re-read nothing it had already
    assert response.usage.input_tokens_details.cached_tokens > 0
    (turn,) = running.server.responses.turns
    assert (turn.source, turn.status) == ("fresh", "completed")
    # every inject.created came before the resumption it caused
    for index, kind in enumerate(kinds):
        if kind == "response.in_progress" and index > 1:
            assert kinds[index - 1] == "response.inject.created"
    late, unknown = refusals
    assert (late.type, late.error.code) == ("response.inject.failed", "response_already_completed")
    assert late.response_id == response.id
    assert [item.call_id for item in late.input] == ["call_late"]  # handed back, uncommitted
    assert (unknown.type, unknown.error.code) == ("response.inject.failed", "response_not_found")
    checker = LaneChecker(dialect="launched")
    for what, obj in log:
        checker.sent(obj) if what == "sent" else checker.received(obj)
    checker.finish()


async def test_inject_needs_the_beta_header_which_the_sdk_does_not_add(
    start_server: StartServer,
) -> None:
    running = await start_server(THREE_SEGMENTS)
    with trio.fail_after(60):
        events, _, _ = await in_thread(inject_rollout, running.address.http_url, False)
    error = events[-1]
    assert error.type == "error"
    assert error.error.code == "invalid_field"
    assert error.error.param == "multi_agent"
    assert MULTI_AGENT_BETA in error.error.message


LONG_THEN_SHORT = {"segments": [{"text": "word " * 200}, {"text": "Tabs it is."}]}


def steer_mid_stream(http_url: str) -> tuple[Lanes, list[Any], list[Any]]:
    """What a user writes with the session helper: a create on a lane, a steer through the
    same lane once text streams, then the steered Response and its successor read back."""
    seen = Lanes()

    async def main() -> tuple[list[Any], list[Any]]:
        client = AsyncOpenAI(base_url=http_url, api_key="sk-test", max_retries=0)
        async with (
            client.responses.connect() as connection,
            AsyncResponsesWebSocketSession(connection, limits=LIMITS) as session,
        ):
            lane = session.lane("s")
            await seen.send("s", lane, create(tools=[]))
            await seen.collect("s", lane, {"response.output_text.delta"})
            frame = {
                "type": "response.steer",
                "previous_response_id": seen.events["s"][0]["response"]["id"],
                "input": "Use tabs, not spaces.",
            }
            # the lane sends a steer as it is (no stream_id): the server routes it
            seen.log["s"].append(("sent", frame))
            await lane.send(frame)  # type: ignore[arg-type]
            typed = [await seen.collect("s", lane, {"response.steer.accepted"})]
            # the steered Response from its own terminal event: get_final_response() here
            # would read on into the successor whenever its events have already arrived
            steered = (await seen.collect("s", lane, {"response.incomplete"})).response
            await seen.collect("s", lane, {"response.created"})
            await seen.collect("s", lane, TERMINAL)
            successor = await lane.get_final_response()
            return [steered, successor], typed

    responses, typed = asyncio.run(main())
    return seen, responses, typed


async def test_a_steer_through_the_sdk_session_ends_the_response_and_its_successor_follows(
    start_server: StartServer,
) -> None:
    running = await start_server(
        LONG_THEN_SHORT, timing=TimingModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=200)
    )
    with trio.fail_after(60):
        seen, (steered, successor), typed = await in_thread(
            steer_mid_stream, running.address.http_url
        )
    assert steered.status == "incomplete"
    assert steered.incomplete_details is not None
    assert steered.incomplete_details.reason == "steered"
    assert successor.status == "completed"
    assert successor.previous_response_id == steered.id
    assert successor.output_text == "Tabs it is."
    assert successor.model == steered.model and successor.instructions == steered.instructions
    kinds = [e["type"] for e in seen.events["s"]]
    assert kinds.index("response.steer.accepted") < kinds.index("response.incomplete")
    assert type(typed[0]).__name__ == "ResponseSteerAcceptedEvent"  # the SDK's own type
    accepted = next(e for e in seen.events["s"] if e["type"] == "response.steer.accepted")
    assert accepted["steer"]["previous_response_id"] == steered.id
    assert [e["sequence_number"] for e in seen.events["s"]] == list(range(len(kinds)))
    checker = LaneChecker(dialect="launched")
    for what, obj in seen.log["s"]:
        checker.sent(obj) if what == "sent" else checker.received(obj)
    checker.finish()
    # the successor continued the steered Response's warm rollout on its lane
    assert [t.source for t in running.server.responses.turns] == ["fresh", "cache"]
