"""The machine's ending states and steering, driven synchronously: no sockets, no clock."""

from __future__ import annotations

import pytest

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.response import STEERED, Mode, ResponseMachine, Status, Steer
from proto_server.wire.errors import ErrorDetail, ProtocolError, SteerRefused
from proto_server.wire.events import (
    OutputItemDone,
    ResponseInProgress,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    ResponseSteerPending,
)
from proto_server.wire.items import FunctionCallOutput, Message
from proto_server.wire.response import Response


def machine(*, successor: bool = False, max_pending_steers: int = 8) -> ResponseMachine:
    conv = Conversation(O200kRenderer())
    conv.extend([Message(role="user", content="hi")])
    m = ResponseMachine(
        response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
        conversation=conv,
        mode=Mode.SUCCESSOR if successor else Mode.SUSPEND,
        max_pending_steers=max_pending_steers,
    )
    m.start()
    m.begin_segment(prompt_tokens=10, cached_tokens=0)
    return m


def steer(text: str = "use tabs", n: int = 1) -> Steer:
    return Steer(
        id=f"steer_{n}",
        previous_response_id="resp_1",
        items=(Message(role="user", content=text),),
        raw_input=text,
    )


def call(m: ResponseMachine) -> str:
    m.begin_function_call("exec_command", tokens=1)
    m.function_call_arguments_delta("{}", tokens=1)
    (_, done) = m.end_function_call()
    assert isinstance(done, OutputItemDone)
    return done.item.call_id  # type: ignore[union-attr]


def test_a_cancel_is_decided_at_once_and_said_at_the_end() -> None:
    m = machine()
    m.text_delta("Hel", tokens=1)
    m.request_cancel()
    assert m.status is Status.ENDING and m.ending
    assert m.snapshot().status == "in_progress"  # nothing said yet
    with pytest.raises(ProtocolError, match="being cancelled"):
        m.request_cancel()
    with pytest.raises(ProtocolError, match="being cancelled") as refused:
        m.check_append([FunctionCallOutput(call_id="c", output="x")])
    assert refused.value.detail.code == "no_open_response"
    assert m.request_expire("server_shutdown") is False  # the first decision stands
    events = m.end()
    assert [e.type for e in events][-1] == "response.cancelled"
    assert m.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_an_expiry_and_a_fault_end_as_they_were_decided() -> None:
    m = machine()
    assert m.request_expire("suspend_timeout")
    assert m.request_fail(ErrorDetail(type="server_error", code="x", message="y")) is False
    (ended,) = m.end()
    assert ended.type == "response.incomplete"
    assert m.incomplete_reason == "suspend_timeout"
    m = machine()
    assert m.request_fail(ErrorDetail(type="server_error", code="generator_error", message="y"))
    assert [e.type for e in m.end()] == ["response.failed"]


def test_a_successor_steer_ends_the_response_steered_at_the_next_safe_point() -> None:
    m = machine(successor=True)
    m.text_delta("Writing with spa", tokens=3)
    (accepted,) = m.steer(steer())
    assert isinstance(accepted, ResponseSteerAccepted)
    assert accepted.steer.id == "steer_1" and accepted.steer.previous_response_id == "resp_1"
    assert m.steer_due
    events = m.take_steers()
    assert [e.type for e in events] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert m.status is Status.INCOMPLETE and m.incomplete_reason == STEERED
    assert m.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert [s.id for s in m.hand_over_steers()] == ["steer_1"]
    assert m.steers == ()


def test_a_steer_after_a_call_waits_for_the_outputs_it_names() -> None:
    m = machine(successor=True)
    call_id = call(m)
    m.steer(steer())
    assert not m.steer_due  # a call awaits output: cutting here would orphan it
    events = m.end_segment()
    assert [e.type for e in events] == ["response.completed", "response.steer.pending"]
    pending = events[-1]
    assert isinstance(pending, ResponseSteerPending)
    assert pending.reason == "waiting_for_required_input"
    assert [(r.call_id, r.name) for r in pending.required_input] == [(call_id, "exec_command")]
    assert [s.id for s in m.hand_over_steers()] == ["steer_1"]  # for the create that answers


def test_in_place_a_steer_cuts_the_segment_and_the_response_goes_on() -> None:
    m = machine()
    m.text_delta("Writing with spa", tokens=3)
    m.steer(steer())
    events = m.take_steers()
    assert isinstance(events[-1], ResponseInProgress)
    assert m.status is Status.IN_PROGRESS and not m.segment_open and m.steers == ()
    items = m.conversation.items
    assert items[-2].status == "incomplete"  # type: ignore[union-attr]
    assert items[-1] == Message(role="user", content="use tabs")


