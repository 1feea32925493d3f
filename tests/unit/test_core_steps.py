"""What the sampling loop does next (`Steps.next_step`), decided without trio: the loop only
awaits what each step says, so every decision is pinned here."""

from __future__ import annotations

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.response import Mode, ResponseMachine, Status, Steer
from proto_server.core.response.steps import STOPPED, End, RunSegment, Send, Steps, Suspend
from proto_server.wire.errors import ServerFault
from proto_server.wire.events import OutputItemDone, ServerEvent
from proto_server.wire.items import FunctionCallOutput, Message
from proto_server.wire.response import Response


def machine(mode: Mode = Mode.SUSPEND) -> ResponseMachine:
    conv = Conversation(O200kRenderer())
    conv.extend([Message(role="user", content="hi")])
    return ResponseMachine(
        response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
        conversation=conv,
        mode=mode,
    )


def types(events: tuple[ServerEvent, ...]) -> list[str]:
    return [event.type for event in events]


def segment(steps: Steps) -> RunSegment:
    """The next step, which must be a segment; the machine begins it, as a Prefilled would."""
    step = steps.next_step()
    assert isinstance(step, RunSegment), step
    steps.machine.begin_segment(prompt_tokens=10, cached_tokens=0)
    return step


def call(steps: Steps) -> str:
    m = steps.machine
    m.begin_function_call("exec_command", tokens=1)
    m.function_call_arguments_delta("{}", tokens=1)
    (_, done) = m.end_function_call()
    assert isinstance(done, OutputItemDone)
    return done.item.call_id  # type: ignore[union-attr]


def output(call_id: str) -> FunctionCallOutput:
    return FunctionCallOutput(call_id=call_id, output="ok")


def suspended(steps: Steps, calls: int = 1) -> list[str]:
    """Run a segment that ends on `calls` tool calls; the machine closes it."""
    segment(steps)
    ids = [call(steps) for _ in range(calls)]
    steps.machine.end_segment()
    assert steps.segment_closed()
    return ids


def steer() -> Steer:
    text = "use tabs"
    return Steer(
        id="steer_1",
        previous_response_id="resp_1",
        items=(Message(role="user", content=text),),
        raw_input=text,
    )


def test_a_new_response_is_announced_with_its_first_segment() -> None:
    step = Steps(machine()).next_step()
    assert isinstance(step, RunSegment)
    assert types(step.announce) == ["response.created", "response.in_progress"]


def test_a_response_announced_elsewhere_is_not_announced_again() -> None:
    # a suspension rebuilt from the store: its append's resumption opens its segment
    steps = Steps(machine(), announced=True)
    assert steps.next_step() == RunSegment(())


def test_a_segment_that_ends_on_calls_suspends_until_the_last_is_answered() -> None:
    steps = Steps(machine())
    first, second = suspended(steps, calls=2)
    assert steps.next_step() == Suspend()
    assert not steps.append([output(first)], None)  # a partial answer: no resumption
    assert steps.next_step() == Suspend()
    assert steps.append([output(second)], None)
    step = steps.next_step()
    assert isinstance(step, RunSegment)
    assert types(step.announce) == ["response.in_progress"]
    assert steps.machine.status is Status.IN_PROGRESS


def test_a_completed_response_ends_with_nothing_more_to_say() -> None:
    steps = Steps(machine())
    segment(steps)
    steps.machine.text_delta("done", tokens=1)
    steps.machine.end_segment()  # its response.completed went out with the segment
    assert steps.segment_closed()
    assert steps.next_step() == End()


def test_a_cancel_before_the_first_segment_says_the_start_then_the_end() -> None:
    steps = Steps(machine())
    steps.machine.request_cancel()
    step = steps.next_step()
    assert isinstance(step, End)
    assert types(step.events) == ["response.created", "response.in_progress", "response.cancelled"]
    assert steps.machine.status is Status.CANCELLED


def test_a_resumption_then_a_cancel_say_both_in_order() -> None:
    steps = Steps(machine())
    (call_id,) = suspended(steps)
    assert steps.next_step() == Suspend()
    steps.append([output(call_id)], None)
    steps.machine.request_cancel()  # before the loop woke
    step = steps.next_step()
    assert isinstance(step, End)
    assert types(step.events) == ["response.in_progress", "response.cancelled"]


def test_a_segment_its_generator_stops_short_fails_the_response() -> None:
    steps = Steps(machine())
    segment(steps)
    steps.machine.text_delta("hal", tokens=1)
    assert not steps.segment_closed()  # the channel ended: the machine never closed it
    step = steps.next_step()
    assert isinstance(step, End)
    assert step.fault is STOPPED
    assert types(step.events)[-1] == "response.failed"
    assert steps.machine.error == STOPPED.detail


def test_the_generators_own_failure_is_the_one_said_and_only_once() -> None:
    steps = Steps(machine())
    segment(steps)
    fault = ServerFault("engine_down", "the engine went away")
    steps.generator_failed(fault)
    step = steps.next_step()
    assert isinstance(step, End)
    assert step.fault is fault
    assert steps.machine.error == fault.detail


def test_a_segment_cut_for_a_due_steer_applies_it_and_goes_on_in_place() -> None:
    steps = Steps(machine())
    segment(steps)
    steps.machine.steer(steer())
    assert steps.machine.steer_due  # the loop cut the generator
    step = steps.next_step()
    assert isinstance(step, Send)
    assert types(step.events)[-1] == "response.in_progress"
    assert steps.next_step() == RunSegment(())  # the same Response streams on


def test_a_successor_steer_ends_the_response_and_then_nothing_is_left() -> None:
    steps = Steps(machine(Mode.SUCCESSOR))
    segment(steps)
    steps.machine.steer(steer())
    step = steps.next_step()
    assert isinstance(step, Send)
    assert types(step.events)[-1] == "response.incomplete"
    assert steps.next_step() == End()


def test_a_segment_the_machine_closed_is_no_failure_even_if_it_resumed_meanwhile() -> None:
    # it suspended, its response.done went out, and an inject answered the call meanwhile
    steps = Steps(machine(Mode.WAIT))
    (call_id,) = suspended(steps)
    assert steps.inject([output(call_id)], None)
    step = steps.next_step()
    assert isinstance(step, RunSegment)
    assert types(step.announce) == ["response.in_progress"]


def test_outputs_injected_while_the_segment_streamed_resume_it_without_a_wait() -> None:
    steps = Steps(machine(Mode.WAIT))
    segment(steps)
    call_id = call(steps)
    assert not steps.inject([output(call_id)], None)  # held until the segment ends
    steps.machine.end_segment()  # silent: every call is answered already
    assert steps.segment_closed()
    step = steps.next_step()
    assert isinstance(step, RunSegment)
    assert types(step.announce) == ["response.in_progress"]
    assert not steps.machine.holds_injected


def test_an_injects_resumption_is_woken_once() -> None:
    steps = Steps(machine(Mode.WAIT))
    (call_id,) = suspended(steps)
    assert steps.next_step() == Suspend()
    assert not steps.wake()  # nothing answered yet
    assert steps.inject([output(call_id)], None)
    assert steps.wake()
    assert not steps.wake()


def test_an_expired_suspension_ends_incomplete() -> None:
    steps = Steps(machine())
    suspended(steps)
    assert steps.next_step() == Suspend()
    steps.machine.request_expire("suspend_timeout")
    step = steps.next_step()
    assert isinstance(step, End)
    assert types(step.events) == ["response.incomplete"]
    assert step.fault is None
