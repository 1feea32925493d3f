"""The client's bookkeeping without I/O: states, pending calls, per-segment tokens and timings."""

from __future__ import annotations

import pytest

from proto_server.client.display import time_split
from proto_server.client.segment import Received
from proto_server.client.state import OutputsRefused, RolloutState, RolloutTracker
from proto_server.engine.simulated import TimingModel
from proto_server.wire.errors import ErrorDetail
from proto_server.wire.events import (
    ErrorEvent,
    OutputItemDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ServerEvent,
)
from proto_server.wire.items import FunctionCall, FunctionCallOutput
from proto_server.wire.response import InputTokensDetails, Response, Usage


def response(rid: str, *, status: str = "in_progress", tokens: tuple[int, int, int]) -> Response:
    given, cached, out = tokens
    usage = Usage(
        input_tokens=given,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=out,
        total_tokens=given + out,
    )
    return Response(id=rid, created_at=0, status=status, model="m", usage=usage)


def call(call_id: str) -> FunctionCall:
    return FunctionCall(call_id=call_id, name="exec_command", arguments='{"cmd":"ls"}')


def feed(tracker: RolloutTracker, at: float, *events: ServerEvent) -> None:
    for offset, event in enumerate(events):
        tracker.received(Received(None, event, at + offset * 0.001, 100))


def suspended_prototype() -> RolloutTracker:
    tracker = RolloutTracker("prototype")
    tracker.sent(at=10.0, size=300)
    first = response("resp_1", tokens=(0, 0, 0))
    feed(tracker, 10.002, ResponseCreated(response=first))
    feed(tracker, 10.040, OutputItemDone(output_index=0, item=call("call_a")))
    feed(tracker, 10.050, OutputItemDone(output_index=1, item=call("call_b")))
    feed(tracker, 10.052, ResponseDone(response=response("resp_1", tokens=(100, 0, 40))))
    return tracker


def test_a_prototype_segment_records_its_timings_and_suspends_with_its_calls() -> None:
    tracker = suspended_prototype()
    assert tracker.state is RolloutState.SUSPENDED
    assert list(tracker.pending_calls) == ["call_a", "call_b"]
    segment = tracker.segments[0]
    assert segment.time_to_first_event == pytest.approx(0.002)
    assert segment.time_to_end == pytest.approx(0.052)
    assert segment.tokens_per_s == pytest.approx(40 / 0.050)
    assert segment.client_time is None
    assert (segment.input_tokens, segment.cached_tokens, segment.output_tokens) == (100, 0, 40)


def test_resume_counts_only_this_segments_tokens_and_the_clients_time() -> None:
    tracker = suspended_prototype()
    assert not tracker.answered(tracker.outputs({"call_a": "x"}))
    tracker.sent_partial(size=70)
    assert tracker.state is RolloutState.SUSPENDED
    assert tracker.answered(tracker.outputs({"call_b": "y"}))
    tracker.sent(at=10.552, size=80)
    end = response("resp_1", status="completed", tokens=(230, 140, 55))
    feed(tracker, 10.560, ResponseCompleted(response=end))
    segment = tracker.segments[1]
    assert segment.request == "resume"
    assert segment.sent_bytes == 150  # the partial append counts with the one that resumed
    assert segment.client_time == pytest.approx(0.5)
    assert (segment.input_tokens, segment.cached_tokens, segment.output_tokens) == (130, 140, 15)
    assert tracker.state is RolloutState.COMPLETED


def test_outputs_for_calls_not_pending_are_refused() -> None:
    tracker = suspended_prototype()
    with pytest.raises(OutputsRefused, match="call_zz"):
        tracker.outputs({"call_zz": "x"})
    with pytest.raises(OutputsRefused, match="call_a"):
        tracker.outputs(
            [
                FunctionCallOutput(call_id="call_a", output="1"),
                FunctionCallOutput(call_id="call_a", output="2"),
            ]
        )
    assert list(tracker.pending_calls) == ["call_a", "call_b"]


def test_a_refused_resume_puts_the_rollout_back_where_it_was() -> None:
    tracker = suspended_prototype()
    tracker.answered(tracker.outputs({"call_a": "x", "call_b": "y"}))
    tracker.sent(at=11.0, size=80)
    refused = ErrorDetail(type="invalid_request_error", code="unknown_call_id", message="no")
    feed(tracker, 11.001, ErrorEvent(status=400, error=refused))
    assert tracker.state is RolloutState.SUSPENDED
    assert list(tracker.pending_calls) == ["call_a", "call_b"]
    assert tracker.error == refused


def test_a_refused_create_fails_the_rollout() -> None:
    tracker = RolloutTracker("launched")
    tracker.sent(at=0.0, size=10)
    refused = ErrorDetail(
        type="invalid_request_error", code="previous_response_not_found", message="?"
    )
    feed(tracker, 0.001, ErrorEvent(status=400, error=refused))
    assert tracker.state is RolloutState.FAILED


def test_a_launched_turn_that_ends_in_calls_suspends_the_rollout_and_counts_from_zero() -> None:
    tracker = RolloutTracker("launched")
    tracker.sent(at=0.0, size=10)
    feed(tracker, 0.01, OutputItemDone(output_index=0, item=call("call_a")))
    turn = response("resp_1", status="completed", tokens=(100, 0, 20))
    feed(tracker, 0.02, ResponseCompleted(response=turn))
    assert tracker.state is RolloutState.SUSPENDED
    tracker.answered(tracker.outputs({"call_a": "x"}))
    tracker.sent(at=0.5, size=10)
    second = response("resp_2", status="completed", tokens=(130, 120, 9))
    feed(tracker, 0.51, ResponseCompleted(response=second))
    assert tracker.state is RolloutState.COMPLETED
    assert tracker.response_ids == ["resp_1", "resp_2"]
    assert tracker.segments[1].reprocessed_tokens == 10
    assert tracker.segments[1].output_tokens == 9


def test_time_split_separates_client_modelled_gpu_and_the_rest() -> None:
    tracker = suspended_prototype()
    timing = TimingModel(prefill_tokens_per_s=10_000, decode_tokens_per_s=1_000)
    (split,) = time_split(tracker.segments, timing)
    assert split.gpu == pytest.approx(100 / 10_000 + 40 / 1_000)
    assert split.server == pytest.approx(0.052 - split.gpu)
    (measured,) = time_split(tracker.segments, None)
    assert measured.gpu is None
    assert measured.server == pytest.approx(0.052)
