"""`text.format`: what shape the model's text answer must have (structured output).

`{"type": "text"}` (or none) is free text. `{"type": "json_object"}` is any JSON object;
`{"type": "json_schema", "schema": {...}, "strict": B}` an instance of `schema` (`strict`: the
schema followed exactly; not strict: keywords a grammar engine does not know are ignored). Every
generator honours it: the default model answers an instance it builds from the schema, the local
and vLLM generators decode the text under a grammar of it. A malformed format is refused when
the request arrives, as is a schema over the budgets tool schemas have (tool_schema.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from proto_server.core.tool_schema import check_schema
from proto_server.wire.errors import ProtocolError, quoted

#: The schema `json_object` asks for.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

#: The error code of a schema this server cannot honour (OpenAI's).
INVALID_SCHEMA = "invalid_json_schema"

#: Where a JSON schema format's schema sits in a request (errors' `param` start here).
SCHEMA_PARAM = "text.format.schema"


@attrs.frozen(kw_only=True)
class TextFormat:
    """A structured answer: JSON, an instance of `schema`."""

    kind: Literal["json_object", "json_schema"]
    schema: Mapping[str, Any] = ANY_OBJECT
    strict: bool = False
    name: str | None = None


def parse_text_format(text: Any) -> TextFormat | None:
    """The format `text` (the request's `text` field) asks for; None: free text. Raises
    `ProtocolError` for a format this server cannot honour, naming the field."""
    form = text.get("format") if isinstance(text, Mapping) else None
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return TextFormat(kind="json_object")
    if kind != "json_schema":
        raise ProtocolError(
            "invalid_field",
            f'`text.format.type` is {quoted(str(kind))}; send one of "text", "json_object", '
            '"json_schema".',
            param="text.format.type",
        )
    schema = form.get("schema")
    if not isinstance(schema, Mapping):
        raise ProtocolError(
            "invalid_field",
            "`text.format.schema` must be a JSON schema (an object) when `text.format.type` is "
            '"json_schema"; send the schema the answer must follow.',
            param=SCHEMA_PARAM,
        )
    check_schema(schema, SCHEMA_PARAM.split("."), INVALID_SCHEMA)
    name = form.get("name")
    return TextFormat(
        kind="json_schema",
        schema=schema,
        strict=form.get("strict") is True,
        name=name if isinstance(name, str) else None,
    )
