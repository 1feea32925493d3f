"""The checker itself: it passes a correct stream, and names the invariant each fault breaks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.response import ResponseMachine
from proto_server.core.sequence import Sequencer
from proto_server.testing import InvariantViolation, StreamChecker, o200k_count
from proto_server.wire.converter import as_json
from proto_server.wire.events import ServerEvent
from proto_server.wire.items import Message
from proto_server.wire.response import Response

Step = tuple[str, Any]  # ("sent", frame) or ("received", event)
CREATE = {"type": "response.create", "input": "fix it", "tools": []}


class Recorder:
    """Drives a real ResponseMachine and records what a client would have sent and seen."""

    def __init__(self) -> None:
        conversation = Conversation(O200kRenderer())
        conversation.extend([Message(role="user", content="fix it")])
        self.m = ResponseMachine(
            response=Response(id="resp_1", created_at=0, status="in_progress", model="m"),
            conversation=conversation,
        )
        self.sequencer = Sequencer()
        self.steps: list[Step] = []

    def sent(self, frame: Any) -> None:
        self.steps.append(("sent", frame))

    def emit(self, events: list[ServerEvent]) -> None:
        for event in events:
            obj = as_json(event)
            obj["sequence_number"] = self.sequencer.next()
            self.steps.append(("received", obj))

    def segment(self, text: str = "", calls: tuple[str, ...] = ()) -> list[str]:
        conversation = self.m.conversation
        cached = conversation.model_output_end if self.m.segments else 0
        self.m.begin_segment(prompt_tokens=conversation.token_count, cached_tokens=cached)
        if text:
            self.emit(self.m.text_delta(text[:3], tokens=o200k_count(text)))
            self.emit(self.m.text_delta(text[3:], tokens=0))
        call_ids = []
        for arguments in calls:
            name_tokens = o200k_count("exec_command")
            self.emit(self.m.begin_function_call("exec_command", tokens=name_tokens))
            self.emit(
                self.m.function_call_arguments_delta(arguments, tokens=o200k_count(arguments))
            )
            (_, done) = self.m.end_function_call()
            self.emit([_])
            self.emit([done])
            call_ids.append(done.item.call_id)  # type: ignore[union-attr]
        self.emit(self.m.end_segment())
        return call_ids


def answer(*call_ids: str) -> dict[str, Any]:
    items = [{"type": "function_call_output", "call_id": c, "output": "ok"} for c in call_ids]
    return {"type": "response.append", "input": items}


def rollout() -> list[Step]:
    """create; text and two calls; done; append both; text; completed."""
    r = Recorder()
    r.sent(CREATE)
    r.emit(r.m.start())
    calls = r.segment("Let me look.", ("", ""))
    r.sent(answer(*calls))
    r.emit(r.m.append([_output(c) for c in calls]))
    r.segment("Fixed.")
    return r.steps


def _output(call_id: str) -> Any:
    from proto_server.wire.items import FunctionCallOutput

    return FunctionCallOutput(call_id=call_id, output="ok")


def replay(steps: list[Step], *, finish: bool = True) -> StreamChecker:
    checker = StreamChecker(count_tokens=o200k_count)
    for kind, value in steps:
        if kind == "sent":
            checker.sent(value)
        else:
            checker.received(value)
    if finish:
        checker.finish()
    return checker


def received(steps: list[Step]) -> list[dict[str, Any]]:
    return [value for kind, value in steps if kind == "received"]


def find(steps: list[Step], type_: str, nth: int = 0) -> int:
    hits = [i for i, (k, v) in enumerate(steps) if k == "received" and v["type"] == type_]
    return hits[nth]


def renumber(steps: list[Step]) -> list[Step]:
    number = 0
    out: list[Step] = []
    for kind, value in steps:
        if kind == "received":
            value = {**value, "sequence_number": number}
            number += 1
        out.append((kind, value))
    return out


def test_a_correct_rollout_passes() -> None:
    checker = replay(rollout())
    assert checker.next_sequence == len(received(rollout()))
    assert [f.outcome for f in checker.frames] == ["accepted", "accepted"]


def drop(type_: str, nth: int = 0) -> Callable[[list[Step]], list[Step]]:
    def mutate(steps: list[Step]) -> list[Step]:
        del steps[find(steps, type_, nth)]
        return renumber(steps)

    return mutate


def edit(type_: str, change: Callable[[dict[str, Any]], None], nth: int = 0) -> Any:
    def mutate(steps: list[Step]) -> list[Step]:
        i = find(steps, type_, nth)
        event = copy.deepcopy(steps[i][1])
        change(event)
        steps[i] = ("received", event)
        return steps

    return mutate


def gap(steps: list[Step]) -> list[Step]:
    del steps[find(steps, "response.output_text.delta")]
    return steps


def after_end(steps: list[Step]) -> list[Step]:
    return renumber([*steps, steps[find(steps, "response.output_text.delta", 2)]])


def move_done_to_end_of_output(steps: list[Step]) -> list[Step]:
    """The first call's output_item.done after the second call was added."""
    i = find(steps, "response.output_item.done", 1)
    moved = steps.pop(i)
    steps.insert(find(steps, "response.output_item.added", 2) + 1, moved)
    return renumber(steps)


