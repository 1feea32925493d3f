"""The default model's instances of a schema: bounded in size, and honouring `pattern`,
`multipleOf` and exclusive bounds, or refused naming the keyword.

A schema whose smallest instance is over the example budgets (`minLength`, `minItems`,
`minProperties`, `minContains`, and their products when nested) is refused before anything
that large is built: the memory a refusal costs is measured (tracemalloc), not timed. Every
instance the model does build is checked with `jsonschema`, as a client's validator would.
"""

from __future__ import annotations

import itertools
import tracemalloc
from typing import Any

import jsonschema
import orjson
import pytest
import regex  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from proto_server.core.tool_schema import trail_of
from proto_server.engine import patterns
from proto_server.engine.examples import EXAMPLE_CHARS, SchemaRefused, example_value
from proto_server.engine.patterns import MAX_PATTERN_CHARS

#: The 254-byte probe: one string property that must be a hundred million characters long.
HUGE_STRING = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 100_000_000}},
    "required": ["a"],
}


def valid(instance: Any, schema: Any, validator: Any = jsonschema.Draft202012Validator) -> None:
    validator(schema, format_checker=validator.FORMAT_CHECKER).validate(instance)


def peak_bytes(schema: Any) -> tuple[SchemaRefused | None, int]:
    """What building (and encoding) an instance of `schema` raised, and the most memory it
    held at once."""
    tracemalloc.start()
    try:
        try:
            orjson.dumps(example_value(schema))
            refused = None
        except SchemaRefused as error:
            refused = error
        return refused, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


HUGE = {
    "minLength": (HUGE_STRING, "properties.a.minLength"),
    "minLength-past-2^53": (
        {"type": "string", "minLength": 1e20},
        "minLength",
    ),
    "minItems": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000},
        "minItems",
    ),
    "minItems-of-minLength": (  # each alone within the budget, the product far over it
        {"type": "array", "minItems": 10_000, "items": {"type": "string", "minLength": 10_000}},
        "minItems",
    ),
    "minProperties": ({"type": "object", "minProperties": 100_000_000}, "minProperties"),
    "minProperties-of-minLength": (
        {
            "type": "object",
            "minProperties": 5_000,
            "additionalProperties": {"type": "string", "minLength": 1_000},
        },
        "minProperties",
    ),
    "minContains": (
        {"type": "array", "contains": {"const": "x"}, "minContains": 100_000_000},
        "minContains",
    ),
    "nested-minItems": (
        {
            "type": "array",
            "minItems": 1_000,
            "items": {"type": "array", "minItems": 1_000, "items": {"type": "integer"}},
        },
        "minItems",
    ),
}


@pytest.mark.parametrize("name", list(HUGE))
def test_an_instance_over_the_budget_is_refused_before_it_is_built(name: str) -> None:
    """Before: `minLength: 1e8` built a 100 MB string (4.87 GB resident once streamed), and
    minItems of long strings or minProperties built what their product asks."""
    schema, param = HUGE[name]
    refused, peak = peak_bytes(schema)
    assert refused is not None, f"{name}: built instead of refused"
    assert refused.param.endswith(param) and refused.keyword == param.rsplit(".", 1)[-1]
    assert str(EXAMPLE_CHARS) in str(refused) or "values" in str(refused)
    assert peak < 2_000_000  # a refusal is counted, not built


def test_a_refusal_names_the_path_in_the_request() -> None:
    where = trail_of(["text", "format", "schema"])
    with pytest.raises(SchemaRefused) as refused:
        example_value(HUGE_STRING, where=where)
    assert refused.value.param == "text.format.schema.properties.a.minLength"
    assert "100000000" in str(refused.value) and "--generator" in str(refused.value)
    ref = {"$defs": {"Big": HUGE_STRING}, "$ref": "#/$defs/Big"}
    with pytest.raises(SchemaRefused) as refused:
        example_value(ref, where=where)
    assert refused.value.param == "text.format.schema.$defs.Big.properties.a.minLength"


