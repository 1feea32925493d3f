"""The transition table is what the machine does: for every (status, event) pair, the method
that makes the event happen takes a Response in that status where `TABLE` says, asking the
table once; where the table has no move, it is refused with its typed error (or, for the
server's own requests to end, declined) and nothing changes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.response import (
    TABLE,
    Event,
    IllegalTransition,
    Mode,
    ResponseMachine,
    Status,
    transitions,
)
from proto_server.wire.errors import ErrorDetail, ProtocolError
from proto_server.wire.items import FunctionCallOutput, Message
from proto_server.wire.response import Response

ERROR = ErrorDetail(type="server_error", code="generator_error", message="boom")


def streaming() -> ResponseMachine:
    conv = Conversation(O200kRenderer())
    conv.extend([Message(role="user", content="hi")])
    m = ResponseMachine(
        response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
        conversation=conv,
        mode=Mode.SUSPEND,
    )
    m.start()
    m.begin_segment(prompt_tokens=10, cached_tokens=0)
    m.text_delta("Hel", tokens=1)  # an item open, so ends have something to close
    return m


def make_call(m: ResponseMachine) -> None:
    m.begin_function_call("exec_command", tokens=1)
    m.function_call_arguments_delta("{}", tokens=1)
    m.end_function_call()


def suspended() -> ResponseMachine:
    m = streaming()
    make_call(m)
    m.end_segment()
    return m


def ending() -> ResponseMachine:
    """Ending with a cancel decided (`end` says it: the `cancel` event)."""
    m = streaming()
    m.request_cancel()
    return m


def completed() -> ResponseMachine:
    m = streaming()
    m.end_segment()
    return m


def failed() -> ResponseMachine:
    m = streaming()
    m.fail(ERROR)
    return m


def incomplete() -> ResponseMachine:
    m = streaming()
    m.make_incomplete("max_output_tokens")
    return m


def cancelled() -> ResponseMachine:
    m = streaming()
    m.cancel()
    return m


IN: dict[Status, Callable[[], ResponseMachine]] = {
    Status.IN_PROGRESS: streaming,
    Status.SUSPENDED: suspended,
    Status.ENDING: ending,
    Status.COMPLETED: completed,
    Status.FAILED: failed,
    Status.INCOMPLETE: incomplete,
    Status.CANCELLED: cancelled,
}


def suspend(m: ResponseMachine) -> Any:
    if m.status is Status.IN_PROGRESS:  # a call to wait on, where one can be made
        make_call(m)
    return m.end_segment()


def resume(m: ResponseMachine) -> Any:
    calls = list(m.pending_calls) or ["call_none"]
    return m.append([FunctionCallOutput(call_id=call_id, output="ok") for call_id in calls])


def cancel(m: ResponseMachine) -> Any:
    """The client's cancel at once, or, once a cancel was decided, its end said."""
    return m.end() if m.status is Status.ENDING else m.cancel()


#: Each event: what makes it happen, and how it is refused where the table has no move (an
#: exception type, or `False` from a request the server may make too late).
FIRE: dict[Event, tuple[Callable[[ResponseMachine], Any], type[Exception] | bool]] = {
    Event.SUSPEND: (suspend, IllegalTransition),
    Event.RESUME: (resume, ProtocolError),
    Event.COMPLETE: (lambda m: m.end_segment(), IllegalTransition),
    Event.REQUEST_CANCEL: (lambda m: m.request_cancel(), ProtocolError),
    Event.REQUEST_EXPIRE: (lambda m: m.request_expire("suspend_timeout"), False),
    Event.REQUEST_FAIL: (lambda m: m.request_fail(ERROR), False),
    Event.FAIL: (lambda m: m.fail(ERROR), IllegalTransition),
    Event.MAKE_INCOMPLETE: (lambda m: m.make_incomplete("max_output_tokens"), IllegalTransition),
    Event.CANCEL: (cancel, ProtocolError),
    Event.FAIL_UNSTORED: (lambda m: m.fail_unstored(ERROR), IllegalTransition),
}


def looks(m: ResponseMachine) -> tuple[Any, ...]:
    return (m.status, m.snapshot(), m.steers, dict(m.pending_calls), m.conversation.token_count)


def test_each_status_is_built_and_each_event_is_fired() -> None:
    assert {status: build().status for status, build in IN.items()} == {s: s for s in Status}
    assert set(FIRE) == set(Event)


@pytest.mark.parametrize(
    ("status", "event"),
    list(itertools.product(Status, Event)),
    ids=lambda value: value.value,
)
def test_the_machine_does_what_the_table_says(
    status: Status, event: Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = IN[status]()
    fire, refused = FIRE[event]
    moved: list[tuple[Status, Event]] = []
    move = transitions.move

    def moving(state: Status, happened: Event) -> Status:
        to = move(state, happened)
        moved.append((state, happened))
        return to

    monkeypatch.setattr(transitions, "move", moving)
    if (status, event) in TABLE:
        result = fire(m)
        assert m.status is TABLE[status, event]
        assert moved == [(status, event)]  # the one move, through the table
        assert result is not False
        return
    before = looks(m)
    if refused is False:
        assert fire(m) is False
    else:
        assert isinstance(refused, type)
        with pytest.raises(refused):
            fire(m)
    assert looks(m) == before and not moved  # refused: nothing changed


@pytest.mark.parametrize(
    ("decide", "event"),
    [
        (lambda m: m.request_cancel(), Event.CANCEL),
        (lambda m: m.request_expire("suspend_timeout"), Event.MAKE_INCOMPLETE),
        (lambda m: m.request_fail(ERROR), Event.FAIL),
    ],
    ids=["cancel", "expire", "fail"],
)
def test_an_end_decided_is_said_by_its_event(
    decide: Callable[[ResponseMachine], Any], event: Event
) -> None:
    for build in (streaming, suspended):
        m = build()
        decide(m)
        assert m.status is Status.ENDING
        m.end()
        assert m.status is TABLE[Status.ENDING, event]


def test_an_illegal_move_names_the_status_and_the_event() -> None:
    with pytest.raises(IllegalTransition, match="completed -> resume"):
        transitions.move(Status.COMPLETED, Event.RESUME)


def test_the_docs_table_renders_every_pair() -> None:
    head, _, *rows = [
        [cell.strip() for cell in row.strip("|").split("|")]
        for row in transitions.table_markdown().splitlines()
    ]
    assert head[2:] == [status.value for status in Status]
    for event, cells in zip(Event, rows, strict=True):
        assert cells[0] == f"`{event.value}`"
        said = {status: cell.strip("`") for status, cell in zip(Status, cells[2:], strict=True)}
        assert said == {
            status: TABLE[status, event].value if (status, event) in TABLE else "·"
            for status in Status
        }