def resume_without_append(steps: list[Step]) -> list[Step]:
    del steps[[k for k, _ in steps].index("sent", 1)]
    return steps


def answered_twice(steps: list[Step]) -> list[Step]:
    """The server resumes on an append that answers one call twice (it must refuse that)."""
    i = [k for k, _ in steps].index("sent", 1)
    frame = steps[i][1]
    call = frame["input"][0]["call_id"]
    steps[i] = ("sent", answer(call, call))
    return steps


def reuse_call_id(steps: list[Step]) -> list[Step]:
    first = steps[find(steps, "response.output_item.added", 1)][1]["item"]["call_id"]
    for type_ in ("response.output_item.added", "response.output_item.done"):
        i = find(steps, type_, 2)
        event = copy.deepcopy(steps[i][1])
        event["item"]["call_id"] = first
        steps[i] = ("received", event)
    return steps


def bump(path: str, by: int) -> Callable[[dict[str, Any]], None]:
    def change(event: dict[str, Any]) -> None:
        usage = event["response"]["usage"]
        usage[path] += by

    return change


def wrong_status(event: dict[str, Any]) -> None:
    event["response"]["status"] = "completed"


def wrong_text(event: dict[str, Any]) -> None:
    event["text"] = event["text"] + "!"


def wrong_arguments(event: dict[str, Any]) -> None:
    event["item"]["arguments"] = "{}"


def wrong_index(event: dict[str, Any]) -> None:
    event["output_index"] = 0


@pytest.mark.parametrize(
    ("mutate", "invariant"),
    [
        (gap, 1),
        (edit("response.created", lambda e: e.update(sequence_number=1)), 1),
        (after_end, 2),
        (drop("response.created"), 2),
        (edit("response.done", wrong_status), 2),
        (drop("response.output_item.done"), 3),
        (drop("response.content_part.added"), 3),
        (drop("response.output_text.done"), 3),
        (edit("response.output_text.done", wrong_text), 3),
        (edit("response.output_item.done", wrong_arguments, 1), 3),
        (move_done_to_end_of_output, 3),
        (drop("response.output_item.added", 1), 3),
        (edit("response.output_item.added", wrong_index, 3), 4),
        (drop("response.in_progress", 1), 4),
        (resume_without_append, 4),
        (answered_twice, 4),
        (reuse_call_id, 5),
        (edit("response.done", bump("output_tokens", 1)), 6),
        (edit("response.completed", bump("total_tokens", -1)), 6),
        (edit("response.completed", bump("input_tokens", -10_000)), 6),
    ],
)
def test_each_fault_is_named_by_its_invariant(
    mutate: Callable[[list[Step]], list[Step]], invariant: int
) -> None:
    with pytest.raises(InvariantViolation) as caught:
        replay(mutate(rollout()))
    assert caught.value.invariant == invariant, caught.value
    assert f"invariant {invariant} (" in str(caught.value)


