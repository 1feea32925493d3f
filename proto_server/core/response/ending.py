"""An end decided but not yet said: the client cancelled, the server expired the Response or
its generator failed; the terminal event goes out at the next safe point (`end`). Until then
the Response is `ending` and takes nothing more from the client."""

from __future__ import annotations

import attrs

from proto_server.core.response.status import Status
from proto_server.wire.errors import ErrorDetail, ProtocolError


@attrs.frozen
class Ending:
    """Why an `ending` Response ends: its terminal status, and the reason or error it says."""

    to: Status
    reason: str | None = None
    error: ErrorDetail | None = None


def refuse_if_ending(response_id: str, status: Status, ending: Ending | None, what: str) -> None:
    """The client's `ProtocolError` for a Response that ended or is ending: it cannot be `what`."""
    if status.terminal:
        raise ProtocolError(
            "no_open_response",
            f"Response {response_id} already ended ({status.value}); it cannot be {what}. "
            "Start a new one with response.create.",
        )
    if ending is not None:
        why = "cancelled" if ending.to is Status.CANCELLED else "ended"
        if ending.reason is not None:
            why = f"ended ({ending.reason})"
        raise ProtocolError(
            "no_open_response",
            f"Response {response_id} is being {why}; it cannot be {what}. Start a new one "
            "with response.create.",
        )
