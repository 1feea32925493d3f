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
from trio_websocket import ConnectionClosed

from proto_server.engine.script import parse_script
from proto_server.engine.simulated import SimulatedGenerator
from proto_server.server.app import ProtoServer
from proto_server.server.config import ServerConfig
from proto_server.testing import CheckedClient, StreamChecker, connect_checked
from proto_server.testing.schema import wire_schema

from .conftest import EXEC_COMMAND, FAST, CheckpointStore

READ_FILE = {**EXEC_COMMAND, "name": "read_file"}
SETTLE_S = 0.005  # how long every task must stay blocked for the connection to count as quiet


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


async def quiet() -> None:
    await trio.testing.wait_all_tasks_blocked(SETTLE_S)


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


async def perform(client: CheckedClient, action: Action) -> None:
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


async def read_all(client: CheckedClient) -> None:
    try:
        while True:
            await client.receive()
    except ConnectionClosed:
        pass


async def drive(url: str, script_actions: list[Action]) -> int:
    """Run the actions over as many connections as `disconnect` asks for; return events seen."""
    seen = 0
    remaining = list(script_actions)
    while True:
        dropped = False
        with trio.CancelScope() as gone:
            checked = connect_checked(url, schema=wire_schema())
            async with checked as client, trio.open_nursery() as nursery:
                nursery.start_soon(read_all, client)
                while remaining:
                    action = remaining.pop(0)
                    if action.kind == "disconnect":
                        await quiet() if action.wait else None
                        await client.ws._stream.aclose()  # no close frame: the TCP just drops
                        dropped = True
                        break
                    await perform(client, action)
                    if action.wait:
                        await quiet()
                await quiet()
                if dropped:
                    client.checker.finish(closed=True)
                    gone.cancel()  # nor does the client wait to close what is gone
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
