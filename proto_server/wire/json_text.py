"""Reading a client's JSON text: nested no deeper than the server can write back, and a large
text parsed (and let go of) so that the event loop's thread still gets the GIL; and writing a
large value a piece at a time, for the same reason."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from proto_server.wire.errors import ProtocolError

#: Client JSON nested deeper than this is refused: the server echoes client values (tools,
#: metadata, items) inside its own events and store, and orjson encodes at most 254 levels.
MAX_JSON_DEPTH = 128
_ENCODABLE_DEPTH = 254


def opened(text: str | bytes) -> int:
    """How many arrays and objects `text` opens, at most (brackets inside strings count too)."""
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def refuse_deep(containers: int, obj: Any, what: str) -> None:
    """Raise if `obj` (parsed from a text that `opened` `containers`) nests deeper than
    `MAX_JSON_DEPTH`."""
    if containers <= MAX_JSON_DEPTH:
        return  # too few brackets to nest that deep: no need to look
    if not _within(obj, MAX_JSON_DEPTH, walk=containers > LET_GO_CONTAINERS):
        raise ProtocolError(
            "invalid_json",
            f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
            "flatten it (e.g. send deep data as a JSON string).",
        )


def _within(obj: Any, depth: int, *, walk: bool) -> bool:
    """Whether `obj` nests at most `depth` levels.

    orjson, in C, fails exactly when what it encodes is deeper than it can write: one call,
    which holds the GIL over the whole tree (97-140 ms for 15 MB of deep items). A tree of
    millions of containers (`walk`) is walked here instead, five times the CPU, but the GIL
    changes hands as it goes."""
    if not walk:
        for _ in range(_ENCODABLE_DEPTH - depth):
            obj = [obj]
        try:
            orjson.dumps(obj)
        except orjson.JSONEncodeError:
            return False
        return True
    if not isinstance(obj, dict | list):
        return True
    stack: list[tuple[Any, int]] = [(obj, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        container, level = pop()
        if level > depth:
            return False
        for entry in container.values() if type(container) is dict else container:
            kind = type(entry)
            if kind is dict or kind is list:
                push((entry, level + 1))
    return True


#: A parse tree of more containers than this is emptied by `let_go`: freed in one C call, as
#: many take about 20 ms.
LET_GO_CONTAINERS = 250_000


def _only_ours() -> int:
    """What `sys.getrefcount` says of a container held only by the local it was popped into,
    as `let_go` pops them: 2 up to Python 3.13, 1 where locals are borrowed (3.14)."""
    stack: list[Any] = [[]]
    pop, references = stack.pop, sys.getrefcount
    container = pop()
    return references(container)


_ONLY_OURS = _only_ours()


def let_go(tree: Any, containers: int) -> None:
    """Let go of a parse tree its caller is done with; one of more than `LET_GO_CONTAINERS`
    (as `opened` counted them) is first emptied container by container, where nothing else
    holds them.

    Let go of at once, millions of nested containers are freed in one C call that holds the
    GIL throughout: 270 ms for a 15 MB frame of deep items, a stall for every client. Emptied
    here, the GIL changes hands as it goes, at three times the CPU. A container something else
    still holds (a value an event kept as it was parsed) is left whole."""
    if containers <= LET_GO_CONTAINERS or not isinstance(tree, dict | list):
        return
    stack: list[Any] = [*(tree.values() if isinstance(tree, dict) else tree)]
    tree.clear()
    pop, extend, references = stack.pop, stack.extend, sys.getrefcount
    while stack:
        container = pop()
        kind = type(container)
        if (kind is dict or kind is list) and references(container) == _ONLY_OURS:
            extend(container.values() if kind is dict else container)
            container.clear()


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


#: A list of more objects or arrays than this is encoded an entry at a time (`in_pieces`).
_PIECEWISE_ENTRIES = 64


def in_pieces(obj: dict[str, Any], *, levels: int) -> None:
    """Encode each long list of objects or arrays in `obj` (and in the objects in it, `levels`
    deep: a Response's tools and output) an entry at a time, in place: in one call, orjson
    held the GIL for 90 ms over a Response echoing the 134,000 tools of a 15 MB request."""
    for key, value in obj.items():
        if isinstance(value, dict) and levels > 1:
            obj[key] = value = dict(value)  # a copy: the one unstructured may be a live value
            in_pieces(value, levels=levels - 1)
        elif isinstance(value, list) and long_list(value):
            obj[key] = orjson.Fragment(list_in_pieces(value))


def long_list(value: Sequence[Any]) -> bool:
    """Whether `value` is a list `in_pieces` encodes an entry at a time."""
    return len(value) > _PIECEWISE_ENTRIES and isinstance(value[0], dict | list)


def list_in_pieces(value: Sequence[Any]) -> bytes:
    """`value` as a JSON array, encoded an entry at a time."""
    encoded = bytearray(b"[")
    for entry in value:
        # each entry's bytes let go of at once: orjson's keep a few KiB each
        encoded += orjson.dumps(entry)
        encoded += b","
    encoded[-1:] = b"]"
    return bytes(encoded)
