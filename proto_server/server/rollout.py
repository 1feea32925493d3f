"""The open Response's nursery: a generator task (the GPU) and the sampling loop.

The sampling loop turns the generator's chunks into state-machine calls and sends the events they
return to the client channel. On a tool call it suspends by awaiting an event that
`response.append` sets, with the generator session (the model's warm state) kept open. Only the
sampling loop sends this Response's events, so their order is the machine's order.

Whose fault: a generator or script failure ends the Response with `response.failed` here, and
the connection lives on; a client's mistake never reaches this far (see `check_append`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from proto_server.core.response import IllegalTransition, ResponseMachine, Status
from proto_server.engine.base import GeneratorSession
from proto_server.engine.chunks import (
    Chunk,
    Prefilled,
    SegmentEnd,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.script import ScriptError
from proto_server.server.logs import log
from proto_server.wire.errors import ProtocolError, ServerFault
from proto_server.wire.events import ServerEvent
from proto_server.wire.items import Item


class Rollout:
    def __init__(
        self,
        machine: ResponseMachine,
        session: GeneratorSession,
        events: trio.MemorySendChannel[ServerEvent],
        *,
        chunk_queue: int,
        on_exit: Callable[[Rollout], None],
    ) -> None:
        self.machine = machine
        self.session = session
        self._events = events
        self._chunk_queue = chunk_queue
        self._on_exit = on_exit
        self._wake = trio.Event()
        self._resume_events: list[ServerEvent] = []
        self._generator_scope: trio.CancelScope | None = None
        self._fault: ServerFault | None = None
        self._cancel_requested = False

    # -- called by the connection's reader (synchronously validated, then handed over) --------

    def append(self, items: Sequence[Item]) -> None:
        """Record tool outputs; if that answers every call, wake the sampling loop."""
        self._resume_events = self.machine.append(items)
        if self.machine.status is Status.IN_PROGRESS:
            self._wake.set()

    def cancel(self) -> None:
        if self.machine.status.terminal or self._cancel_requested:
            raise ProtocolError(
                "no_open_response",
                f"Response {self.machine.id} is already ending; nothing to cancel.",
            )
        self._cancel_requested = True
        if self._generator_scope is not None:
            self._generator_scope.cancel()
        self._wake.set()

    # -- the sampling loop -------------------------------------------------------------------------

    async def run(self) -> None:
        machine = self.machine
        try:
            await self._emit(machine.start())
            while not machine.status.terminal:
                if machine.status is Status.SUSPENDED:
                    log.debug("rollout.suspended", extra={"response": machine.id})
                    self._wake = trio.Event()
                    await self._wake.wait()
                    resumed, self._resume_events = self._resume_events, []
                    await self._emit(resumed)
                else:
                    await self._run_segment()
                if self._cancel_requested and not machine.status.terminal:
                    await self._emit(machine.cancel())
            log.debug(
                "rollout.ended", extra={"response": machine.id, "status": machine.status.value}
            )
        finally:
            with trio.CancelScope(shield=True):
                await self.session.aclose()
            self._on_exit(self)

    async def _run_segment(self) -> None:
        send, receive = trio.open_memory_channel[Chunk](self._chunk_queue)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._generate, send)
            async with receive:
                async for chunk in receive:
                    try:
                        events = self._apply(chunk)
                    except IllegalTransition as exc:
                        self._fault = ServerFault("generator_error", f"generator misbehaved: {exc}")
                        break
                    await self._emit(events)
                    if self.machine.status is not Status.IN_PROGRESS:
                        break
        if self.machine.status is not Status.IN_PROGRESS or self._cancel_requested:
            return
        fault = self._fault or ServerFault(
            "generator_error", "the token generator stopped in the middle of a segment"
        )
        self._fault = None
        log.warning("rollout.failed", extra={"response": self.machine.id, "reason": str(fault)})
        await self._emit(self.machine.fail(fault.detail))

    async def _generate(self, send: trio.MemorySendChannel[Chunk]) -> None:
        """The GPU: runs one segment of the session into the chunk channel."""
        async with send:
            with trio.CancelScope() as self._generator_scope:
                try:
                    await self.session.generate(send)
                except trio.BrokenResourceError:
                    pass  # the sampling loop stopped listening; it knows why
                except ScriptError as exc:
                    self._fault = ServerFault("script_error", str(exc))
                except Exception as exc:
                    log.exception("generator.crashed", extra={"response": self.machine.id})
                    self._fault = ServerFault(
                        "generator_error", f"the token generator failed: {exc!r}"
                    )
            self._generator_scope = None

    def _apply(self, chunk: Chunk) -> list[ServerEvent]:
        machine = self.machine
        match chunk:
            case Prefilled(prompt_tokens=prompt, cached_tokens=cached):
                machine.begin_segment(prompt_tokens=prompt, cached_tokens=cached)
                return []
            case TextDelta(text=text, tokens=tokens):
                return machine.text_delta(text, tokens=tokens)
            case ToolCallBegin(name=name, tokens=tokens):
                return machine.begin_function_call(name, tokens=tokens)
            case ToolCallArgumentsDelta(delta=delta, tokens=tokens):
                return machine.function_call_arguments_delta(delta, tokens=tokens)
            case ToolCallEnd():
                return machine.end_function_call()
            case SegmentEnd():
                return machine.end_segment()
        raise IllegalTransition(f"unknown chunk {chunk!r}")

    async def _emit(self, events: list[ServerEvent]) -> None:
        for event in events:
            await self._events.send(event)