def test_a_violation_names_the_event_and_its_sequence_number() -> None:
    steps = edit("response.output_text.done", wrong_text)(rollout())
    with pytest.raises(InvariantViolation) as caught:
        replay(steps)
    number = steps[find(steps, "response.output_text.done")][1]["sequence_number"]
    assert caught.value.sequence_number == number
    assert f"at event #{number}: " in str(caught.value)
    assert "output_text.done" in str(caught.value)


def omit_output(event: dict[str, Any]) -> None:
    event["response"]["output"] = []


def test_a_snapshot_may_leave_its_output_out_only_in_the_prototype_dialect() -> None:
    """What the server sends over --max-event-bytes (docs/limits.md): all of it or none."""
    replay(edit("response.completed", omit_output)(edit("response.done", omit_output)(rollout())))
    with pytest.raises(InvariantViolation) as caught:
        replay(edit("response.completed", lambda e: e["response"]["output"].pop())(rollout()))
    assert caught.value.invariant == 3
    r = Recorder()
    r.sent(CREATE)
    r.emit(r.m.start())
    r.segment("Fixed.")
    omitted = edit("response.completed", omit_output)(r.steps)
    replay(omitted)
    launched = StreamChecker(dialect="launched", count_tokens=o200k_count)
    with pytest.raises(InvariantViolation) as caught:
        for kind, value in omitted:
            launched.sent(value) if kind == "sent" else launched.received(value)
    assert caught.value.invariant == 3


# -- invariant 7: frames and their answers ----------------------------------------------------


def error(code: str, sequence_number: int) -> dict[str, Any]:
    detail = {"type": "invalid_request_error", "code": code, "message": "m", "param": None}
    return {"type": "error", "status": 400, "error": detail, "sequence_number": sequence_number}


def test_a_frame_without_an_answer_is_reported_at_the_end() -> None:
    checker = StreamChecker()
    checker.sent({"type": "response.cancel"})
    with pytest.raises(InvariantViolation, match=r"frame #0 \(response.cancel\) got neither"):
        checker.finish()
    closed = StreamChecker()
    closed.sent({"type": "response.cancel"})
    closed.finish(closed=True)  # the connection died: the frame may never have been read


def test_an_error_must_answer_a_frame_that_could_earn_it() -> None:
    checker = StreamChecker()
    with pytest.raises(InvariantViolation, match="answers no frame") as caught:
        checker.received(error("invalid_json", 0))
    assert caught.value.invariant == 7
    checker = StreamChecker()
    checker.sent("{not json")
    checker.received(error("invalid_json", 0))
    checker.sent({"type": "response.cancel"})
    with pytest.raises(InvariantViolation, match="no_open_response"):
        checker.received(error("unknown_call_id", 1))


def test_a_forced_tool_call_may_be_refused_by_a_model_that_cannot_force_one() -> None:
    checker = StreamChecker()
    tools = [{"type": "function", "name": "exec_command"}]
    checker.sent({"type": "response.create", "tool_choice": "required", "tools": tools})
    checker.received(error("unsupported_tool_choice", 0))
    checker.finish()
    checker = StreamChecker()
    checker.sent({"type": "response.create"})
    with pytest.raises(InvariantViolation, match="answers no frame"):
        checker.received(error("unsupported_tool_choice", 0))


def test_a_background_create_is_refused_on_a_websocket_and_served_over_sse() -> None:
    """OpenAI's WebSocket mode refuses `background`; over HTTP its stream is any create's."""
    for dialect in ("prototype", "launched"):
        checker = StreamChecker(dialect=dialect)
        checker.sent({**CREATE, "background": True})
        checker.received(error("invalid_field", 0))
        checker.finish()
    r = Recorder()
    r.emit(r.m.start())
    r.segment("done")
    checker = StreamChecker(dialect="launched", transport="sse")
    checker.sent({**CREATE, "background": True})
    for kind, value in r.steps:
        assert kind == "received"
        checker.received(value)
    checker.finish()
    websocket = StreamChecker(dialect="launched")
    websocket.sent({**CREATE, "background": True})
    with pytest.raises(InvariantViolation, match=r"no response\.create asked for"):
        websocket.received(r.steps[0][1])


