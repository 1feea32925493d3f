"""What a segment waits for before it goes to the engine: admission by the engine's KV cache
(admission.py), then a pause for a weight update (pausing.py).

The sampling loop asks `Gates.passed` before each segment; either wait sends the Response's
announcement first (the client sees it in progress), is cut short by a cancel or an expiry
(`cut`, through the one scope both share) and is bounded by its own timeout, which ends the
Response `incomplete`. A segment that passed both is counted by the pause until `ended`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from proto_server.core.response import ResponseMachine
from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.rollouts.admission import ADMISSION_TIMEOUT, Admission, AdmissionTimeout
from proto_server.server.rollouts.pausing import PAUSE_TIMEOUT, PauseGate, PauseTimeout
from proto_server.server.rollouts.rollout import Rollout
from proto_server.wire.events import ServerEvent

Emit = Callable[[list[ServerEvent]], Awaitable[None]]


class Gates:
    """One Response's way past admission and a pause, segment after segment."""

    def __init__(
        self,
        machine: ResponseMachine,
        rollout: Rollout,
        emit: Emit,
        *,
        admission: Admission | None,
        pause: PauseGate | None,
        engine_priority: bool,
    ) -> None:
        self._machine = machine
        self._rollout = rollout
        self._emit = emit
        self.admission = admission
        self._pause = pause
        self._engine_priority = engine_priority
        #: The next segment's engine priority, when the engine takes one.
        self.priority: int | None = None
        self._scope: trio.CancelScope | None = None

    @property
    def waiting(self) -> bool:
        """Whether the Response waits at either gate now (its status then is `queued`)."""
        return self._scope is not None

    @property
    def weight_version(self) -> str | None:
        """The label of the weights a segment beginning now samples with."""
        return self._pause.weight_version if self._pause is not None else None

    def cut(self) -> None:
        """The Response is ending: stop waiting (a steer waits with its Response)."""
        if self._scope is not None and self._machine.ending:
            self._scope.cancel()

    async def passed(self, announce: list[ServerEvent]) -> list[ServerEvent] | None:
        """Once the segment may go to the engine, what of `announce` is still to send (all of
        it when neither gate made it wait). None: the Response is ending instead."""
        waited = await self._admitted(announce)
        if waited is None:
            return None
        unpaused = await self.unpaused(waited)
        if unpaused is None:
            self.suspended()  # admitted as it ended: its place may lapse
        return unpaused

    def ended(self) -> None:
        """A segment that passed has ended (or was cut)."""
        if self._pause is not None:
            self._pause.ended()

    def suspended(self) -> None:
        """The segment is over: the rollout's place in admission is kept for its TTL."""
        if self.admission is not None:
            self.admission.suspended(self._rollout)

    async def _admitted(self, announce: list[ServerEvent]) -> list[ServerEvent] | None:
        """At once when admission is off, the rollout is admitted already or there is room;
        else after `announce` is sent and a wait that `--admission-timeout` bounds (a steer
        waits with it, applied as the segment starts)."""
        rollout, machine = self._rollout, self._machine
        admission = self.admission
        if admission is None:
            resident = rollout.segments > 0
        else:
            answer = admission.request(rollout, rollout.owner, rollout.conversation.token_count)
            resident = answer.resident
            if not answer.admitted:
                await self._emit(announce)
                announce = []
                try:
                    with trio.CancelScope() as self._scope:
                        await admission.wait(rollout)
                except AdmissionTimeout as exc:
                    log.info(
                        "response.admission_timeout",
                        extra={"response": machine.id, "reason": str(exc)},
                    )
                    metrics.EVICTIONS.labels(ADMISSION_TIMEOUT).inc()
                    machine.request_expire(ADMISSION_TIMEOUT)
                finally:
                    self._scope = None
                if machine.ending:  # cancelled, expired or timed out while it waited
                    admission.suspended(rollout)  # admitted as it ended: its place may lapse
                    return None
        if self._engine_priority:
            self.priority = 0 if resident else 1
        return announce

    async def unpaused(self, announce: list[ServerEvent]) -> list[ServerEvent] | None:
        """The pause's gate alone (a warm-up's prefill is not admitted, but is held): at once
        when nothing is paused; else after `announce` is sent and a wait until the resume that
        `--pause-timeout` bounds."""
        pause, machine = self._pause, self._machine
        if pause is None or pause.try_start():
            return announce
        await self._emit(announce)
        log.info("response.paused", extra={"response": machine.id})
        started = False
        try:
            with trio.CancelScope() as self._scope:
                await pause.wait()
                started = True
        except PauseTimeout as exc:
            log.info("response.pause_timeout", extra={"response": machine.id, "reason": str(exc)})
            metrics.EVICTIONS.labels(PAUSE_TIMEOUT).inc()
            machine.request_expire(PAUSE_TIMEOUT)
        finally:
            self._scope = None
        if machine.ending:  # cancelled, expired or timed out while it was held
            if started:
                pause.ended()
            return None
        return []
