"""JSON the server carries without reading it, kept encoded.

An item, content part or tool of a type this server does not interpret is stored, echoed and
sent back whole. Its top-level fields stay values (a `type`, `id` or `call_id` is read), but
whatever nests below them is kept as the JSON bytes it was: decoded, one request of 4 MB can hold
a million small dicts and lists for as long as its Response lives, and the cyclic garbage
collector scans every one of them, holding the GIL (so the event loop) for a second at a time.
Bytes are not scanned, and take a fraction of the memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import orjson


@attrs.frozen
class RawJSON:
    """A JSON array or object, encoded; equal to another exactly when their texts are.

    Kept as a `str` (ASCII JSON takes a byte a character): orjson's `bytes` keep the
    capacity its writer grew to, about 2 KiB for even a short value."""

    encoded: str

    def value(self) -> Any:
        """The JSON, decoded (a new object each call)."""
        return orjson.loads(self.encoded)


def carried(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """`obj` with each array or object below its top level kept encoded."""
    return {key: _kept(value) for key, value in obj.items()}


def _kept(value: Any) -> Any:
    if isinstance(value, dict | list | tuple):
        return RawJSON(orjson.dumps(value).decode())
    return value


def carried_or_name(value: Mapping[str, Any] | str) -> Mapping[str, Any] | str:
    """`carried`, for what may also be a bare name (a tool given as a string)."""
    return value if isinstance(value, str) else carried(value)


def wire_fields(obj: Mapping[str, Any] | str) -> Any:
    """What orjson encodes: the encoded values as fragments, written out as they are."""
    if isinstance(obj, str):
        return obj
    return {
        key: orjson.Fragment(value.encoded) if isinstance(value, RawJSON) else value
        for key, value in obj.items()
    }


def decoded(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` with its encoded values decoded, as plain JSON."""
    return {
        key: value.value() if isinstance(value, RawJSON) else value for key, value in obj.items()
    }


def encoded(obj: Mapping[str, Any]) -> bytes:
    """`obj` as the JSON it came as."""
    return orjson.dumps(wire_fields(obj))
