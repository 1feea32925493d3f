"""The open Response's nursery: a generator task (the GPU) and the sampling loop.

The sampling loop turns the generator's chunks into state-machine calls and sends the events they
return to the client channel. On a tool call (prototype dialect) it suspends by awaiting an event
that `response.append` sets, with the rollout's generator session, the model's warm state, kept
open. Only the sampling loop sends this Response's events, so their order is the machine's order.

Whose fault: a generator or script failure ends the Response with `response.failed` here, and
the connection lives on; so does a `store: true` Response the store cannot take
(`store_unavailable`). A client's mistake never reaches this far (see `check_append`).

What the loop does next is the core's to say (`Steps.next_step`, core/response/steps.py):
this loop only awaits what each step takes and owns the tasks. A cancel, an expiry or a due
steer cuts the generator short; the next step then says what the machine decided.

Its neighbours hold the rest: the wait while suspended (`suspension.IdleWait`), the store step
(`storing.StoreStep`) and the turn's account (`turns.TurnAccount`). The generator task and the
loop share the cancel scopes that the client's calls cut (`cancel`, `steer` and `expire` reach
`_generator_scope` and the wait before a segment, gates.py), and only this loop sends the
Response's events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, assert_never

import attrs
import trio

from proto_server.core.conversation import TOKEN_BYTES, RenderedItems
from proto_server.core.response import IllegalTransition, ResponseMachine, Status, Steer
from proto_server.core.response.steps import End, RunSegment, Send, Steps, Suspend
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    ReasoningDelta,
    Rerouted,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.limits import GenerationLimits, GeneratorError
from proto_server.server.process.logs import log
from proto_server.server.process.observe import ServerObserver
from proto_server.server.rollouts.admission import Admission
from proto_server.server.rollouts.gates import Gates
from proto_server.server.rollouts.inflight import InFlight, Running
from proto_server.server.rollouts.pausing import PauseGate
from proto_server.server.rollouts.rollout import Rollout
from proto_server.server.rollouts.storing import StoreStep
from proto_server.server.rollouts.suspension import IdleWait, Suspensions
from proto_server.server.rollouts.turns import TurnAccount, TurnRecord, TurnSource, TurnStart
from proto_server.server.transport.outbox import EventSink
from proto_server.wire.errors import ServerFault
from proto_server.wire.events import ResponseSteerPending, ServerEvent
from proto_server.wire.items import Item
from proto_server.wire.response import Response

#: `incomplete_details.reason` of a suspension whose client stayed idle too long.
SUSPEND_TIMEOUT = "suspend_timeout"


@attrs.frozen(kw_only=True)
class LoopSettings:
    """What every sampling loop of a process shares, made once (`Responses`): how many chunks
    a generator may run ahead, how long a suspension may idle, whether segments carry an
    engine priority, and the process's collaborators (each None where it has none)."""

    chunk_queue: int
    suspend_timeout_s: float = math.inf
    #: Send each segment with a priority, resumed rollouts first.
    engine_priority: bool = False
    on_end: Callable[[TurnRecord], None] | None = None
    observer: ServerObserver | None = None
    suspensions: Suspensions | None = None
    #: Who says when a segment may go to the engine (None: at once).
    admission: Admission | None = None
    #: The gate a pause for a weight update closes (None: never paused).
    pause: PauseGate | None = None
    #: Where a running Response is found by id, for a cancel or a poll (None: nowhere).
    in_flight: InFlight | None = None