def test_in_place_a_steer_that_comes_as_the_segment_ends_goes_on_instead_of_completing() -> None:
    m = machine()
    m.text_delta("Done.", tokens=1)
    m.steer(steer())
    events = m.end_segment()
    assert [e.type for e in events][-1] == "response.in_progress"
    assert m.status is Status.IN_PROGRESS
    assert m.conversation.items[-1] == Message(role="user", content="use tabs")


def test_in_place_a_steer_while_suspended_is_pending_and_follows_the_outputs() -> None:
    m = machine()
    call_id = call(m)
    m.end_segment()
    assert m.status is Status.SUSPENDED
    accepted, pending = m.steer(steer())
    assert isinstance(accepted, ResponseSteerAccepted)
    assert isinstance(pending, ResponseSteerPending)
    assert [r.call_id for r in pending.required_input] == [call_id]
    events = m.append([FunctionCallOutput(call_id=call_id, output="ok")])
    assert [e.type for e in events] == ["response.in_progress"]
    kinds = [type(i).__name__ for i in m.conversation.items[-2:]]
    assert kinds == ["FunctionCallOutput", "Message"]  # outputs first: a call's answer follows it


def test_refusals_name_their_code_and_change_nothing() -> None:
    m = machine(max_pending_steers=1)
    m.steer(steer())
    with pytest.raises(SteerRefused) as refused:
        m.steer(steer(n=2))
    assert refused.value.code == "too_many_pending_steers"
    assert [s.id for s in m.steers] == ["steer_1"]
    m = machine()
    m.request_cancel()
    with pytest.raises(SteerRefused) as refused:
        m.steer(steer())
    assert refused.value.code == "response_not_active"
    m.end()
    with pytest.raises(SteerRefused) as refused:
        m.steer(steer())
    assert refused.value.code == "response_already_completed"
    conv = Conversation(O200kRenderer())
    beta = ResponseMachine(
        response=Response(id="resp_2", created_at=0, status="in_progress", model="m"),
        conversation=conv,
        mode=Mode.WAIT,
    )
    with pytest.raises(SteerRefused) as refused:
        beta.steer(steer())
    assert refused.value.code == "steering_not_supported"


def test_a_response_that_ends_otherwise_returns_every_steer_it_held() -> None:
    m = machine(successor=True)
    call(m)
    m.steer(steer("one", 1))
    m.steer(steer("two", 2))
    m.request_cancel()
    events = m.end()
    failed = [e for e in events if isinstance(e, ResponseSteerFailed)]
    assert [(f.steer.id, f.steer.input, f.error.code) for f in failed] == [
        ("steer_1", "one", "response_not_active"),
        ("steer_2", "two", "response_not_active"),
    ]
    assert m.steers == ()


UNSTORED = ErrorDetail(type="server_error", code="store_unavailable", message="disk full")


def test_an_unstored_end_fails_and_returns_every_steer_kept_for_the_successor() -> None:
    """A launched Response completes with a call awaiting output and two steers kept for the
    create that answers it; the store cannot take it: it fails, and both steers come back
    (more than one event: the sampling loop sends them all)."""
    m = machine(successor=True)
    call(m)
    m.steer(steer(n=1))
    m.steer(steer("and spaces", n=2))
    ended = m.end_segment()
    assert [e.type for e in ended][-3:] == ["response.completed", *["response.steer.pending"] * 2]
    events = m.fail_unstored(UNSTORED)
    assert [e.type for e in events] == ["response.failed", *["response.steer.failed"] * 2]
    assert all(e.error.code == "successor_creation_failed" for e in events[1:])  # type: ignore[attr-defined]
    assert [e.steer.id for e in events[1:]] == ["steer_1", "steer_2"]  # type: ignore[attr-defined]
    assert m.status is Status.FAILED


def test_a_suspension_lost_with_a_steer_pending_fails_and_returns_the_steer() -> None:
    m = machine()
    call(m)
    m.steer(steer())
    assert [e.type for e in m.end_segment()][-2:] == ["response.done", "response.steer.pending"]
    events = m.fail(UNSTORED)
    assert [e.type for e in events] == ["response.failed", "response.steer.failed"]
    assert m.status is Status.FAILED
