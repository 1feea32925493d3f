"""Typed errors that say whose fault a failure is.

A `ProtocolError` is the client's fault: it becomes an `error` event and the connection lives on.
A `ServerFault` is the model's or the server's: it ends the open Response with `response.failed`.
Both carry what the wire needs; the conversion to events happens at one boundary, in the server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import attrs


@attrs.frozen(kw_only=True)
class ErrorDetail:
    """The `error` object of an `error` event or a failed Response."""

    type: str
    code: str
    message: str
    param: str | None = None


class ProtocolError(Exception):
    """A client frame was malformed or not legal now; nothing it asked for has happened."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
        stream_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(type=error_type, code=code, message=message, param=param)
        #: The WebSocket lane of the frame it refuses (its `error` goes there); None: the lane
        #: the frame named (`on_lane`), else the default one.
        self.stream_id = stream_id


@contextlib.contextmanager
def on_lane(stream_id: str | None) -> Iterator[None]:
    """A refusal raised inside is said on `stream_id`'s lane, unless it names its own: where
    a frame's handler knows the lane and what it calls (the machine's checks) does not."""
    try:
        yield
    except ProtocolError as exc:
        if exc.stream_id is None:
            exc.stream_id = stream_id
        raise


class SteerRefused(Exception):
    """A `response.steer` that is not taken: it becomes `response.steer.failed` (`code` is one
    of OpenAI's steering codes), which returns the input; nothing of it was committed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ServerFault(Exception):
    """The model, the generator or the server failed; the Response fails, the connection lives."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.detail = ErrorDetail(type="server_error", code=code, message=message)


#: How many names of a client-sized collection an error message lists, and how long each may be.
LISTED_NAMES = 5
QUOTED_CHARS = 64


def quoted(value: str, limit: int = QUOTED_CHARS) -> str:
    """`value` as an error message quotes it: repr'd, cut to `limit` characters, so a value the
    client made huge cannot make the error huge too."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def some_of(names: Iterable[str], *, limit: int = LISTED_NAMES) -> str:
    """A client-sized collection for an error message: all of a few, else the count and the
    first `limit` ("3,000: 'a', 'b', ... "): an error stays small whatever the client sent."""
    listed = list(names)
    shown = ", ".join(quoted(name) for name in listed[:limit]) or "none"
    if len(listed) <= limit:
        return shown
    return f"{len(listed):,}, e.g. {shown}, ..."
