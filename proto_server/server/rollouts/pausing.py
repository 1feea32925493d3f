"""The trio side of a pause for a weight update (`core/pause.py` decides; this waits).

Every segment passes the gate before it goes to the engine (`try_start`, synchronous; only a
paused gate makes it `wait`), and tells it when it ends (`ended`). A pause (`pause`) holds new
segments at once and returns once everything is held: with `wait`, once the running segments
have ended; with `keep`, once the engine has frozen them (`PausableGenerator.pause_engine`:
vLLM's `/pause?mode=keep` on every replica). Once held the engine is paused too, so a trainer
may load weights into it. `resume` resumes the engine, then lets the held segments go, each
carrying the weight version set from then on.

A segment held longer than `--pause-timeout` ends its Response `incomplete` (reason
`pause_timeout`), as one that waits too long for admission does: a forgotten pause does not
hold a client for ever, and never silently.
"""

from __future__ import annotations

import contextlib

import trio

from proto_server.core.pause import Pause, PauseMode, PauseRefused, PauseStatus
from proto_server.engine.base import PausableGenerator, TokenGenerator
from proto_server.engine.limits import GeneratorError
from proto_server.server.process.logs import log

#: `incomplete_details.reason` of a Response whose segment was held past `--pause-timeout`.
PAUSE_TIMEOUT = "pause_timeout"


class PauseTimeout(Exception):
    """A segment was held by a pause longer than `--pause-timeout`."""


class PauseGate:
    def __init__(self, generator: TokenGenerator, *, timeout_s: float) -> None:
        self.state = Pause()
        self.timeout_s = timeout_s
        self._engine = generator if isinstance(generator, PausableGenerator) else None
        self._engine_paused = False
        self._engine_lock = trio.Lock()  # a pause and a resume reach the engine in turn
        self._resumed = trio.Event()
        self._resumed.set()
        #: Set when the pause is held, or resumed before it was.
        self._settled = trio.Event()

    @property
    def weight_version(self) -> str | None:
        return self.state.weight_version

    # -- what each segment does ------------------------------------------------------------------

    def try_start(self) -> bool:
        """Whether a segment may go to the engine now (then it is counted until `ended`)."""
        return self.state.start()

    async def wait(self) -> None:
        """Until the pause is resumed and the segment is counted as running; raises
        `PauseTimeout` past `timeout_s`. Cancellable (a cancel, an expiry)."""
        state = self.state
        deadline = trio.current_time() + self.timeout_s
        state.waiting += 1
        try:
            while not state.start():
                if trio.current_time() >= deadline:
                    raise PauseTimeout(
                        f"held {self.timeout_s:g} s by a pause for a weight update "
                        "(--pause-timeout)"
                    )
                with trio.move_on_at(deadline):
                    await self._resumed.wait()
        finally:
            state.waiting -= 1

    def ended(self) -> None:
        """A running segment ended (or was cut)."""
        if self.state.end():
            self._settled.set()

    # -- what the admin routes do ----------------------------------------------------------------

    def can_keep(self) -> bool:
        """Whether the generator can freeze running segments (`keep`)."""
        return self._engine is not None

    async def pause(self, mode: PauseMode) -> PauseStatus:
        """Hold new segments; return once everything is held (or a resume came first). An
        engine that refuses undoes the pause (`GeneratorError` is raised)."""
        state = self.state
        if mode is PauseMode.KEEP and self._engine is None:
            raise PauseRefused(
                "mode=keep needs a generator that can freeze its running segments (the "
                "simulated GPU, vllm); use mode=wait"
            )
        was_paused = state.paused
        state.pause(mode)  # PauseRefused: changes nothing
        if not was_paused:
            self._resumed = trio.Event()
            self._settled = trio.Event()
            log.info("pause.begun", extra={"mode": str(mode), "running": state.running})
        if not state.held:
            await self._settled.wait()
        if not state.paused:  # resumed before it was held
            return state.status()
        try:
            async with self._engine_lock:
                if self._engine is not None and not self._engine_paused and state.paused:
                    await self._engine.pause_engine(str(mode))
                    self._engine_paused = True
        except GeneratorError as exc:
            log.warning("pause.engine_refused", extra={"reason": str(exc)})
            if self._engine is not None:  # replicas that did pause go on
                with contextlib.suppress(GeneratorError):
                    await self._engine.resume_engine()
            await self.resume()
            raise
        log.info("pause.held", extra={"mode": str(mode)})
        return state.status()

    async def resume(self, weight_version: str | None = None) -> PauseStatus:
        """Resume the engine, then let the held segments go (`weight_version`, if given, is
        carried by every segment that begins from now on)."""
        async with self._engine_lock:
            if self._engine is not None and self._engine_paused:
                await self._engine.resume_engine()  # GeneratorError: still paused, say so
                self._engine_paused = False
        state = self.state
        if state.paused:
            log.info("pause.resumed", extra={"waiting": state.waiting})
        state.resume(weight_version)
        self._resumed.set()
        self._settled.set()
        return state.status()