def test_an_error_must_not_be_missing_or_doubled() -> None:
    checker = StreamChecker()
    checker.sent(b"\x00")
    checker.received(error("invalid_frame", 0))
    with pytest.raises(InvariantViolation, match="answers no frame"):
        checker.received(error("invalid_frame", 1))


def suspended_steps() -> tuple[list[Step], list[str]]:
    r = Recorder()
    r.sent(CREATE)
    r.emit(r.m.start())
    calls = r.segment("", ("{}", "{}"))
    return r.steps, calls


def test_a_refused_frame_changes_nothing() -> None:
    """A server that resumes on an append it refused breaks invariant 7 (then 4)."""
    steps, (a, b) = suspended_steps()
    checker = replay(steps, finish=False)
    checker.sent(answer(a, "call_nope"))
    checker.received(error("unknown_call_id", checker.next_sequence))
    checker.sent(answer(b))  # partial: accepted, silently
    with pytest.raises(InvariantViolation) as caught:
        checker.received(
            {
                "type": "response.in_progress",
                "response": {"id": "resp_1", "status": "in_progress", "output": []},
                "sequence_number": checker.next_sequence,
            }
        )
    assert caught.value.invariant == 4
    assert a in str(caught.value)


def test_appends_racing_the_stream_are_judged_by_every_state_they_might_have_met() -> None:
    """An append sent while the segment streams may meet it streaming, or already suspended."""
    steps, calls = suspended_steps()
    done = find(steps, "response.done")
    # refused: the server read it while the segment still streamed
    early = [*steps[:done], ("sent", answer(*calls)), *steps[done:]]
    checker = replay(early, finish=False)
    checker.received(error("response_in_progress", checker.next_sequence))
    checker.finish()  # suspended, and every frame answered
    # accepted: the server read it after the suspension, and resumed
    checker = replay(early, finish=False)
    checker.received(
        {
            "type": "response.in_progress",
            "response": {"id": "resp_1", "status": "in_progress", "output": _ids(steps)},
            "sequence_number": checker.next_sequence,
        }
    )
    assert [f.outcome for f in checker.frames] == ["accepted", "accepted"]
    # but it cannot be refused for a reason no state it met would give
    checker = replay(early, finish=False)
    with pytest.raises(InvariantViolation, match="answers no frame"):
        checker.received(error("unknown_call_id", checker.next_sequence))


def _ids(steps: list[Step]) -> list[dict[str, Any]]:
    done = steps[find(steps, "response.done")][1]
    return [{"id": item["id"]} for item in done["response"]["output"]]


def test_a_suspension_that_expires_reopens_the_appends_it_had_not_confirmed() -> None:
    """An append accepted by prediction may have met the Response already expired."""
    steps, (a, _) = suspended_steps()
    checker = replay(steps, finish=False)
    checker.sent(answer(a))
    incomplete = {
        "type": "response.incomplete",
        "response": {
            "id": "resp_1",
            "status": "incomplete",
            "output": _ids(steps),
            "incomplete_details": {"reason": "suspend_timeout"},
        },
        "sequence_number": checker.next_sequence,
    }
    checker.received(incomplete)
    checker.received(error("no_open_response", checker.next_sequence))
    checker.finish()


# -- lanes and inject ---------------------------------------------------------------------------


def on_lane(obj: dict[str, Any], lane: str | None, number: int) -> dict[str, Any]:
    laned = {**obj, "sequence_number": number}
    if lane is not None:
        laned["stream_id"] = lane
    return laned


def lane_stream(lane: str | None, rid: str) -> list[dict[str, Any]]:
    response = {"id": rid, "status": "in_progress", "output": []}
    done = {**response, "status": "completed"}
    return [
        on_lane({"type": "response.created", "response": response}, lane, 0),
        on_lane({"type": "response.in_progress", "response": response}, lane, 1),
        on_lane({"type": "response.completed", "response": done}, lane, 2),
    ]