def test_the_largest_instance_within_the_budget_is_built() -> None:
    value = example_value({"type": "string", "minLength": EXAMPLE_CHARS - 2})
    assert len(value) == EXAMPLE_CHARS - 2
    assert peak_bytes({"type": "string", "minLength": EXAMPLE_CHARS - 1})[0] is not None


def test_an_unbuildable_first_branch_gives_way_to_the_next() -> None:
    schema = {"anyOf": [{"type": "string", "minLength": 10**9}, {"type": "integer"}]}
    assert example_value(schema) == 1


# -- pattern ---------------------------------------------------------------------------------

#: Patterns the built-in model matches, as pydantic and hand-written schemas use them.
MATCHED = [
    r"^[A-Z]{3}-\d{2}$",
    r"^\d{4}-\d{2}-\d{2}$",
    r"^[a-z0-9_-]{3,16}$",
    r"^\+?[1-9]\d{1,14}$",
    r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$",
    r"^(foo|bar|baz)+$",
    r"^(?:[01]\d|2[0-3]):[0-5]\d$",
    r"^#[0-9a-fA-F]{6}$",
    r"v\d+\.\d+",
    r"^\w+(\.\w+)*$",
    r"^(?P<word>[a-z]+)?\.txt$",
    r"^x\{2\}$",
    r"^[\u00e9-\u00ff]+$",
    r"^\bab\b$",
]

#: Patterns it refuses: what it does not build (look-around, back-references, inline flags),
#: and what nothing matches.
REFUSED = [r"^(?=.*\d)[a-z\d]{8}$", r"(a)\1", r"(?i)^abc$", r"^a$b"]

#: Patterns Python's `re` (and so `jsonschema`) cannot read at all.
UNREADABLE = [r"\p{L}", "["]


@pytest.mark.parametrize("pattern", MATCHED)
def test_a_pattern_is_matched(pattern: str) -> None:
    schema = {"type": "string", "pattern": pattern}
    valid(example_value(schema), schema)


@pytest.mark.parametrize("pattern", REFUSED + UNREADABLE)
def test_a_pattern_it_cannot_match_is_refused_naming_it(pattern: str) -> None:
    with pytest.raises(SchemaRefused) as refused:
        example_value(
            {"type": "object", "properties": {"p": {"pattern": pattern}}, "required": ["p"]}
        )
    assert refused.value.param == "properties.p.pattern" and refused.value.keyword == "pattern"


def test_a_pattern_is_read_within_bounds() -> None:
    """A long pattern is refused unread; a repeat count is counted, never written out (the
    `regex` engine writes fixed repeats out when it compiles: the last two took 275 MB and a
    MemoryError)."""
    patterns = ["a" * (MAX_PATTERN_CHARS + 1), "^(a{100000}){100000}$", "a{1000000000}"]
    for pattern in [*patterns, "(a{1000}|b){1000}", "((a{1000}|b){1000}|c){100}"]:
        refused, peak = peak_bytes({"type": "string", "pattern": pattern})
        assert refused is not None and refused.keyword == "pattern"
        assert peak < 2_000_000


@pytest.mark.parametrize("pattern", [r"(x+x+)+\by", r"^(a|a)*b\b$", r"(x+x+)+y$", r"^(\w|\d)+!$"])
def test_a_pattern_that_backtracks_badly_is_matched_in_bounded_time_or_refused(
    pattern: str,
) -> None:
    """Candidates 40 characters long, on which Python's `re` takes minutes to fail (these
    patterns at 24 characters: 1.6 to 2.4 s each); the check runs under a time bound."""
    schema = {"type": "string", "pattern": pattern, "minLength": 40, "maxLength": 40}
    try:
        value = example_value(schema)
    except SchemaRefused as refused:
        assert refused.keyword == "pattern"
    else:
        # matched on the bounded engine: `re` may take minutes on a string that does not match
        assert len(value) == 40 and regex.search(pattern, value, timeout=5)


