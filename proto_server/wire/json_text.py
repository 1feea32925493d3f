"""Reading a client's JSON text: nested no deeper than the server can write back, and a large
text parsed so that the event loop's thread still gets the GIL."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from proto_server.wire.errors import ProtocolError

#: Client JSON nested deeper than this is refused: the server echoes client values (tools,
#: metadata, items) inside its own events and store, and orjson encodes at most 254 levels.
MAX_JSON_DEPTH = 128
_ENCODABLE_DEPTH = 254


def refuse_deep(text: str | bytes, obj: Any, what: str) -> None:
    """Raise if `obj` (parsed from `text`) nests deeper than `MAX_JSON_DEPTH`."""
    opened = (
        text.count("[") + text.count("{")
        if isinstance(text, str)
        else (text.count(b"[") + text.count(b"{"))
    )
    if opened <= MAX_JSON_DEPTH:
        return  # too few brackets to nest that deep: no need to look
    for _ in range(_ENCODABLE_DEPTH - MAX_JSON_DEPTH):
        obj = [obj]
    try:
        orjson.dumps(obj)  # in C, and it fails exactly when obj is deeper than the limit
    except orjson.JSONEncodeError:
        raise ProtocolError(
            "invalid_json",
            f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
            "flatten it (e.g. send deep data as a JSON string).",
        ) from None


#: Frames larger than this are parsed by `load_yielding`, the rest by orjson.
YIELDING_PARSE_BYTES = 64 * 1024
_INT_RANGE = range(-(2**63), 2**64)  # what orjson reads as an integer


def _number_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _integer(text: str) -> int | float:
    value = int(text)
    return value if value in _INT_RANGE else _finite(text)  # as orjson: a double past 64 bits


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is infinity when parsed as double")
    return value


def _object_from(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


#: A `\uD800`-`\uDFFF` escape: whether it is half of a pair, only orjson tells.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_yielding(text: str | bytes) -> Any:
    """JSON like orjson reads it, but a thread parsing a large frame lets others run.

    orjson holds the GIL for the whole parse (0.4 s for 550,000 small objects, a stall for
    every other client even from a worker thread). The stdlib's parser calls back into Python
    for every object and number, and each callback is a point where the GIL changes hands.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # strictly, as orjson does: no surrogates smuggled in
    if _SURROGATE_ESCAPE.search(text):
        return orjson.loads(text)  # rare in large frames; correctness over responsiveness
    try:
        return json.loads(
            text,
            object_pairs_hook=_object_from,
            parse_int=_integer,
            parse_float=_finite,
            parse_constant=_number_constant,
        )
    except RecursionError:
        raise ValueError("it nests too deeply") from None


def load(text: str | bytes) -> Any:
    """Parsed JSON; a `ValueError` (orjson's and json's errors are ones) says what is wrong."""
    return load_yielding(text) if len(text) > YIELDING_PARSE_BYTES else orjson.loads(text)
