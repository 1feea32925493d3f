"""How a value cattrs could not structure becomes a refusal: where it was, and what it earns.

cattrs raises a tree of errors, each noting the attribute or index it was found at; the first
leaf names the field a client must fix. Its frames are let go of at once: cattrs keeps each
error in a list its frame holds, and each error's traceback holds that frame, a cycle that
would keep the whole parsed request alive until a full collection.
"""

from __future__ import annotations

from cattrs.errors import AttributeValidationNote, BaseValidationError, IterableValidationNote


class InvalidValue(ValueError):
    """A value of the wrong shape; the converter adds where it was."""


class InvalidStreamId(InvalidValue):
    """A `stream_id` the SDKs would not send: refused as `invalid_stream_id`."""


def locate(exc: BaseException, path: str = "") -> tuple[str, BaseException]:
    """Follow cattrs' validation notes down to the first leaf error and the path to it."""
    if not isinstance(exc, BaseValidationError):
        return path, exc
    inner = exc.exceptions[0]
    for note in getattr(inner, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            path = f"{path}.{note.name}" if path else note.name
            break
        if isinstance(note, IterableValidationNote):
            path = f"{path}[{note.index}]"
            break
    return locate(inner, path)


def _forget_tracebacks(exc: BaseException) -> None:
    """Let go of the frames `exc` and the errors in it were raised through: cattrs keeps each
    error in a list its frame holds, and each error's traceback holds that frame (a cycle)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        pending += [e for e in (error.__context__, error.__cause__) if e is not None]
        if isinstance(error, BaseExceptionGroup):
            pending += error.exceptions


def refusal(exc: BaseValidationError) -> tuple[str, str, str]:
    """Where cattrs found `exc`, and the code and words of the refusal it earns; the frames
    it was raised through let go of (`_forget_tracebacks`)."""
    path, leaf = locate(exc)
    _forget_tracebacks(exc)
    if isinstance(leaf, KeyError):
        return path, "invalid_field", "is required but missing"
    if isinstance(leaf, InvalidStreamId):
        return path, "invalid_stream_id", str(leaf)
    if isinstance(leaf, InvalidValue):
        return path, "invalid_field", str(leaf)
    return path, "invalid_field", f"is not valid ({leaf})"