class SamplingLoop:
    def __init__(
        self,
        machine: ResponseMachine,
        rollout: Rollout,
        events: EventSink,
        settings: LoopSettings,
        turn: TurnStart,
    ) -> None:
        self.machine = machine
        #: What the loop does next, decided by the core.
        self._steps = Steps(machine, announced=turn.resumed)
        self.durable = turn.durable
        self._store = StoreStep(turn.persist, turn.durable)
        self._warmup = turn.warmup
        self._turn = TurnAccount(
            arrived_at=trio.current_time() if turn.arrived_at is None else turn.arrived_at,
            source=turn.source,
            rendered_mark=turn.rendered_mark,
        )
        self.rollout = rollout
        self._events = events
        self._chunk_queue = settings.chunk_queue
        self._on_end = settings.on_end
        self._observer = settings.observer
        self._wait = IdleWait(self, settings.suspend_timeout_s, settings.suspensions)
        self._settled = trio.Event()
        #: The terminal event has been sent: only now may another Response follow on the wire.
        self.ended = False
        self._generator_scope: trio.CancelScope | None = None
        self._ended = trio.Event()
        #: Admission, then a pause: what each segment waits for before the engine.
        self._gates = Gates(
            machine,
            rollout,
            self._emit,
            admission=settings.admission,
            pause=settings.pause,
            engine_priority=settings.engine_priority,
        )
        self._in_flight = settings.in_flight

    # -- called by the connection's reader (synchronously validated, then handed over) --------

    @property
    def response_id(self) -> str:
        return self.machine.id

    def append(
        self, items: Sequence[Item], rendered: RenderedItems, *, tool_choice: Any = None
    ) -> None:
        """Record tool outputs, checked and rendered by `prepare_append`
        (server/rollouts/appending.py); if that answers every call, wake the sampling loop. What
        they add must fit the rollout's memory budget. `tool_choice`, if set, holds for the rest
        of the Response."""
        tokens = len(rendered.tokens)
        self.rollout.budget.check(rendered.nbytes + TOKEN_BYTES * tokens, "This append")
        resumed = self._steps.append(items, rendered, tool_choice=tool_choice)
        self.rollout.account(self.machine.held_bytes)
        if self._observer is not None:
            self._observer.rendered()
        if resumed:
            self._wait.wake()
        else:
            self._wait.touch()

    @property
    def ending(self) -> bool:
        """Decided to end (its terminal event may not be out yet): nothing more goes in."""
        return self.machine.ending

    def inject(self, items: Sequence[Item], rendered: RenderedItems) -> None:
        """The multi-agent beta's `response.inject`: commit tool outputs (checked by the caller
        with `machine.check_inject`, and rendered), even while the segment that called them
        streams (held until it ends). A resumption waits for `wake()`, so the caller can say the
        inject was committed before the Response's next event."""
        tokens = len(rendered.tokens)
        self.rollout.budget.check(rendered.nbytes + TOKEN_BYTES * tokens, "This inject")
        resumed = self._steps.inject(items, rendered)
        self.rollout.account(self.machine.held_bytes)
        if not resumed:
            self._wait.touch()

    def wake(self) -> None:
        """Resume the Response if an inject answered its last call."""
        if self._steps.wake():
            self._wait.wake()

    def cancel(self) -> None:
        """The client's `response.cancel` (the machine refuses one that comes too late)."""
        self.machine.request_cancel()
        self._cut()

    def snapshot(self) -> Response:
        """The Response as it stands: `queued` while it waits for admission or a pause."""
        response = self.machine.snapshot()
        waiting = self._gates.waiting and not self.machine.ending
        return attrs.evolve(response, status="queued") if waiting else response

    def steer(self, steer: Steer) -> list[ServerEvent]:
        """Queue `steer` (the machine accepts or refuses it); if that makes a safe point now,
        cut the segment, so it is applied between this token and the next. Returns the events
        that answer it, for the caller to send: they precede whatever the cut brings."""
        events = self.machine.steer(steer)
        self.rollout.account(self.machine.held_bytes)  # it waits in the machine: charged
        if self.machine.steer_due:
            self._cut()
        return events

    def _cut(self) -> None:
        """Stop the generator and wake a suspension: the machine has decided what comes next."""
        if self._generator_scope is not None:
            self._generator_scope.cancel()
        self._gates.cut()
        self._wait.wake()

    def evict(self, reason: str) -> None:
        """A memory budget lets this suspended Response go: it ends `response.incomplete`."""
        self.rollout.release_budget()
        self.expire(reason)

    def expire(self, reason: str) -> None:
        """The server ends this Response with `response.incomplete` (`reason`): at once if it
        is suspended, cutting the segment short (open items closed as incomplete) if not."""
        if self.machine.request_expire(reason):
            self._cut()

    async def wait_settled(self) -> None:
        """Return once nothing is streaming: the Response is suspended or has ended."""
        await self._settled.wait()

    async def wait_ended(self) -> None:
        """Return once the terminal event has been handed to the connection."""
        await self._ended.wait()

    # -- the sampling loop -------------------------------------------------------------------------

    async def run_and_close(self) -> None:
        """`run`, then `close`, however it ends: for a rollout that lives exactly as long as
        its one Response (the prototype dialect's, an HTTP request's)."""
        try:
            await self.run()
        finally:
            await self.close()

    async def close(self) -> None:
        """Let go of what the Response holds: its claim on a stored suspension, if it went
        away mid-segment (so it may be resumed again), and its rollout."""
        if not self.ended and self.durable is not None:
            await self.durable.release()
        await self.rollout.aclose()

    async def run(self) -> None:
        """Drive the Response to its terminal event; the rollout stays open for its owner.
        Meanwhile it is found by its id (`InFlight`)."""
        if self._in_flight is None:
            await self._run()
            return
        owner = self.rollout.owner
        running = Running(self.machine.id, owner, self.cancel, self.snapshot)
        with self._in_flight.running(running):
            await self._run()

    async def _run(self) -> None:
        if self._warmup:
            await self._run_warmup()
            return
        while True:
            step = self._steps.next_step()
            self.rollout.account(self.machine.held_bytes)  # outputs released, steers applied
            match step:
                case RunSegment(announce=announce):
                    await self._run_segment(list(announce))
                case Suspend():
                    await self._suspend()
                case Send(events=events):
                    await self._emit(list(events))
                case End(events=events, fault=fault):
                    if fault is not None:
                        why = {"response": self.machine.id, "reason": str(fault)}
                        log.warning("response.failed", extra=why)
                    await self._emit(list(events))
                    break
                case _:
                    assert_never(step)
        self._finish()

    async def _suspend(self) -> None:
        """Wait for the append that answers every call, for as long as the client stays idle."""
        machine = self.machine
        log.debug("response.suspended", extra={"response": machine.id})
        self._settled.set()
        self.rollout.budget.idle(self)
        try:
            woken = await self._wait.wait()
        finally:
            self.rollout.budget.busy(self)
        if not woken:
            log.info(
                "response.suspend_timeout",
                extra={"response": machine.id, "timeout_s": self._wait.timeout_s},
            )
            machine.request_expire(SUSPEND_TIMEOUT)
        self._settled = trio.Event()

    async def _run_warmup(self) -> None:
        """`generate: false`: build the state, say nothing, complete with empty output."""
        machine = self.machine
        await self._emit(machine.start())
        self._count_rendered()
        if await self._gates.unpaused([]) is None:  # ended while a pause held it
            await self._emit(machine.end())
            self._finish()
            return
        try:
            prefilled = await self.rollout.session.prefill()
        finally:
            self._gates.ended()
        if machine.status is Status.ENDING:  # cancelled while it prefilled
            await self._emit(machine.end())
        else:
            machine.begin_segment(
                prompt_tokens=prefilled.prompt_tokens, cached_tokens=prefilled.cached_tokens
            )
            await self._emit(machine.end_segment())
        self._finish()

    def _finish(self) -> None:
        self.ended = True
        self._ended.set()
        self._settled.set()
        record = self._turn.record(self.machine)
        if log.isEnabledFor(logging.DEBUG):  # the dict is a turn's cost: only when it is read
            log.debug("response.ended", extra=attrs.asdict(record))
        if self._on_end is not None:
            self._on_end(record)

    async def _run_segment(self, announce: list[ServerEvent]) -> None:
        """One segment: the generator starts first, so its prefill overlaps with writing the
        `announce` events (a Response snapshot with every tool; measurably slow to encode)."""
        waited = await self._gates.passed(announce)
        if waited is None:
            return
        try:
            await self._segment(waited)
        finally:
            self._gates.ended()
        self._turn.rendered_mark = self.rollout.conversation.rendered_tokens  # outputs: not input
        self.rollout.account(self.machine.held_bytes)
        self.rollout.segments += 1
        self._gates.suspended()

    async def _segment(self, announce: list[ServerEvent]) -> None:
        """The segment on the engine, from its generator's start to its last event."""
        machine = self.machine
        send, receive = trio.open_memory_channel[Chunk](self._chunk_queue)
        last: list[ServerEvent] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(self._generate, send)
            await self._emit(announce)
            async with receive:
                async for chunk in receive:
                    if machine.ending or machine.steer_due:
                        break  # chunks already generated are not streamed after an end or cut
                    events, stop = self._apply_ready(chunk, receive)
                    if stop and machine.status.terminal:
                        last = events  # out once the generator has stopped
                        break
                    await self._emit(events)
                    if stop:
                        break
                if self._generator_scope is not None:
                    self._generator_scope.cancel()  # cut: what it would still say is not said
        # The Response's terminal event goes out only now, and `run` marks it ended without
        # yielding in between: a client that answers it with a create finds it ended.
        await self._emit(last)

    async def _generate(
        self,
        send: trio.MemorySendChannel[Chunk],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The GPU: runs one segment of the session into the chunk channel."""
        started = trio.current_time()
        self._turn.generating(started)
        async with send:
            with trio.CancelScope() as self._generator_scope:
                try:
                    if self._observer is not None:
                        self._observer.generating()
                    task_status.started()
                    await self.rollout.session.generate(send, self._limits())
                except trio.BrokenResourceError:
                    pass  # the sampling loop stopped listening; it knows why
                except GeneratorError as exc:  # refused, or an engine's fault: its own code
                    self._steps.generator_failed(ServerFault(exc.code, str(exc)))
                except Exception as exc:
                    log.exception("generator.crashed", extra={"response": self.machine.id})
                    self._steps.generator_failed(
                        ServerFault("generator_error", f"the token generator failed: {exc!r}")
                    )
            self._generator_scope = None
        self._turn.decode_s += trio.current_time() - started

    def _limits(self) -> GenerationLimits:
        """What the client's limits leave to the next segment of this Response."""
        machine = self.machine
        limits = GenerationLimits.for_response(
            machine.template,
            output_tokens=machine.output_tokens,
            tool_calls=machine.tool_calls,
            logprobs=machine.logprobs,
            token_ids=machine.token_ids,
        )
        priority = self._gates.priority
        return limits if priority is None else attrs.evolve(limits, priority=priority)

    def _count_rendered(self) -> int:
        """Add the tokens rendered since the last segment to this Response's count; return them."""
        return self._turn.count_rendered(self.rollout.conversation.rendered_tokens)

    def _apply_ready(
        self, chunk: Chunk, receive: trio.MemoryReceiveChannel[Chunk]
    ) -> tuple[list[ServerEvent], bool]:
        """`chunk` and every chunk already waiting behind it, applied in one go (one scheduling
        round for a burst, not one a chunk): their events, and whether the segment stops here
        (the machine closed it, or the generator misbehaved). Nothing else runs meanwhile, so
        no cancel or expiry can come between two of them."""
        events: list[ServerEvent] = []
        while True:
            try:
                events += self._apply(chunk)
            except IllegalTransition as exc:
                fault = ServerFault("generator_error", f"generator misbehaved: {exc}")
                self._steps.generator_failed(fault)
                return events, True
            if self._steps.segment_closed():
                return events, True  # suspended or ended, or resumed in place
            try:
                chunk = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):  # the end is seen by `async for`
                return events, False

    def _apply(self, chunk: Chunk) -> list[ServerEvent]:
        machine = self.machine
        if isinstance(chunk, SegmentEnd) and chunk.cached_tokens is not None:
            machine.report_cached(chunk.cached_tokens)
        match chunk:
            case Rerouted(engine=engine, lost=lost):
                # its warm state was lost with its engine replica
                self._turn.source = TurnSource.FAILOVER
                log.info(
                    "response.rerouted",
                    extra={"response": machine.id, "engine": engine, "lost": lost},
                )
                return []
            case Prefilled(prompt_tokens=prompt, cached_tokens=cached, prompt_ids=ids):
                rendered = self._count_rendered()
                if self._observer is not None:
                    self._observer.prefilled(rendered=rendered, prompt=prompt, cached=cached)
                machine.begin_segment(
                    prompt_tokens=prompt, cached_tokens=cached, prompt_ids=ids,
                    weight_version=self._gates.weight_version,
                )  # fmt: skip
                return []
            case ReasoningDelta(text=text, tokens=tokens, sampled=sampled):
                return machine.reasoning_delta(text, tokens=tokens, sampled=sampled)
            case TextDelta(text=text, tokens=tokens, logprobs=logprobs, sampled=sampled):
                return machine.text_delta(text, tokens=tokens, logprobs=logprobs, sampled=sampled)
            case ToolCallBegin(name=name, tokens=tokens, sampled=sampled):
                return machine.begin_function_call(name, tokens=tokens, sampled=sampled)
            case ToolCallArgumentsDelta(delta=delta, tokens=tokens, sampled=sampled):
                return machine.function_call_arguments_delta(delta, tokens=tokens, sampled=sampled)
            case ToolCallEnd():
                return machine.end_function_call()
            case SegmentEnd(tokens=tokens, incomplete=None, sampled=sampled):
                return machine.end_segment(tokens=tokens, sampled=sampled)
            case SegmentEnd(tokens=tokens, incomplete=str(reason), sampled=sampled):
                return machine.make_incomplete(reason, tokens=tokens, sampled=sampled)
        raise IllegalTransition(f"unknown chunk {chunk!r}")

    async def _emit(self, events: list[ServerEvent]) -> None:
        if events:
            self._turn.sending(trio.current_time())
        failed = False
        for event in events:
            if failed and isinstance(event, ResponseSteerPending):
                continue  # the failure that replaced the end failed every queued steer
            durable = await self._store.kept(self.machine, event)
            failed = failed or durable[0] is not event
            for sent in durable:
                try:  # a scheduling round only when the channel is full (backpressure)
                    self._events.send_nowait(sent)
                except trio.WouldBlock:
                    await self._events.send(sent)
