"""Example instances of JSON schemas: the default model's tool arguments and structured answers.

An instance follows its schema: enums, `const` and `default` first; bounds inclusive and
exclusive (draft 4's booleans too) and `multipleOf`; `minLength`, `maxLength` and `pattern`
(patterns.py); `minItems`, `maxItems`, `contains`/`minContains`; `required` and
`minProperties`; local `$ref`s; the first `anyOf`/`oneOf` branch that can be built. A schema
that asks what no instance it builds can give raises `SchemaRefused`, naming the keyword and its
path, never a wrong instance.

Building is bounded before anything is allocated: `EXAMPLE_BUDGET` values of work and
`EXAMPLE_CHARS` characters of JSON, each size counted arithmetically (a string's `minLength`, an
item's size times `minItems`) before it is built, since the default model builds and streams the
instance on the event loop and a 254-byte schema may ask for a hundred million characters.

One walk over a schema, whose every keyword spends the same two
budgets and refuses in the same terms; a `pattern` is read apart, in patterns.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any, NoReturn

import orjson

from proto_server.core.tool_schema import Trail, trail_path
from proto_server.engine.patterns import PatternRefused, SearchTime, matching_string
from proto_server.wire.errors import quoted

_STRINGS_BY_NAME = {
    "cmd": "echo hello from proto-server",
    "command": "echo hello from proto-server",
    "path": "README.md",
    "file": "README.md",
    "filename": "README.md",
    "file_path": "README.md",
    "dir": ".",
    "workdir": ".",
    "cwd": ".",
    "directory": ".",
    "url": "http://127.0.0.1/",
    "query": "proto-server",
    "pattern": "TODO",
    "city": "Paris",
    "location": "Paris",
}


#: What one example may cost in work: each value built and each `required` entry read costs 1.
#: `$ref` lets a small schema describe an exponentially large value; an instance that needs
#: more values than this is refused (`SchemaRefused`), the walk stopped where the budget ran out.
EXAMPLE_BUDGET = 20_000

#: Characters of JSON one example may hold (a string's length, a property's name, a literal's
#: encoding, each copy `minItems` asks for). An instance whose smallest form is longer is refused,
#: counted before anything that long is built: the built-in model streams what it builds, on the
#: event loop, and a 254-byte schema asking `minLength: 100000000` must not make it try.
EXAMPLE_CHARS = 50_000

#: How deep an example may nest, `$ref`s followed; deeper parts are left out.
EXAMPLE_DEPTH = 32

#: What a string of a known `format` is (the formats OpenAI's structured outputs allow).
_STRINGS_BY_FORMAT = {
    "date-time": "2026-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "date": "2026-01-01",
    "duration": "P1D",
    "email": "user@example.com",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "http://127.0.0.1/",
}

_SAFE_NUMBER = 2**53  # beyond it a JSON number is not an exact integer (nor encodable past 2^64)
_HUGE = 2**63  # a count at least this large: larger than any budget, so refused


class _Omit:
    """A value left out: a `$ref` cycle cut, or a part nested too deep."""


_OMIT = _Omit()


class SchemaRefused(Exception):
    """A schema the built-in model builds no instance of: the `keyword` to blame, `param` its
    path in the request (`within`: the part of the schema the keyword's effect is seen in), and
    why. Never a partial or wrong instance instead."""

    def __init__(self, keyword: str, trail: Trail, reason: str, *, within: bool = False) -> None:
        self.keyword = keyword
        self.param = trail_path(trail if within else (keyword, trail))
        super().__init__(f"`{self.param}` {reason}")


def example_value(schema: Any, name: str = "", *, where: Trail = None) -> Any:
    """A plausible value for a JSON schema: enums, defaults and names guide the choice, and the
    instance follows its bounds, lengths, counts, `pattern` and `multipleOf`.

    Local `$ref`s (`#/$defs/...`, `#/definitions/...`, any `#/` pointer) are followed and a cycle
    is cut; `required` is read once per name; work and size are bounded (`EXAMPLE_BUDGET`,
    `EXAMPLE_CHARS`, `EXAMPLE_DEPTH`), sizes counted before anything is built, so any schema gives
    an answer in bounded time and memory. A part it cannot use (`items: false`, a cycle) is left
    out; None if nothing at all could be built. A schema it cannot honour (an instance over the
    budgets, a `pattern` it cannot match, bounds no value fits) raises `SchemaRefused`, whose
    path starts at `where`, the schema's place in the request.
    """
    value = _Examples(schema, where).build(schema, name, 0, frozenset(), where)
    return None if isinstance(value, _Omit) else value


class _Examples:
    def __init__(self, root: Any, where: Trail) -> None:
        self._root = root
        self._where = where
        self._values = EXAMPLE_BUDGET
        self._chars = EXAMPLE_CHARS
        self._resolved: dict[str, tuple[Any, Trail]] = {}  # each pointer walked once
        self._search = SearchTime()  # every pattern's matching together

    def _spend(self, trail: Trail, refs: frozenset[str]) -> None:
        self._values -= 1
        if self._values < 0:
            keyword = "$ref" if refs else "required"
            raise SchemaRefused(
                keyword,
                trail,
                f"is where the instance passed {EXAMPLE_BUDGET} values (its `{keyword}`s multiply "
                "it): more than this server's built-in model builds. Send a smaller schema, or "
                "serve it with a real model (--generator local or vllm).",
                within=True,
            )

    def _charge(self, chars: int, trail: Trail, keyword: str, what: str) -> None:
        """Spend `chars` of the size budget, or refuse before anything that large is built."""
        if chars > self._chars:
            self._too_large(trail, keyword, what)
        self._chars -= chars

    @staticmethod
    def _too_large(trail: Trail, keyword: str, what: str) -> NoReturn:
        raise SchemaRefused(
            keyword,
            trail,
            f"{what}: the instance would be longer than the {EXAMPLE_CHARS} characters of JSON "
            "this server's built-in model builds. Lower it, or serve the request with a real "
            "model (--generator local or vllm).",
        )

    def _literal(self, value: Any, trail: Trail, keyword: str) -> Any:
        size = len(orjson.dumps(value))  # the request's own value: measured, not built
        self._charge(size, trail, keyword, f"holds {size} characters of JSON")
        return value

    def _resolve(self, ref: str) -> tuple[Any, Trail]:
        """The schema a local `#/...` JSON pointer names, and its path; None if there is none."""
        if ref not in self._resolved:
            self._resolved[ref] = self._walk(ref)
        return self._resolved[ref]

    def _walk(self, ref: str) -> tuple[Any, Trail]:
        node, trail = self._root, self._where
        if not ref.startswith("#"):
            return None, trail
        for part in ref[1:].split("/")[1:]:
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None, trail
            trail = (key, trail)
        return node, trail

    def build(self, schema: Any, name: str, depth: int, refs: frozenset[str], trail: Trail) -> Any:
        if depth > EXAMPLE_DEPTH or schema is False:
            return _OMIT
        self._spend(trail, refs)
        if not isinstance(schema, Mapping):  # `true`, or not a schema: anything goes
            text = _STRINGS_BY_NAME.get(name.lower(), "example")
            self._charge(len(text), trail, "type", "is a string")
            return text
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in refs:
                return _OMIT
            target, target_trail = self._resolve(ref)
            if target is not None:
                return self.build(target, name, depth + 1, refs | {ref}, target_trail)
        for key in ("const", "default"):
            if key in schema:
                return self._literal(schema[key], trail, key)
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._literal(enum[0], trail, "enum")
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                tried = branches[:1] if key == "allOf" else branches
                return self._branch(tried, name, depth, refs, (key, trail))
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind == "object" or (kind is None and "properties" in schema):
            self._charge(2, trail, "type", "is an object")
            return self._object(schema, depth, refs, trail)
        if kind == "array":
            self._charge(2, trail, "type", "is an array")
            return self._array(schema, name, depth, refs, trail)
        if kind in ("integer", "number", "boolean", "null"):
            scalar: Any = False if kind == "boolean" else None
            if kind in ("integer", "number"):
                scalar = _number(schema, integer=kind == "integer", trail=trail)
            self._charge(len(orjson.dumps(scalar)), trail, "type", f"is {kind}")
            return scalar
        return self._string(schema, name, trail)

    def _branch(
        self, branches: list[Any], name: str, depth: int, refs: frozenset[str], trail: Trail
    ) -> Any:
        """The first of `branches` that can be built; else the first one's refusal."""
        refused: SchemaRefused | None = None
        for index, branch in enumerate(branches):
            try:
                return self.build(branch, name, depth + 1, refs, (index, trail))
            except SchemaRefused as why:
                if self._values <= 0:  # the budget is spent: no other branch is tried
                    raise
                refused = refused or why
        assert refused is not None
        raise refused

    def _object(
        self, schema: Mapping[str, Any], depth: int, refs: frozenset[str], trail: Trail
    ) -> Any:
        """The required properties; then, to reach `minProperties`, the optional ones, then
        names of its own (`p1`, `p2`...) where `additionalProperties` allows them."""
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            properties = {}
        required = schema.get("required")
        least, most = _least(schema, "minProperties"), _most(schema, "maxProperties")
        if least > self._values:  # counted before any is built
            self._too_large(trail, "minProperties", f"is {least}")
        value: dict[str, Any] = {}

        def add(key: str, field_schema: Any, field_trail: Trail) -> None:
            field = self.build(field_schema, key, depth + 1, refs, field_trail)
            if not isinstance(field, _Omit):
                self._charge(len(key) + 3, field_trail, "properties", "is a property's name")
                value[key] = field

        for key in required if isinstance(required, list) else ():
            self._spend(trail, refs)
            if isinstance(key, str) and key not in value:
                add(key, properties.get(key, {}), (key, ("properties", trail)))
        if len(value) < least:
            for key, field_schema in properties.items():
                if len(value) >= least:
                    break
                if isinstance(key, str) and key not in value:
                    add(key, field_schema, (key, ("properties", trail)))
            extra, missing = schema.get("additionalProperties", True), least - len(value)
            if missing > 0 and extra is not False:
                before = self._chars
                field = self.build(extra, "", depth + 1, refs, ("additionalProperties", trail))
                if not isinstance(field, _Omit):  # one value, under as many names as missing
                    each = before - self._chars + len(f"p{least}") + 3
                    what = f"is {least}, of properties of {each} characters"
                    self._charge(
                        missing * each - (before - self._chars), trail, "minProperties", what
                    )
                    self._values -= missing
                    names = (f"p{n}" for n in itertools.count(1) if f"p{n}" not in value)
                    value.update((name, field) for name in itertools.islice(names, missing))
        if len(value) < least or (most is not None and len(value) > most):
            keyword = "minProperties" if len(value) < least else "maxProperties"
            raise SchemaRefused(
                keyword,
                trail,
                f"cannot be met: the object's properties ({len(value)} built) do not allow it; "
                "fix the schema.",
            )
        return value

    def _array(
        self, schema: Mapping[str, Any], name: str, depth: int, refs: frozenset[str], trail: Trail
    ) -> Any:
        items = schema.get("items", {})
        tuple_key = "prefixItems" if "prefixItems" in schema else "items"
        tuple_items = schema.get(tuple_key)
        if isinstance(tuple_items, list):  # a tuple (draft 4 `items`, 2020-12 `prefixItems`)
            values = []
            for index, item in enumerate(tuple_items):
                value = self.build(item, name, depth + 1, refs, (index, (tuple_key, trail)))
                if not isinstance(value, _Omit):
                    values.append(value)
            return values
        least, most = _least(schema, "minItems"), _most(schema, "maxItems")
        keyword, item_key, item_schema = "minItems", "items", items
        contains = schema.get("contains")
        needed = _least(schema, "minContains", 1) if contains not in (None, True) else 0
        if needed:
            if items not in ({}, True):
                raise SchemaRefused(
                    "contains",
                    trail,
                    "beside `items`: the built-in model builds every item alike, and cannot "
                    "tell that an item of one is an item of the other; drop one, or serve the "
                    "request with a real model (--generator local or vllm).",
                )
            item_key, item_schema = "contains", contains
            if needed > least:
                keyword, least = "minContains", needed
        if most is not None and least > most:
            raise SchemaRefused(keyword, trail, f"is {least}, more than maxItems {most}: fix it.")
        if most == 0:
            return []
        if least > 1 and schema.get("uniqueItems") is True:
            raise SchemaRefused(
                "uniqueItems",
                trail,
                f"with {keyword} {least}: the built-in model repeats one item, so it cannot "
                "build distinct ones; serve it with a real model (--generator local or vllm).",
            )
        argv = name.lower() in ("command", "cmd", "argv") and _is_string_schema(items)
        if argv and contains is None and least <= 2 and (most is None or most >= 2):
            return ["echo", "hello from proto-server"]
        count = max(1, least)
        if count > self._values:  # counted before the item is built, let alone copied
            self._too_large(trail, keyword, f"is {least}")
        before = self._chars
        item = self.build(item_schema, name, depth + 1, refs, (item_key, trail))
        if isinstance(item, _Omit):
            if least > 0:
                raise SchemaRefused(keyword, trail, f"is {least}, and no item can be built.")
            return []
        each = before - self._chars + 1  # the item's characters, and a comma
        copies = count - 1
        if copies:
            self._charge(
                copies * each, trail, keyword, f"is {least}, of items of {each} characters"
            )
            self._values -= copies
        return [item] * count

    def _string(self, schema: Mapping[str, Any], name: str, trail: Trail) -> str:
        """A string by its `format`, else its property's name, fitted to `minLength` and
        `maxLength`, or one its `pattern` matches."""
        text = _STRINGS_BY_FORMAT.get(str(schema.get("format")))
        if text is None:
            text = _STRINGS_BY_NAME.get(name.lower(), "example")
        least, most = _least(schema, "minLength"), _most(schema, "maxLength")
        if most is not None and least > most:
            raise SchemaRefused(
                "minLength", trail, f"is {least}, more than maxLength {most}: no string fits."
            )
        if least > self._chars:
            self._too_large(trail, "minLength", f"is {least}")
        text = (text + "x" * max(least - len(text), 0))[: most if most is not None else None]
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                text = matching_string(
                    pattern,
                    seed=text,
                    least=least,
                    most=most,
                    limit=self._chars,
                    time_left=self._search,
                )
            except PatternRefused as why:
                raise SchemaRefused(
                    "pattern",
                    trail,
                    f"is {quoted(pattern)}, which this server's built-in model "
                    f"cannot match: {why}. Simplify the pattern, or serve the request with a real "
                    "model (--generator local or vllm).",
                ) from None
        self._charge(len(text) + 2, trail, "minLength", f"is {least}")
        return text


def _is_string_schema(schema: Any) -> bool:
    """Any string at all: a `type` and words about it, no other constraint."""
    return (
        isinstance(schema, Mapping)
        and schema.get("type") == "string"
        and set(schema) <= {"type", "description", "title"}
    )


def _least(schema: Mapping[str, Any], key: str, default: int = 0) -> int:
    """A `min...` count as a whole number (a huge one stays huge, so it is refused rather than
    ignored); `default` if it is missing or not a number."""
    value = _most(schema, key)
    return default if value is None else value


def _most(schema: Mapping[str, Any], key: str) -> int | None:
    """A `min...` or `max...` count as a whole number, rounded inwards; None if it is missing or
    not a number."""
    value = schema.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        return None
    if value >= _HUGE:
        return _HUGE
    if value <= 0:
        return 0
    return math.ceil(value) if key.startswith("min") else math.floor(value)


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value if abs(value) <= _SAFE_NUMBER else None
    return None  # a string, null or a huge number: not a usable bound


def _number(schema: Mapping[str, Any], *, integer: bool, trail: Trail) -> int | float:
    """1 when the bounds allow it, else the value nearest to it that they allow: bounds
    inclusive (`minimum`) or exclusive (`exclusiveMinimum`, a number from draft 6 on, `true`
    beside `minimum` in draft 4), on a multiple of `multipleOf`. Raises `SchemaRefused` when no
    value fits."""
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    low_open = schema.get("exclusiveMinimum") is True and low is not None
    high_open = schema.get("exclusiveMaximum") is True and high is not None
    above, below = _bound(schema, "exclusiveMinimum"), _bound(schema, "exclusiveMaximum")
    if above is not None and (low is None or above >= low):
        low, low_open = above, True
    if below is not None and (high is None or below <= high):
        high, high_open = below, True
    step = _bound(schema, "multipleOf")
    step = step if step is not None and step > 0 else None

    def fits(value: float) -> bool:
        return (
            (low is None or value > low or (value == low and not low_open))
            and (high is None or value < high or (value == high and not high_open))
            and (step is None or _multiple(value, step))
        )

    unit = Fraction(1) if integer else None
    if step is not None:
        unit = Fraction(repr(step))
        if integer:  # the least whole number that is a multiple of it
            unit = Fraction(unit.numerator)
    for candidate in _candidates(low, high, unit):
        value = int(candidate) if integer else float(candidate)
        if math.isfinite(value) and fits(value):
            return value
    bounds = ("exclusiveMinimum", "minimum", "exclusiveMaximum", "maximum")
    keyword = "multipleOf" if step is not None else next((k for k in bounds if k in schema), "type")
    raise SchemaRefused(
        keyword,
        trail,
        f"leaves no {'integer' if integer else 'number'} in "
        f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if high_open else ']'}"
        f"{'' if step is None else f' that is a multiple of {step}'}: fix the schema.",
    )


def _candidates(low: float | None, high: float | None, unit: Fraction | None) -> Iterator[Any]:
    """Values to try, nearest 1 first: on the grid of `unit` (None: any number) within
    [`low`, `high`]; a few around the ends, since a float bound or step may round."""
    if unit is None:
        near: list[float] = [1]
        for bound, nudge in ((low, 1), (high, -1)):
            if bound is not None:
                near += [bound, bound + nudge]
        if low is not None and high is not None:
            near.append((low + high) / 2)
        yield from sorted(near, key=lambda value: abs(value - 1))
        return
    start = max(1, round(1 / unit))  # the multiple nearest 1, or the least positive one
    if low is not None:
        start = max(start, -(-Fraction(low) // unit))
    if high is not None:
        start = min(start, Fraction(high) // unit)
    for offset in (0, 1, -1, 2, -2, 3, -3):
        yield Fraction(start + offset) * unit


def _multiple(value: float, step: float) -> bool:
    """Whether `value` is a multiple of `step` as JSON Schema validators decide it (jsonschema:
    float division for a float step, whose quotient must be whole)."""
    if isinstance(step, float):
        quotient = value / step
        return math.isfinite(quotient) and quotient == int(quotient)
    return value % step == 0
