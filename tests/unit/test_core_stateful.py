"""The Response state machine under any sequence of generator chunks and client frames.

A hypothesis `RuleBasedStateMachine` plays both sides of a connection, synchronously: the
generator (text, tool calls, parallel calls, stops, faults, illegal chunks) and the client
(create, valid, partial, unknown, duplicate and late appends, cancel, disconnect; injects of the
multi-agent beta, while the segment streams or once it suspended, to a live, ended or unknown
Response; steers, to the open, an ended or an unknown Response, applied at a safe point).
Client frames
go through the real decoder and the machine's own checks, as the dialect does; every event the
machine returns is numbered as the writer would and fed to `StreamChecker`, so invariants 1-7
are checked after every step, and the machine's own bookkeeping after every rule.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from proto_server.core.conversation import Conversation
from proto_server.core.render import O200kRenderer
from proto_server.core.request import input_items, response_template
from proto_server.core.response import (
    IllegalTransition,
    ResponseMachine,
    Status,
    Steer,
    steer_failed,
)
from proto_server.core.sequence import Sequencer
from proto_server.testing import StreamChecker
from proto_server.testing.schema import wire_schema
from proto_server.wire.converter import decode_client_event, steer_items
from proto_server.wire.errors import ErrorDetail, ProtocolError, SteerRefused
from proto_server.wire.events import (
    ErrorEvent,
    InjectError,
    ResponseAppend,
    ResponseCancel,
    ResponseCancelled,
    ResponseCompleted,
    ResponseCreate,
    ResponseDone,
    ResponseIncomplete,
    ResponseInject,
    ResponseInjectCreated,
    ResponseInjectFailed,
    ResponseSteer,
    ResponseSteerPending,
    ServerEvent,
)
from proto_server.wire.items import FunctionCall

RENDERER = O200kRenderer()
#: The ends a broken store turns into `response.failed` (`SamplingLoop._stored`).
UNSTORABLE = (ResponseCompleted, ResponseIncomplete, ResponseCancelled)
TOOL = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
texts = st.text(min_size=1, max_size=12)
names = st.sampled_from(["exec_command", "read_file", "apply_patch"])


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


class Connection(RuleBasedStateMachine):
    """One connection: the dialect's dispatch, the rollout's loop, the writer's numbering."""

    @initialize()
    def connect(self) -> None:
        # the chunks below count 1 token a char; every event is held to the published schema
        self.checker = StreamChecker(count_tokens=len, schema=wire_schema())
        self.sequencer = Sequencer()
        self.machine: ResponseMachine | None = None
        self.segment_begun = False
        self.warm = False
        self.steers = 0
        #: The store refuses the Response's end / has its suspension fenced off by a resumer.
        self.store_broken = self.fenced = False

    # -- the two sides' plumbing ---------------------------------------------------------------

    def emit(self, events: list[ServerEvent]) -> None:
        """Number and check each event, after the sampling loop's store step (`_emit`): an
        end the store cannot take fails instead, a fenced suspension fails, and whatever
        either returns (every queued steer back) is sent in its place."""
        failed = False
        for event in events:
            if failed and isinstance(event, ResponseSteerPending):
                continue
            durable: list[ServerEvent] = [event]
            error = ErrorDetail(type="server_error", code="store_unavailable", message="gone")
            if isinstance(event, ResponseDone) and self.fenced:
                durable = self.m.fail(error)
            elif self.store_broken and isinstance(event, UNSTORABLE):
                durable = self.m.fail_unstored(error)  # a failed one keeps its own error
            failed = failed or durable[0] is not event
            for sent in durable:
                self.checker.received_typed(sent, self.sequencer.next())

    def send(self, frame: dict[str, Any]) -> None:
        """A client frame, handled as the prototype dialect does; a refusal changes nothing."""
        self.checker.sent(frame)
        before = self.state()
        try:
            event = decode_client_event(orjson.dumps(frame))
            self.handle(event)
        except ProtocolError as exc:
            assert self.state() == before, "a refused frame changed the machine"
            self.emit([ErrorEvent(status=exc.status, error=exc.detail)])

    def handle(self, event: Any) -> None:
        m = self.machine
        if isinstance(event, ResponseCreate):
            if m is not None and not m.status.terminal:
                raise ProtocolError("concurrent_request", "a Response is open")
            conversation = Conversation(RENDERER, tools=event.tools)
            conversation.extend(input_items(event))
            template = response_template(
                event, response_id=f"resp_{self.sequencer.sent}", created_at=0, default_model="m"
            )
            self.machine = ResponseMachine(response=template, conversation=conversation)
            self.segment_begun = self.warm = False
            self.emit(self.machine.start())
            return
        if isinstance(event, ResponseInject):
            self.inject(event)
            return
        if isinstance(event, ResponseSteer):
            self.steer(event)
            return
        if m is None or m.status.terminal:
            raise ProtocolError("no_open_response", "nothing is open")
        if isinstance(event, ResponseCancel):
            self.emit(m.cancel())
        elif isinstance(event, ResponseAppend):
            self.emit(m.append(event.input))
            if m.status is Status.IN_PROGRESS:
                self.segment_begun = False

    def inject(self, event: ResponseInject) -> None:
        """As `serve_inject` does: the named Response commits the outputs, or it is refused
        whole with the input handed back."""
        m = self.machine
        if m is None or m.id != event.response_id or m.status.terminal:
            ended = m is not None and m.id == event.response_id
            code = "response_already_completed" if ended else "response_not_found"
            error = InjectError(code=code, message="no")
            failed = ResponseInjectFailed(
                response_id=event.response_id, error=error, input=event.raw_input
            )
            self.emit([failed])
            return
        m.check_inject(event.input)
        resumed = m.inject(event.input)
        self.emit([ResponseInjectCreated(response_id=m.id), *resumed])
        if m.status is Status.IN_PROGRESS and resumed:
            self.segment_begun = False

    def steer(self, event: ResponseSteer) -> None:
        """As `serve_steer` does: queued on the named Response, or returned with its input."""
        m = self.machine
        rid = event.previous_response_id
        try:
            items = steer_items(event.input)
            if m is None or m.id != rid:
                raise SteerRefused("response_not_found", "no")
            self.steers += 1
            steer = Steer(
                id=f"steer_{self.steers}",
                previous_response_id=rid,
                items=items,
                raw_input=event.input,
            )
            self.emit(m.steer(steer))
        except SteerRefused as exc:
            self.emit([steer_failed(exc.code, exc.message, event.input, rid)])

    def state(self) -> tuple[Any, ...]:
        m = self.machine
        if m is None:
            return ()
        return (
            m.status,
            dict(m.pending_calls),
            set(m.answered_calls),
            len(m.output),
            m.usage(),
            m.conversation.token_count,
            len(m.conversation.items),
            set(m._held_ids),
        )

    def streaming(self) -> bool:
        return self.machine is not None and self.machine.status is Status.IN_PROGRESS

    def suspended(self) -> bool:
        return self.machine is not None and self.machine.status is Status.SUSPENDED

    def call_open(self) -> bool:
        return self.streaming() and self.machine._open is not None and hasattr(
            self.machine._open, "call_id"
        )  # fmt: skip

    @property
    def m(self) -> ResponseMachine:
        assert self.machine is not None
        return self.machine

    def prefill(self) -> None:
        """A segment starts with the prompt in the model's state, as the simulated GPU reports."""
        if not self.segment_begun:
            conversation = self.m.conversation
            cached = conversation.model_output_end if self.warm else 0
            self.m.begin_segment(prompt_tokens=conversation.token_count, cached_tokens=cached)
            self.segment_begun = self.warm = True

    def end_of_segment(self) -> None:
        """Outputs injected while the segment streamed resume the Response now, as the sampling
        loop releases them before it would wait."""
        if self.m.status is not Status.IN_PROGRESS or not self.m.segment_open:
            # outputs released now resume in a segment of its own, as does a Response that
            # took a steer in place as its segment ended (the sampling loop asks `segment_open`)
            self.segment_begun = False
        if self.m.status is Status.SUSPENDED and self.m.holds_injected:
            self.emit(self.m.release_held())

    # -- the client ----------------------------------------------------------------------------

    @rule(text=texts, tools=st.booleans())
    def create(self, text: str, tools: bool) -> None:
        self.send(
            {"type": "response.create", "input": [user(text)], "tools": [TOOL] if tools else []}
        )

    @precondition(lambda self: self.suspended())
    @rule(message=st.none() | texts)
    def append_all(self, message: str | None) -> None:
        items = [output(call_id) for call_id in self.m.pending_calls]
        self.send(
            {"type": "response.append", "input": items + ([user(message)] if message else [])}
        )

    @precondition(lambda self: self.suspended() and len(self.m.pending_calls) > 1)
    @rule(data=st.data())
    def append_some(self, data: st.DataObject) -> None:
        pending = list(self.m.pending_calls)
        some = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True))
        if len(some) == len(pending):
            some.pop()
        self.send({"type": "response.append", "input": [output(c) for c in some]})

    @rule(call_id=st.from_regex(r"call_[a-z0-9]{1,8}", fullmatch=True))
    def append_unknown(self, call_id: str) -> None:
        self.send({"type": "response.append", "input": [output(call_id)]})

    @precondition(lambda self: self.machine is not None and self.machine.answered_calls)
    @rule(data=st.data())
    def append_answered_again(self, data: st.DataObject) -> None:
        call_id = data.draw(st.sampled_from(sorted(self.m.answered_calls)))
        self.send({"type": "response.append", "input": [output(call_id)]})

    @precondition(lambda self: self.suspended())
    @rule()
    def append_twice_in_one_frame(self) -> None:
        call_id = next(iter(self.m.pending_calls))
        self.send({"type": "response.append", "input": [output(call_id), output(call_id)]})

    @precondition(lambda self: self.suspended())
    @rule(text=texts)
    def append_message_before_the_outputs(self, text: str) -> None:
        self.send({"type": "response.append", "input": [user(text)]})

    @rule(
        item=st.sampled_from(
            [
                {"type": "function_call", "call_id": "c", "name": "n", "arguments": "{}"},
                {"type": "message", "role": "assistant", "content": "replayed"},
                {"type": "reasoning", "summary": []},
            ]
        )
        | st.none()
    )
    def append_what_append_does_not_take(self, item: dict[str, Any] | None) -> None:
        self.send({"type": "response.append", "input": [item] if item else []})

    @precondition(lambda self: self.machine is not None and self.machine.pending_calls)
    @rule(data=st.data())
    def inject_outputs(self, data: st.DataObject) -> None:
        """Outputs for calls made, while the segment streams (held) or once it suspended."""
        waiting = sorted(self.m.pending_calls.keys() - self.m._held_ids) or ["call_none"]
        some = data.draw(st.lists(st.sampled_from(waiting), min_size=1, unique=True))
        frame = {"type": "response.inject", "response_id": self.m.id}
        self.send({**frame, "input": [output(c) for c in some]})

    @rule(response_id=st.sampled_from(["resp_nowhere", "current"]), text=texts)
    def inject_what_inject_does_not_take(self, response_id: str, text: str) -> None:
        """A message, or outputs for a Response that is not there (or ended)."""
        rid = (
            self.machine.id
            if self.machine is not None and response_id == "current"
            else response_id
        )
        items = [user(text)] if rid != "resp_nowhere" else [output("call_x")]
        self.send({"type": "response.inject", "response_id": rid, "input": items})

    @rule(
        named=st.sampled_from(["current", "resp_nowhere"]),
        text=texts | st.just([]) | st.just([{"type": "function_call_output", "call_id": "c"}]),
    )
    def steer_it(self, named: str, text: Any) -> None:
        rid = self.machine.id if named == "current" and self.machine is not None else named
        self.send({"type": "response.steer", "previous_response_id": rid, "input": text})

    @precondition(lambda self: self.machine is not None and self.machine.steer_due)
    @rule()
    def safe_point(self) -> None:
        """The sampling loop between two tokens: a due steer cuts the segment, which goes on."""
        self.emit(self.m.take_steers())
        self.segment_begun = False

    @rule()
    def store_breaks(self) -> None:
        """From now on no end of a Response can be stored (it fails `store_unavailable`)."""
        self.store_broken = True

    @rule()
    def another_connection_resumes_it(self) -> None:
        """Its next suspension is found claimed elsewhere, and fails."""
        self.fenced = True

    @rule()
    def cancel(self) -> None:
        self.send({"type": "response.cancel"})

    @rule()
    def disconnect(self) -> None:
        """The peer goes away: whatever was open is dropped, and the next connection is fresh."""
        self.checker.finish(closed=True)
        self.connect()

    # -- the generator -------------------------------------------------------------------------

    @precondition(
        lambda self: self.streaming() and not self.call_open() and not self.m.pending_calls
    )
    @rule(text=texts)
    def text(self, text: str) -> None:
        self.prefill()
        self.emit(self.m.text_delta(text, tokens=len(text)))

    @precondition(
        lambda self: self.streaming() and not self.call_open() and not self.m.pending_calls
    )
    @rule(text=texts)
    def reasoning(self, text: str) -> None:
        self.prefill()
        self.emit(self.m.reasoning_delta(text, tokens=len(text)))

    @precondition(lambda self: self.streaming() and not self.call_open())
    @rule(name=names, deltas=st.lists(texts, max_size=3))
    def tool_call(self, name: str, deltas: list[str]) -> None:
        self.prefill()
        self.emit(self.m.begin_function_call(name, tokens=len(name)))
        for delta in deltas:
            self.emit(self.m.function_call_arguments_delta(delta, tokens=len(delta)))

    @precondition(lambda self: self.call_open())
    @rule(delta=texts)
    def tool_call_arguments(self, delta: str) -> None:
        self.emit(self.m.function_call_arguments_delta(delta, tokens=len(delta)))

    @precondition(lambda self: self.call_open())
    @rule()
    def tool_call_end(self) -> None:
        self.emit(self.m.end_function_call())

    @precondition(lambda self: self.streaming() and not self.call_open())
    @rule(calls=st.lists(st.tuples(names, texts), min_size=2, max_size=4))
    def parallel_tool_calls(self, calls: list[tuple[str, str]]) -> None:
        self.prefill()
        for name, arguments in calls:
            self.emit(self.m.begin_function_call(name, tokens=len(name)))
            self.emit(self.m.function_call_arguments_delta(arguments, tokens=len(arguments)))
            self.emit(self.m.end_function_call())

    @precondition(lambda self: self.streaming() and not self.call_open())
    @rule()
    def stop(self) -> None:
        self.prefill()
        self.emit(self.m.end_segment())
        self.end_of_segment()

    @precondition(lambda self: self.streaming())
    @rule(code=st.sampled_from(["generator_error", "script_error"]))
    def generator_error(self, code: str) -> None:
        self.emit(self.m.fail(ErrorDetail(type="server_error", code=code, message="boom")))
        self.end_of_segment()

    @precondition(lambda self: self.machine is not None)
    @rule(chunk=st.sampled_from(["reasoning", "text", "call", "arguments", "end_call", "stop"]))
    def generator_misbehaves(self, chunk: str) -> None:
        """A chunk that is illegal now raises and changes nothing; the rollout then fails."""
        m = self.m
        if m.status is Status.IN_PROGRESS:
            self.prefill()
        before = self.state()
        try:
            events = {
                "reasoning": lambda: m.reasoning_delta("x", tokens=1),
                "text": lambda: m.text_delta("x", tokens=1),
                "call": lambda: m.begin_function_call("f", tokens=1),
                "arguments": lambda: m.function_call_arguments_delta("x", tokens=1),
                "end_call": m.end_function_call,
                "stop": m.end_segment,
            }[chunk]()
        except IllegalTransition:
            assert self.state() == before, "an illegal chunk changed the machine"
            if not m.status.terminal:
                fault = ErrorDetail(type="server_error", code="generator_error", message="bad")
                self.emit(m.fail(fault))
            return
        self.emit(events)  # it was legal after all
        self.end_of_segment()

    @precondition(lambda self: self.suspended())
    @rule(reason=st.sampled_from(["suspend_timeout", "suspended_rollout_limit"]))
    def suspension_expires(self, reason: str) -> None:
        self.emit(self.m.make_incomplete(reason))

    # -- the machine's own books -----------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        m = self.machine
        if m is None:
            return
        assert not (m.pending_calls.keys() & m.answered_calls)
        calls = {
            item.call_id: item
            for item in m.output
            if isinstance(item, FunctionCall) and item.status == "completed"
        }
        assert m.pending_calls.keys() <= calls.keys()
        assert m.answered_calls <= calls.keys()
        if m.status is Status.SUSPENDED:
            assert m.pending_calls
        usage = m.usage()
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.input_tokens_details.cached_tokens <= usage.input_tokens

    @invariant()
    def conversation_renders_incrementally(self) -> None:
        """The incrementally extended tokens equal a fresh render of the whole conversation."""
        m = self.machine
        if m is None:
            return
        conversation = m.conversation
        fresh = list(RENDERER.render_prefix(conversation.instructions, conversation.tools))
        for item in conversation.items:
            fresh += RENDERER.render_item(item)
        assert list(conversation.tokens) == fresh

    def teardown(self) -> None:
        m = self.machine
        self.checker.finish(closed=m is not None and m.status is Status.IN_PROGRESS)


Connection.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestConnection = Connection.TestCase
