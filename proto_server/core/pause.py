"""A pause for a weight update, as data: whether new segments are held, how the running ones
are treated, how many run, and the weight version every later segment carries.

Pure and synchronous, as the rest of `core`: the trio side (server/rollouts/pausing.py) waits
on what this says, and the admin routes (server/dialects/admin.py) change it.

    running --pause(wait)--> draining --last segment ends--> held --resume--> running
    running --pause(keep)--> held (the engine freezes what runs) --resume--> running
"""

from __future__ import annotations

import enum

import attrs


class PauseMode(enum.StrEnum):
    """What a pause does to the segments running when it begins (vLLM's `/pause` modes)."""

    #: They run to their end; the pause is held once none runs.
    WAIT = "wait"
    #: The engine freezes them where they are; they go on after the resume.
    KEEP = "keep"


class PauseRefused(Exception):
    """A pause or resume that cannot be done now; the message says why."""


@attrs.frozen(kw_only=True)
class PauseStatus:
    """What `GET /admin/paused` answers."""

    is_paused: bool
    #: Everything is held: no segment runs (`wait`), or what runs is frozen (`keep`).
    held: bool
    mode: str | None
    #: Segments that passed the gate and have not ended (frozen ones included).
    running: int
    #: Segments waiting at the gate for the resume.
    waiting: int
    weight_version: str | None


class Pause:
    """The gate every segment passes before it goes to the engine."""

    def __init__(self, weight_version: str | None = None) -> None:
        self.mode: PauseMode | None = None
        self.running = 0
        self.waiting = 0
        self.weight_version = weight_version

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def held(self) -> bool:
        """Nothing will reach the engine until the resume."""
        return self.mode is PauseMode.KEEP or (self.mode is PauseMode.WAIT and not self.running)

    def pause(self, mode: PauseMode) -> None:
        """Hold new segments from now on. Again with the same mode: nothing changes; with
        another: refused (what `keep` froze cannot be waited for)."""
        if self.mode is not None and self.mode is not mode:
            raise PauseRefused(
                f"already paused with mode={self.mode}; resume first to pause with mode={mode}"
            )
        self.mode = mode

    def resume(self, weight_version: str | None = None) -> None:
        """Let segments go again; `weight_version`, if given, is carried by every segment
        that begins from now on. Resuming what is not paused only sets the version."""
        self.mode = None
        if weight_version is not None:
            self.weight_version = weight_version

    def start(self) -> bool:
        """A segment asks to begin: True (it is running, counted) unless paused."""
        if self.paused:
            return False
        self.running += 1
        return True

    def end(self) -> bool:
        """A running segment ended; True if that made a `wait` pause held."""
        self.running -= 1
        return self.mode is PauseMode.WAIT and not self.running

    def status(self) -> PauseStatus:
        return PauseStatus(
            is_paused=self.paused,
            held=self.held,
            mode=None if self.mode is None else str(self.mode),
            running=self.running,
            waiting=self.waiting,
            weight_version=self.weight_version,
        )
