"""Every Response this process runs, by id, from its sampling loop's start to its end: what
`POST /v1/responses/{id}/cancel` finds whichever connection streams it (or none, a background
one), and what `GET /v1/responses/{id}` answers for a background one before it is stored.

Only the key that created a Response finds it; for another it is not there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
import trio

from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.response import Response


@attrs.frozen(eq=False)
class Running:
    """One running Response, as a cancel or a poll sees it."""

    response_id: str
    owner: str
    #: Cut it short (`response.cancelled`); a `ProtocolError` once it is ending already.
    cancel: Callable[[], None]
    #: The Response as it stands (`queued` while it waits for admission).
    snapshot: Callable[[], Response]
    #: Set once its loop returned: ended, or cut with its connection.
    gone: trio.Event = attrs.field(factory=trio.Event)


class InFlight:
    """The running Responses of this process, by id."""

    def __init__(self) -> None:
        self._running: dict[str, Running] = {}

    @contextmanager
    def running(self, running: Running) -> Iterator[None]:
        """`running` is found while this lasts."""
        self._running[running.response_id] = running
        try:
            yield
        finally:
            if self._running.get(running.response_id) is running:
                del self._running[running.response_id]
            running.gone.set()

    def find(self, response_id: str, owner: str) -> Running | None:
        """`owner`'s running Response `response_id`; another key's is not found."""
        running = self._running.get(response_id)
        return running if running is not None and running.owner == owner else None


async def cancelled(running: Running) -> Response:
    """Cancel `running` (one ending already says its own end) and return it once ended."""
    with contextlib.suppress(ProtocolError):  # ending already: it says its own end
        running.cancel()
    await running.gone.wait()
    return running.snapshot()


def check_cancellable(response: Response) -> None:
    """A Response that ended can be "cancelled" again, as OpenAI's are, only if it ran in the
    background: the answer is the Response as it ended. A foreground one is refused."""
    if not response.background:
        raise ProtocolError(
            "response_not_cancellable",
            f"Response {quoted(response.id)} ended ({response.status}); only one created "
            "with `background: true` can be cancelled once it ended (the answer is the "
            "Response as it ended). One in flight is cancelled whatever created it.",
        )
