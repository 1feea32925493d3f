"""The sans-IO Response state machine, driven synchronously: no sockets, no clock."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.response import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Mode,
    ResponseMachine,
    Status,
)
from proto_server.wire.converter import encode_server_event
from proto_server.wire.errors import ErrorDetail, ProtocolError, quoted, some_of
from proto_server.wire.events import ErrorEvent, OutputItemDone
from proto_server.wire.items import FunctionCall, FunctionCallOutput, Message
from proto_server.wire.response import Response


def machine() -> ResponseMachine:
    conv = Conversation(O200kRenderer())
    conv.extend([Message(role="user", content="hi")])
    return ResponseMachine(
        response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
        conversation=conv,
    )


def suspended_with(calls: int) -> tuple[ResponseMachine, list[str]]:
    m = machine()
    m.start()
    m.begin_segment(prompt_tokens=10, cached_tokens=0)
    call_ids = []
    for _ in range(calls):
        m.begin_function_call("exec_command", tokens=2)
        m.function_call_arguments_delta("{}", tokens=1)
        (_, done) = m.end_function_call()
        call_ids.append(done.item.call_id)  # type: ignore[union-attr]
    m.end_segment()
    assert m.status is Status.SUSPENDED
    return m, call_ids


def output(call_id: str) -> FunctionCallOutput:
    return FunctionCallOutput(call_id=call_id, output="ok")


def test_the_transition_table() -> None:
    assert TRANSITIONS[Status.IN_PROGRESS] == {
        Status.SUSPENDED, Status.ENDING,
        Status.COMPLETED, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED
    }  # fmt: skip
    assert TRANSITIONS[Status.SUSPENDED] == {
        Status.IN_PROGRESS, Status.ENDING, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED
    }  # fmt: skip
    # ending: decided, its terminal not said yet; only the ends it can say
    assert TRANSITIONS[Status.ENDING] == {Status.FAILED, Status.INCOMPLETE, Status.CANCELLED}
    for status in TERMINAL:
        assert TRANSITIONS[status] == frozenset()


def test_a_segment_without_tool_calls_completes() -> None:
    m = machine()
    m.start()
    m.begin_segment(prompt_tokens=5, cached_tokens=0)
    m.text_delta("Hi", tokens=1)
    events = m.end_segment()
    assert [e.type for e in events] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert m.status is Status.COMPLETED
    assert m.usage().total_tokens == 6


def test_a_partial_append_keeps_it_suspended_and_the_last_answer_resumes() -> None:
    m, (a, b) = suspended_with(2)
    assert m.append([output(a)]) == []
    assert m.status is Status.SUSPENDED
    assert list(m.pending_calls) == [b]
    events = m.append([output(b)])
    assert [e.type for e in events] == ["response.in_progress"]
    assert m.status is Status.IN_PROGRESS


def test_an_append_sets_its_tool_choice_only_if_it_is_taken() -> None:
    m, (a,) = suspended_with(1)
    before = m.template.tool_choice
    with pytest.raises(ProtocolError):
        m.append([output("call_unknown")], tool_choice="none")
    assert m.template.tool_choice == before
    (resumed,) = m.append([output(a)], tool_choice="none")
    assert m.template.tool_choice == "none"
    assert resumed.response.tool_choice == "none"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("items", "code"),
    [
        ([output("call_unknown")], "unknown_call_id"),
        ("dup", "duplicate_call_id"),
        ([], "invalid_field"),
        ([FunctionCall(call_id="c", name="n", arguments="{}")], "invalid_field"),
        ([Message(role="user", content="more")], "missing_tool_output"),
    ],
)
def test_a_refused_append_changes_nothing(items: object, code: str) -> None:
    m, (a,) = suspended_with(1)
    if items == "dup":
        items = [output(a), output(a)]
    before = (m.status, dict(m.pending_calls), set(m.answered_calls), m.conversation.token_count)
    with pytest.raises(ProtocolError) as refused:
        m.append(items)  # type: ignore[arg-type]
    assert refused.value.detail.code == code
    after = (m.status, dict(m.pending_calls), set(m.answered_calls), m.conversation.token_count)
    assert after == before


def frame_of(refused: pytest.ExceptionInfo[ProtocolError]) -> bytes:
    """The `error` frame a client would receive for this refusal."""
    event = ErrorEvent(status=refused.value.status, error=refused.value.detail)
    return encode_server_event(event, 0).encode()


@pytest.mark.parametrize(
    ("append", "code"),
    [
        (lambda ids: [output("call_" + "x" * 100_000)], "unknown_call_id"),
        (lambda ids: [output(ids[0]), output(ids[0])], "duplicate_call_id"),
        (lambda ids: [output(ids[0]), Message(role="user", content="go")], "missing_tool_output"),
    ],
)
def test_an_error_about_thousands_of_pending_calls_stays_small(append: Any, code: str) -> None:
    """A 100-byte append must not earn a 93 KB error listing every pending call."""
    m, ids = suspended_with(3_000)
    with pytest.raises(ProtocolError) as refused:
        m.append(append(ids))
    assert refused.value.detail.code == code
    assert len(frame_of(refused)) < 1024
    if code != "duplicate_call_id":
        assert "2,999, e.g." in refused.value.detail.message or "3,000, e.g." in (
            refused.value.detail.message
        )


def test_a_few_names_are_listed_whole_many_are_counted_and_long_ones_cut() -> None:
    assert some_of([]) == "none"
    assert some_of(["a", "b"]) == "'a', 'b'"
    assert some_of(f"c{i}" for i in range(7)) == "7, e.g. 'c0', 'c1', 'c2', 'c3', 'c4', ..."
    assert quoted("short") == "'short'"
    assert quoted("y" * 1000) == repr("y" * 64) + "... (1,000 characters)"


def test_append_while_streaming_or_after_the_end_is_refused() -> None:
    m = machine()
    m.start()
    with pytest.raises(ProtocolError) as refused:
        m.append([output("x")])
    assert refused.value.detail.code == "response_in_progress"
    m.begin_segment(prompt_tokens=1, cached_tokens=0)
    m.end_segment()
    with pytest.raises(ProtocolError) as refused:
        m.append([output("x")])
    assert refused.value.detail.code == "no_open_response"


def test_the_generator_cannot_drive_an_illegal_move_and_nothing_changes() -> None:
    m, _ = suspended_with(1)
    with pytest.raises(IllegalTransition):
        m.text_delta("late", tokens=1)
    with pytest.raises(IllegalTransition):
        m.end_segment()
    assert m.status is Status.SUSPENDED
    m2 = machine()
    m2.start()
    m2.begin_segment(prompt_tokens=1, cached_tokens=0)
    m2.begin_function_call("f")
    with pytest.raises(IllegalTransition):
        m2.text_delta("inside a call", tokens=1)
    with pytest.raises(IllegalTransition):
        m2.end_segment()


def test_a_segment_ends_on_its_tool_calls() -> None:
    """Found by the stateful test: text after a call would suspend on a message."""
    m = machine()
    m.start()
    m.begin_segment(prompt_tokens=1, cached_tokens=0)
    m.begin_function_call("f", tokens=1)
    m.end_function_call()
    before = (len(m.output), m.usage())
    with pytest.raises(IllegalTransition, match="calls come last"):
        m.text_delta("and another thing", tokens=4)
    assert (len(m.output), m.usage()) == before
    assert [e.type for e in m.end_segment()] == ["response.done"]


def test_failing_mid_call_closes_the_item_and_leaves_no_call_pending() -> None:
    m = machine()
    m.start()
    m.begin_segment(prompt_tokens=1, cached_tokens=0)
    m.begin_function_call("f")
    events = m.fail(ErrorDetail(type="server_error", code="x", message="boom"))
    assert [e.type for e in events] == ["response.output_item.done", "response.failed"]
    assert events[0].item.status == "incomplete"  # type: ignore[union-attr]
    assert m.pending_calls == {}
    assert m.snapshot().error is not None
    with pytest.raises(ProtocolError):
        m.cancel()


def test_usage_adds_up_over_segments() -> None:
    m, (a,) = suspended_with(1)
    m.append([output(a)])
    m.begin_segment(prompt_tokens=30, cached_tokens=20)
    m.text_delta("done", tokens=1)
    m.end_segment()
    usage = m.usage()
    assert usage.input_tokens == 40
    assert usage.input_tokens_details.cached_tokens == 20
    assert usage.output_tokens == 2 + 1 + 1
    assert usage.total_tokens == 44


def test_in_the_launched_dialect_a_segment_with_tool_calls_completes() -> None:
    m = ResponseMachine(
        response=Response(id="resp_2", created_at=0, status="in_progress", model="m"),
        conversation=Conversation(O200kRenderer()),
        mode=Mode.SUCCESSOR,
    )
    m.start()
    m.begin_segment(prompt_tokens=1, cached_tokens=0)
    m.begin_function_call("f")
    m.end_function_call()
    assert m.end_segment()[-1].type == "response.completed"
    assert m.status is Status.COMPLETED


def test_the_ids_of_what_it_makes_come_from_the_function_it_is_given() -> None:
    """Given a counter, two runs of the same moves name every item alike: a test can write
    down the exact events it expects."""

    def run() -> list[Any]:
        count = itertools.count()
        conv = Conversation(O200kRenderer())
        conv.extend([Message(role="user", content="hi")])
        m = ResponseMachine(
            response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
            conversation=conv,
            new_id=lambda prefix: f"{prefix}_{next(count)}",
        )
        events = list(m.start())
        m.begin_segment(prompt_tokens=3, cached_tokens=0)
        events += m.text_delta("Let me look.", tokens=3)
        events += m.begin_function_call("exec_command", tokens=2)
        events += m.end_function_call()
        return events

    first, again = run(), run()
    assert first == again
    made = [e.item for e in first if isinstance(e, OutputItemDone)]
    assert [(item.type, item.id) for item in made] == [
        ("message", "msg_0"),
        ("function_call", "fc_1"),
    ]
    assert made[1].call_id == "call_2"  # type: ignore[union-attr]
