"""Any rollout script, any sequence of client actions, a real server on a real socket: the
checker validates every stream, and the server leaves nothing behind.

Actions run one after another; an action that `waits` lets the server and the stream settle
first (every task blocked: the server is idle and the client has read all that was sent),
one that does not races the stream, as a hasty client would.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.testing import LaneChecker, StreamChecker, WireClient, connect_checked
from proto_server.testing.schema import wire_schema

from ..support.clients import read_all
from ..support.frames import EXEC_COMMAND
from ..support.servers import FAST, quiet
from ..support.stores import CheckpointStore

READ_FILE = {**EXEC_COMMAND, "name": "read_file"}


@attrs.frozen
class Action:
    kind: str
    wait: bool = True
    tools: bool = True
    frame: Any = None


# -- strategies -------------------------------------------------------------------------------

arguments = st.dictionaries(
    st.sampled_from(["cmd", "path", "n"]),
    st.text(max_size=8) | st.integers(-(2**63), 2**63 - 1),
    max_size=2,
)
calls = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["exec_command", "read_file"]), "arguments": arguments}
    ),
    max_size=3,
)
segments = st.tuples(st.text(max_size=30), calls).filter(lambda s: s[0] or s[1])
scripts = st.lists(segments, min_size=1, max_size=4).map(
    lambda segs: {"segments": [{"text": t, "tool_calls": c} for t, c in segs]}
)
garbage = st.sampled_from(
    [
        "{truncated",
        "[]",
        '{"type": 5}',
        '{"type": "response.create", "input": 7}',
        '{"type": "response.append", "input": "nope"}',
        '{"type": "response.frobnicate"}',
        b"\x00\x01binary",
    ]
)
actions = st.one_of(
    st.builds(Action, st.just("create"), st.booleans(), st.booleans()),
    st.builds(Action, st.sampled_from(["answer_all", "answer_some", "cancel"]), st.booleans()),
    st.builds(
        Action, st.sampled_from(["answer_unknown", "answer_again", "message_only", "disconnect"])
    ),
    st.builds(Action, st.just("garbage"), frame=garbage),
    st.just(Action("wait")),
)


# -- the client ---------------------------------------------------------------------------------


def pending(checker: StreamChecker) -> list[str]:
    current = checker.current
    return list(current.pending) if current is not None else []


def answered(checker: StreamChecker) -> list[str]:
    current = checker.current
    return sorted(current.answered) if current is not None else []


def outputs(call_ids: list[str]) -> dict[str, Any]:
    return {
        "type": "response.append",
        "input": [{"type": "function_call_output", "call_id": c, "output": "ok"} for c in call_ids],
    }


async def perform(client: WireClient, action: Action) -> None:
    checker = client.checker
    match action.kind:
        case "create":
            tools = [EXEC_COMMAND, READ_FILE] if action.tools else []
            await client.send({"type": "response.create", "input": "go", "tools": tools})
        case "answer_all":
            await client.send(outputs(pending(checker) or ["call_none"]))
        case "answer_some":
            await client.send(outputs(pending(checker)[:1] or ["call_none"]))
        case "answer_unknown":
            await client.send(outputs(["call_unknown"]))
        case "answer_again":
            await client.send(outputs(answered(checker)[:1] or ["call_never"]))
        case "message_only":
            await client.send(
                {"type": "response.append", "input": [{"role": "user", "content": "and?"}]}
            )
        case "cancel":
            await client.send({"type": "response.cancel"})
        case "garbage":
            await client.send(action.frame)
        case "wait":
            pass


async def drive(url: str, script_actions: list[Action]) -> int:
    """Run the actions over as many connections as `disconnect` asks for; return events seen."""
    seen = 0
    remaining = list(script_actions)
    while True:
        dropped = False
        checked = connect_checked(url, schema=wire_schema())
        async with checked as client, trio.open_nursery() as nursery:
            nursery.start_soon(read_all, client)
            while remaining:
                action = remaining.pop(0)
                if action.kind == "disconnect":
                    await quiet() if action.wait else None
                    await client.vanish()  # no close frame: the TCP just drops
                    dropped = True
                    break
                await perform(client, action)
                if action.wait:
                    await quiet()
            await quiet()
            nursery.cancel_scope.cancel()
        seen += client.checker.next_sequence
        if not dropped:
            return seen


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(script=scripts, plan=st.lists(actions, max_size=10))
@example(  # a cancel that overtakes the first token
    script={"segments": [{"text": "hello there"}]},
    plan=[Action("create", wait=False), Action("cancel")],
)
@example(  # a cancel that ends the Response, then an append it refuses while it ends
    script={"segments": [{"text": "hi"}]},
    plan=[Action("create", wait=False, tools=False), Action("cancel", wait=False),
          Action("answer_unknown")],
)  # fmt: skip
@example(  # an answer sent before the calls it answers have all streamed
    script={"segments": [{"tool_calls": [{"name": "exec_command"}] * 2}, {"text": "ok"}]},
    plan=[Action("create", wait=False), Action("answer_all", wait=False), Action("answer_all")],
)
@example(  # a second create while the first is suspended, then both refusals
    script={"segments": [{"tool_calls": [{"name": "read_file"}]}, {"text": "ok"}]},
    plan=[Action("create"), Action("create"), Action("message_only"), Action("answer_all")],
)
@example(  # a partial answer, a duplicate, then the rest
    script={"segments": [{"tool_calls": [{"name": "read_file"}] * 3}, {"text": "ok"}]},
    plan=[
        Action("create"),
        Action("answer_some"),
        Action("answer_again"),
        Action("answer_all"),
    ],
)
@example(  # gone while suspended, back on a fresh connection
    script={"segments": [{"tool_calls": [{"name": "exec_command"}]}, {"text": "ok"}]},
    plan=[Action("create"), Action("disconnect"), Action("create"), Action("answer_all")],
)
@example(  # a script that calls a tool the request did not offer, then runs out
    script={"segments": [{"tool_calls": [{"name": "exec_command"}]}]},
    plan=[Action("create", tools=False), Action("create"), Action("answer_all")],
)
async def test_any_client_against_any_script_keeps_every_promise(
    script: dict[str, Any], plan: list[Action]
) -> None:
    server = ProtoServer(
        SimulatedGenerator(parse_script(script), FAST),
        ServerConfig(port=0, default_model="m"),
        store=CheckpointStore(),
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            await drive(f"{address.ws_url}?dialect=prototype", plan)
            await server.wait_idle()  # every connection and rollout released its state
            nursery.cancel_scope.cancel()


# -- lanes and inject -----------------------------------------------------------------------------

LANES = [None, "a", "b"]


@attrs.frozen
class LaneAction:
    kind: str
    lane: str | None = None
    wait: bool = True


lane_actions = st.builds(
    LaneAction,
    st.sampled_from(
        ["create", "answer_all", "answer_some", "inject_all", "inject_unknown", "cancel", "wait"]
    ),
    st.sampled_from(LANES),
    st.booleans(),
)


def lane_checker(client: WireClient, lane: str | None) -> StreamChecker:
    checker = client.checker
    assert isinstance(checker, LaneChecker)
    return checker.lane(lane)


async def perform_on_lane(client: WireClient, action: LaneAction) -> None:
    checker = lane_checker(client, action.lane)
    named = {} if action.lane is None else {"stream_id": action.lane}
    waiting = pending(checker)
    match action.kind:
        case "create":
            tools = [EXEC_COMMAND, READ_FILE]
            await client.send({"type": "response.create", "input": "go", "tools": tools, **named})
        case "answer_all" | "answer_some":
            calls = waiting if action.kind == "answer_all" else waiting[:1]
            await client.send({**outputs(calls or ["call_none"]), **named})
        case "inject_all":
            current = checker.current
            rid = current.id if current is not None else "resp_none"
            frame = {**outputs(waiting or ["call_none"]), "type": "response.inject"}
            await client.send({**frame, "response_id": rid})
        case "inject_unknown":
            frame = {**outputs(["call_x"]), "type": "response.inject"}
            await client.send({**frame, "response_id": "resp_unknown"})
        case "cancel":
            await client.send({"type": "response.cancel", **named})
        case "wait":
            pass


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(script=scripts, plan=st.lists(lane_actions, max_size=12))
@example(  # two lanes suspended at once, one answered by append, one by inject
    script={"segments": [{"tool_calls": [{"name": "exec_command"}] * 2}, {"text": "ok"}]},
    plan=[
        LaneAction("create", "a"),
        LaneAction("create", "b"),
        LaneAction("answer_all", "a"),
        LaneAction("inject_all", "b"),
    ],
)
@example(  # an inject that races the segment it answers
    script={"segments": [{"tool_calls": [{"name": "read_file"}] * 3}, {"text": "ok"}]},
    plan=[LaneAction("create", None, wait=False), LaneAction("inject_all", None)],
)
async def test_any_client_on_lanes_with_inject_keeps_every_promise(
    script: dict[str, Any], plan: list[LaneAction]
) -> None:
    server = ProtoServer(
        SimulatedGenerator(parse_script(script), FAST),
        ServerConfig(port=0, default_model="m"),
        store=CheckpointStore(),
    )
    beta = [("OpenAI-Beta", "responses_multi_agent=v1")]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            url = f"{address.ws_url}?dialect=prototype"
            async with (
                connect_checked(url, headers=beta, lanes=True) as client,
                trio.open_nursery() as reading,
            ):
                reading.start_soon(read_all, client)
                for action in plan:
                    await perform_on_lane(client, action)
                    if action.wait:
                        await quiet()
                await quiet()
                reading.cancel_scope.cancel()
            await server.wait_idle()
            nursery.cancel_scope.cancel()


@attrs.frozen
class LaunchedAction:
    kind: str
    lane: str | None = None
    source: str | None = None  # chain: the lane whose last Response it continues
    wait: bool = True


launched_actions = st.builds(
    LaunchedAction,
    st.sampled_from(["create", "create_waiting", "chain", "inject_all", "cancel", "wait"]),
    st.sampled_from(LANES),
    st.sampled_from(LANES),
    st.booleans(),
)


def last_completed(checker: StreamChecker) -> Any:
    done = [r for r in checker.responses.values() if r.phase == "completed"]
    return done[-1] if done else None


async def perform_launched(client: WireClient, action: LaunchedAction) -> None:
    checker = lane_checker(client, action.lane)
    named = {} if action.lane is None else {"stream_id": action.lane}
    tools = [EXEC_COMMAND, READ_FILE]
    match action.kind:
        case "create" | "create_waiting":
            waits = {"multi_agent": {"enabled": True}} if action.kind == "create_waiting" else {}
            frame = {"type": "response.create", "input": "go", "tools": tools, "store": False}
            await client.send({**frame, **named, **waits})
        case "chain":  # on its own lane, or a fork from another's
            parent = last_completed(lane_checker(client, action.source))
            rid = parent.id if parent is not None else "resp_none"
            calls = outputs(list(parent.pending) if parent is not None else [])["input"]
            frame = {"type": "response.create", "tools": tools, "store": False, **named}
            await client.send({**frame, "previous_response_id": rid, "input": calls or "more"})
        case "inject_all":
            current = checker.current
            rid = current.id if current is not None else "resp_none"
            frame = {**outputs(pending(checker) or ["call_none"]), "type": "response.inject"}
            await client.send({**frame, "response_id": rid})
        case "cancel":
            await client.send({"type": "response.cancel", **named})
        case "wait":
            pass


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(script=scripts, plan=st.lists(launched_actions, max_size=12))
@example(  # a turn on lane a, a fork of it on lane b, lane a going on from it too
    script={"segments": [{"tool_calls": [{"name": "exec_command"}]}, {"text": "ok"}]},
    plan=[
        LaunchedAction("create", "a"),
        LaunchedAction("chain", "b", "a", wait=False),
        LaunchedAction("chain", "a", "a"),
    ],
)
@example(  # creates queued behind a waiting Response, which an inject resumes
    script={"segments": [{"tool_calls": [{"name": "exec_command"}] * 2}, {"text": "ok"}]},
    plan=[
        LaunchedAction("create_waiting", None),
        LaunchedAction("create", None, wait=False),
        LaunchedAction("inject_all", None),
    ],
)
async def test_any_launched_client_on_lanes_keeps_every_promise(
    script: dict[str, Any], plan: list[LaunchedAction]
) -> None:
    server = ProtoServer(
        SimulatedGenerator(parse_script(script), FAST),
        ServerConfig(port=0, default_model="m"),
        store=CheckpointStore(),
    )
    beta = [("OpenAI-Beta", "responses_multi_agent=v1")]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            async with (
                connect_checked(address.ws_url, dialect="launched", headers=beta, lanes=True) as c,
                trio.open_nursery() as reading,
            ):
                reading.start_soon(read_all, c)
                for action in plan:
                    await perform_launched(c, action)
                    if action.wait:
                        await quiet()
                await quiet()
                reading.cancel_scope.cancel()
            await server.wait_idle()
            nursery.cancel_scope.cancel()
