"""Whether a `text.format` schema can constrain decoding, checked before any event is sent.

The local and vLLM generators decode a structured answer under a grammar compiled from the
schema (llguidance here, llguidance or xgrammar in vLLM), and a schema the grammar engine cannot
compile (a regex with look-around, a `$ref` to a URL, an unknown type; when `strict`, a keyword
it does not implement) would otherwise fail the Response after it started. The check compiles it
once with llguidance (no tokenizer needed); when that fails it finds the part to blame by
bisecting its subschemas, so the 400's `param` names a path such as
`text.format.schema.properties.when` (the subschema whose `pattern` looks ahead).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import llguidance

from proto_server.core.text_format import INVALID_SCHEMA, SCHEMA_PARAM, TextFormat
from proto_server.wire.errors import ProtocolError

#: How JSON is written under a grammar: as `json.dumps` writes it, no other whitespace, which
#: keeps a runaway model from padding forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else",
        "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DEFS = ("$defs", "definitions")


def guidance_schema(schema: Mapping[str, Any], *, strict: bool) -> dict[str, Any]:
    """`schema` with llguidance's options: the JSON style, and (not `strict`) keywords it does
    not implement ignored."""
    return {**schema, "x-guidance": {**JSON_STYLE, "lenient": not strict}}


def grammar_error(schema: Mapping[str, Any], *, strict: bool) -> str:
    """Why llguidance cannot compile `schema`; empty if it can."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            guidance_schema(schema, strict=strict)
        )
    except (ValueError, TypeError) as exc:  # not JSON-encodable
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar)


def check_text_format(form: TextFormat) -> None:
    """Raise a 400 `invalid_json_schema` naming the part of `form`'s schema a grammar cannot
    take; nothing for a schema it can."""
    error = grammar_error(form.schema, strict=form.strict)
    if not error:
        return
    path = _blame(form.schema, strict=form.strict)
    raise ProtocolError(
        INVALID_SCHEMA,
        f"`{path}` cannot constrain decoding ({' '.join(error.split())}); change that part of the "
        "schema" + ("" if form.strict else ", or leave it out") + ".",
        param=path,
    )


def _children(schema: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE:
        if isinstance(schema.get(key), Mapping):
            yield key, schema[key]
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for index, child in enumerate(schema[key]):
                yield f"{key}[{index}]", child
    for key in _NAMED:
        if isinstance(schema.get(key), Mapping):
            for name, child in schema[key].items():
                yield f"{key}.{name}", child


def _blame(root: Mapping[str, Any], *, strict: bool) -> str:
    """The path of the deepest subschema that fails on its own (with the root's definitions,
    so local `$ref`s still resolve); the schema itself if none does. Each level bisects its
    children (a group compiled as one `anyOf`), so a wide schema costs a few compiles a level."""
    defs = {key: root[key] for key in _DEFS if isinstance(root.get(key), Mapping)}

    def fails(group: list[tuple[str, Mapping[str, Any]]]) -> bool:
        return bool(grammar_error({**defs, "anyOf": [child for _, child in group]}, strict=strict))

    path, node = SCHEMA_PARAM, root
    while True:
        group = [(step, child) for step, child in _children(node) if isinstance(child, Mapping)]
        if not group or not fails(group):
            return path
        while len(group) > 1:
            half = group[: len(group) // 2]
            group = half if fails(half) else group[len(half) :]
        step, node = group[0]
        path = f"{path}.{step}"