def test_lanes_interleave_each_numbered_from_zero() -> None:
    from proto_server.testing import LaneChecker

    checker = LaneChecker(dialect="launched")
    checker.sent({**CREATE, "stream_id": "a"})
    checker.sent(CREATE)
    a, default = lane_stream("a", "resp_a"), lane_stream(None, "resp_d")
    for pair in zip(a, default, strict=True):
        for event in pair:
            checker.received(event)
    checker.finish()


def test_an_event_on_another_lanes_numbering_or_of_another_lanes_response_is_caught() -> None:
    from proto_server.testing import LaneChecker

    checker = LaneChecker(dialect="launched")
    checker.sent({**CREATE, "stream_id": "a"})
    checker.sent({**CREATE, "stream_id": "b"})
    checker.received(lane_stream("a", "resp_a")[0])
    with pytest.raises(InvariantViolation) as caught:  # numbered as if the lanes were one
        checker.received(on_lane(lane_stream("b", "resp_b")[0], "b", 1))
    assert caught.value.invariant == 1
    checker = LaneChecker(dialect="launched")
    checker.sent({**CREATE, "stream_id": "a"})
    checker.sent({**CREATE, "stream_id": "b"})
    checker.received(lane_stream("a", "resp_a")[0])
    with pytest.raises(InvariantViolation) as caught:  # lane a's Response on lane b
        checker.received(lane_stream("b", "resp_a")[0])
    assert caught.value.invariant == 9


def test_a_queued_create_must_be_created_with_the_id_it_was_queued_as() -> None:
    checker = StreamChecker(dialect="launched")
    checker.sent(CREATE)
    checker.sent(CREATE)
    first = lane_stream(None, "resp_1")
    checker.received(first[0])
    queued = {"id": "resp_2", "status": "queued", "output": []}
    checker.received(on_lane({"type": "response.queued", "response": queued}, None, 1))
    checker.received(on_lane(first[1], None, 2))
    checker.received(on_lane(first[2], None, 3))
    impostor = {"id": "resp_3", "status": "in_progress", "output": []}
    with pytest.raises(InvariantViolation, match="queued as resp_2"):
        checker.received(on_lane({"type": "response.created", "response": impostor}, None, 4))


def test_an_inject_must_answer_waiting_calls_and_a_refusal_must_return_its_input() -> None:
    checker = StreamChecker(dialect="prototype")
    rec = Recorder()
    checker.sent(CREATE)
    rec.emit(rec.m.start())
    (call,) = rec.segment("Let me look.", calls=('{"cmd":"ls"}',))  # it ends suspended
    for _, event in rec.steps:
        checker.received(event)
    answer = [{"type": "function_call_output", "call_id": call, "output": "ok"}]
    checker.sent({"type": "response.inject", "response_id": "resp_1", "input": answer})
    wrong = {"type": "response.inject", "response_id": "resp_1", "input": answer}
    checker.sent({**wrong, "input": [{**answer[0], "call_id": "call_other"}]})
    n = rec.sequencer.sent
    failed = {
        "type": "response.inject.failed",
        "response_id": "resp_1",
        "error": {"code": "response_already_completed", "message": "late"},
        "input": answer,  # not the input of the frame it answers
    }
    created = {"type": "response.inject.created", "response_id": "resp_1"}
    checker.received({**created, "sequence_number": n})
    with pytest.raises(InvariantViolation, match="input as it was sent") as caught:
        checker.received({**failed, "sequence_number": n + 1})
    assert caught.value.invariant == 7
    checker = StreamChecker(dialect="prototype")
    checker.sent(CREATE)
    for _, event in rec.steps:
        checker.received(event)
    checker.sent({**wrong, "input": [{**answer[0], "call_id": "call_other"}]})
    with pytest.raises(InvariantViolation) as caught:  # committed an output no call awaits
        checker.received({**created, "sequence_number": n})
    assert caught.value.invariant == 5