def test_a_schemas_patterns_share_one_search_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand branches that backtrack badly cost the bound once: after the first is
    refused for its time, no other search is given any (the reviewer's `anyOf` of 2,500 such
    branches held the loop 50 ms each, two minutes in all)."""
    timeouts: list[float] = []

    class Spied:
        def __init__(self, compiled: Any) -> None:
            self._compiled = compiled

        def search(self, text: str, *, timeout: float) -> Any:
            timeouts.append(timeout)
            return self._compiled.search(text, timeout=timeout)

    compile_ = patterns.regex.compile
    monkeypatch.setattr(patterns.regex, "compile", lambda p: Spied(compile_(p)))
    slow = {"type": "string", "pattern": r"^(a|a)*$b", "minLength": 30}
    schema = {"anyOf": [slow] * 20 + [{"type": "string"}]}
    assert example_value(schema) == "example"
    assert len(timeouts) >= 20 and sum(t > 0 for t in timeouts) <= 2


@pytest.mark.parametrize(("worked_s", "matched"), [(0.0, True), (1.0, False)])
def test_a_search_cut_while_its_thread_did_not_run_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, worked_s: float, matched: bool
) -> None:
    """On a busy machine a search can reach the bound without working (descheduled, or the
    GIL elsewhere): tried once more, it is not refused; one that worked that long is."""
    cpu = iter(itertools.count())
    monkeypatch.setattr(patterns.time, "thread_time", lambda: next(cpu) * worked_s)
    first = [True]

    class Starved:
        def __init__(self, compiled: Any) -> None:
            self._compiled = compiled

        def search(self, text: str, *, timeout: float) -> Any:
            if first.pop() if first else False:
                raise TimeoutError("the bound passed")
            return self._compiled.search(text, timeout=timeout)

    compile_ = patterns.regex.compile
    monkeypatch.setattr(patterns.regex, "compile", lambda p: Starved(compile_(p)))
    schema = {"type": "string", "pattern": "^[a-z]+$"}
    if matched:
        assert example_value(schema) == "example"
    else:
        with pytest.raises(SchemaRefused, match="longer than"):
            example_value(schema)


def test_a_pattern_meets_the_lengths_or_is_refused() -> None:
    """A name's or a format's string is kept where it matches; else one is built to fit."""
    assert example_value({"type": "string", "pattern": "^[a-z]+$"}) == "example"
    dated = {"type": "string", "format": "date", "pattern": r"^\d{4}-"}
    assert example_value(dated) == "2026-01-01"
    fitted = {"type": "string", "pattern": r"^[a-z]+$", "minLength": 12, "maxLength": 12}
    valid(example_value(fitted), fitted)
    grown = {"type": "string", "pattern": r"^(ab)+c$", "minLength": 9}
    valid(example_value(grown), grown)
    for impossible in [
        {"type": "string", "pattern": r"^\d{5}$", "maxLength": 3},
        {"type": "string", "pattern": r"^\d{5}$", "minLength": 7},
        {"type": "string", "minLength": 5, "maxLength": 3},
    ]:
        with pytest.raises(SchemaRefused):
            example_value(impossible)


# -- numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "integer", "exclusiveMinimum": 0, "multipleOf": 5}, 5),
        ({"type": "integer", "exclusiveMinimum": 1}, 2),
        ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5),
        ({"type": "number", "multipleOf": 0.25, "minimum": 2.1}, 2.25),
        ({"type": "integer", "multipleOf": 2.5}, 5),
        ({"type": "integer", "minimum": 11, "maximum": 19, "multipleOf": 7}, 14),
        ({"type": "number", "exclusiveMaximum": -3}, -4.0),
        ({"type": "number", "multipleOf": 0.1, "minimum": 0.25}, 1.0),
    ],
)
def test_numbers_honour_exclusive_bounds_and_multiple_of(schema: Any, expected: Any) -> None:
    value = example_value(schema)
    assert value == expected and type(value) is type(expected)
    valid(value, schema)


def test_draft_4_boolean_exclusive_bounds_are_honoured() -> None:
    schema = {"type": "integer", "minimum": 1, "exclusiveMinimum": True}
    assert example_value(schema) == 2
    valid(2, schema, jsonschema.Draft4Validator)
    below = {"type": "number", "maximum": 1, "exclusiveMaximum": True}
    value = example_value(below)
    assert value < 1
    valid(value, below, jsonschema.Draft4Validator)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "integer", "minimum": 6, "maximum": 9, "multipleOf": 5}, "multipleOf"),
        ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "exclusiveMinimum"),
        ({"type": "number", "minimum": 2, "maximum": 1}, "minimum"),
    ],
)
def test_bounds_no_number_fits_are_refused(schema: Any, keyword: str) -> None:
    with pytest.raises(SchemaRefused) as refused:
        example_value(schema)
    assert refused.value.keyword == keyword


# -- generated schemas ----------------------------------------------------------------------

NUMBERS = st.builds(
    lambda kind, low, span, exclusive, step: {
        "type": kind,
        **({"exclusiveMinimum": low} if exclusive else {"minimum": low}),
        **({"exclusiveMaximum": low + span} if exclusive else {"maximum": low + span}),
        **({"multipleOf": step} if step is not None else {}),
    },
    st.sampled_from(["integer", "number"]),
    st.integers(-50, 50) | st.floats(-50, 50, allow_nan=False),
    st.integers(0, 30) | st.floats(0, 30, allow_nan=False),
    st.booleans(),
    st.none() | st.sampled_from([1, 2, 5, 7, 0.5, 0.25, 0.1, 2.5, 3.3]),
)
STRINGS = st.builds(
    lambda pattern, low, span: {
        "type": "string",
        **({"pattern": pattern} if pattern is not None else {}),
        **({"minLength": low} if low is not None else {}),
        **({"maxLength": low + span} if low is not None and span is not None else {}),
    },
    st.none() | st.sampled_from(MATCHED + REFUSED),
    st.none() | st.integers(0, 40) | st.sampled_from([10**6, 10**9]),
    st.none() | st.integers(0, 10),
)
LEAVES = NUMBERS | STRINGS | st.sampled_from([{"type": "boolean"}, {"const": "fixed"}, {}])
COUNTS = st.none() | st.integers(0, 4) | st.sampled_from([300, 10**5, 10**9])


def _array(items: Any, least: int | None, contains: Any, unique: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": items}
    if least is not None:
        schema["minItems"] = least
    if contains is not None:  # honoured where any item may be its match: no `items`
        schema.update(contains=contains[0], minContains=contains[1], items=None)
    if unique:
        schema["uniqueItems"] = True
    return {k: v for k, v in schema.items() if v is not None}


def _object(properties: dict[str, Any], required: int, least: int | None, extra: Any) -> Any:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties)[:required],
        "additionalProperties": extra,
    }
    return schema if least is None else {**schema, "minProperties": least}


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(st.sampled_from(["a", "b", "code", "n"]), inner, max_size=3),
            st.integers(0, 3),
            COUNTS,
            st.sampled_from([True, False]) | inner,
        ),
        st.builds(_array, inner, COUNTS, st.none() | st.tuples(inner, COUNTS), st.booleans()),
        st.lists(inner, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(SCHEMAS)
def test_an_instance_is_valid_or_refused_and_always_small(schema: dict[str, Any]) -> None:
    try:
        value = example_value(schema)
    except SchemaRefused as refused:
        assert refused.keyword in str(refused) or refused.keyword in ("$ref", "required")
        return
    assert len(orjson.dumps(value)) <= 2 * EXAMPLE_CHARS
    valid(value, schema)
