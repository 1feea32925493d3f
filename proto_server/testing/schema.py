"""The published Open Responses schema as a validator of what a server sends.

`open-responses-openapi.json` beside this module is the Open Responses OpenAPI document
(version 2026-04-24, Apache-2.0, from the Open Responses project). Its `components.schemas`
define the Response object, the items and every streamed event. `WireSchema` validates against
them with `jsonschema` (draft 2020-12; `$ref`s resolved through one `referencing` registry,
built once), so a strict client's parser would accept what passes.

Five overlays on the published document, each explicit here and in docs/checker.md:

- `EXTENSION_EVENTS`: this project's events that the schema does not define (`response.done`,
  `response.cancelled`), checked against schemas of their own whose `response` is still a
  published `ResponseResource`. They are the only events outside the schema, beside
- `OPENAI_EVENTS`: OpenAI's own events the document does not define yet
  (`response.compaction.compacting`, `response.reasoning_text.delta` and `.done` (the
  document's `response.reasoning.delta` and `.done` under OpenAI's names),
  `response.inject.created` and `.failed`, `response.steer.accepted`, `.pending` and
  `.failed`), held to the shape OpenAI documents.
- `OPENAI_REQUIRES`: what OpenAI's own API requires beyond the document (openai-python 3.57's
  `ResponseUsage` requires `input_tokens_details.cache_write_tokens`).
- Carried tools: the document's `Tool` is only `FunctionTool`; tools of other types a client
  sends (`custom`, `web_search`, `namespace`...) are echoed exactly as sent, so in a Response's
  `tools` an object whose `type` is not `function` passes. A function tool is checked in full;
  likewise a `tool_choice` naming such a tool (`{"type": "custom", "name": ...}`).
- `ERRATA`: two places where the document contradicts itself: `ReasoningEffortEnum` describes
  `minimal` but does not list it; `JsonSchemaResponseFormat.schema` admits only null, though
  the request's format (`JsonSchemaResponseFormatParam`) requires an object there.

Needs the `jsonschema` package (the dev extra), imported only when a `WireSchema` is built.

The overlays are the whole list of where this project departs from
the published document, and `_overlaid` and `WireSchema` apply them to the document the validators
are built from. In one file, each departure listed sits beside the code that applies it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import orjson

Transport = Literal["websocket", "sse"]

SPEC_PATH = Path(__file__).with_name("open-responses-openapi.json")
_URI = "urn:open-responses"


@attrs.frozen
class Extension:
    """An event of this project's that the published document does not define: why it exists,
    and the JSON schema it is held to instead (its `$ref`s may name the document's components,
    e.g. `ref("ResponseResource")`)."""

    why: str
    schema: Mapping[str, Any]


def ref(component: str) -> dict[str, str]:
    """A `$ref` to one of the document's `components.schemas`."""
    return {"$ref": f"{_URI}#/components/schemas/{component}"}


def response_event(kind: str, status: str) -> dict[str, Any]:
    """The schema of an event shaped as the published Response events are: `{type,
    sequence_number, response}`, its `response` a `ResponseResource` of `status`."""
    return {
        "type": "object",
        "required": ["type", "sequence_number", "response"],
        "properties": {
            "type": {"const": kind},
            "sequence_number": {"type": "integer", "minimum": 0},
            "response": {
                "allOf": [ref("ResponseResource"), {"properties": {"status": {"const": status}}}]
            },
        },
    }


#: This project's server events outside the published schema, the only ones: each is held to
#: its own schema (docs/checker.md, "The published schema").
EXTENSION_EVENTS: Mapping[str, Extension] = {
    "response.done": Extension(
        why="prototype dialect: a segment ended on tool calls; the Response is suspended",
        schema=response_event("response.done", "in_progress"),
    ),
    "response.cancelled": Extension(
        why="the answer to this project's response.cancel",
        schema=response_event("response.cancelled", "cancelled"),
    ),
}


#: OpenAI's own server events that the Open Responses document does not define yet (PROTOCOL.md
#: section 7, openai-python 3.57's types): held to their shape as OpenAI documents it.
def _plain_event(kind: str, required: Mapping[str, Any]) -> dict[str, Any]:
    """An event of `kind` with `sequence_number` and the `required` properties."""
    return {
        "type": "object",
        "required": ["type", "sequence_number", *required],
        "properties": {
            "type": {"const": kind},
            "sequence_number": {"type": "integer", "minimum": 0},
            "stream_id": {"type": "string"},
            **required,
        },
    }


_STEER_REF = {
    "type": "object",
    "required": ["id", "previous_response_id"],
    "properties": {"id": {"type": "string"}, "previous_response_id": {"type": "string"}},
}
#: A failed steer's input is returned exactly as sent: what the SDK sends is a string or items
#: (`ResponseSteerInput`), but an `invalid_input` may be any JSON value, and comes back as is.
_STEER_INPUT: dict[str, Any] = {}

OPENAI_EVENTS: Mapping[str, Extension] = {
    "response.steer.accepted": Extension(
        why="the server owns a steer's input; the successor's response.created commits it",
        schema=_plain_event("response.steer.accepted", {"steer": _STEER_REF}),
    ),
    "response.steer.pending": Extension(
        why="a steer waits for the tool outputs its Response waits on (required_input stubs)",
        schema=_plain_event(
            "response.steer.pending",
            {
                "reason": {"type": "string"},
                "steer": _STEER_REF,
                "required_input": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "call_id"],
                        "properties": {"type": {"type": "string"}, "call_id": {"type": "string"}},
                    },
                },
            },
        ),
    ),
    "response.steer.failed": Extension(
        why="a steer was not committed; its input comes back (openai-python 3.57)",
        schema=_plain_event(
            "response.steer.failed",
            {
                "error": {
                    "type": "object",
                    "required": ["code", "message", "type"],
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "type": {"const": "invalid_request_error"},
                    },
                },
                "steer": {
                    "type": "object",
                    "required": ["input", "previous_response_id"],
                    "properties": {
                        "input": _STEER_INPUT,
                        "previous_response_id": {"type": "string"},
                        "id": {"type": "string"},
                    },
                },
            },
        ),
    ),
    "response.inject.created": Extension(
        why="the multi-agent beta: the injected items were committed (openai-python 3.57)",
        schema=_plain_event("response.inject.created", {"response_id": {"type": "string"}}),
    ),
    "response.inject.failed": Extension(
        why="the multi-agent beta: nothing was committed; the input comes back",
        schema=_plain_event(
            "response.inject.failed",
            {
                "response_id": {"type": "string"},
                "input": {"type": "array"},
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                },
            },
        ),
    ),
    **{
        f"response.reasoning_text.{end}": Extension(
            why=f"OpenAI's name for the document's response.reasoning.{end} (openai-python "
            f"ResponseReasoningText{end.title()}Event), which clients parse",
            schema=_plain_event(
                f"response.reasoning_text.{end}",
                {
                    "item_id": {"type": "string"},
                    "output_index": {"type": "integer", "minimum": 0},
                    "content_index": {"type": "integer", "minimum": 0},
                    text: {"type": "string"},
                },
            ),
        )
        for end, text in (("delta", "delta"), ("done", "text"))
    },
    "response.compaction.compacting": Extension(
        why="context_management compaction began (openai-python ResponseCompactionCompactingEvent)",
        schema={
            "type": "object",
            "required": ["type", "sequence_number", "item_id", "output_index"],
            "properties": {
                "type": {"const": "response.compaction.compacting"},
                "sequence_number": {"type": "integer", "minimum": 0},
                "item_id": {"type": "string"},
                "output_index": {"type": "integer", "minimum": 0},
            },
        },
    ),
}

#: This project's client events outside the published schema (the server accepts them; the
#: schema's only client message is `response.create`).
EXTENSION_CLIENT_EVENTS: Mapping[str, str] = {
    "response.append": "prototype dialect: tool outputs (and messages) that resume the Response",
    "response.cancel": "end the open Response with status cancelled",
}

#: Fields OpenAI's API requires beyond the Open Responses document: component -> properties.
OPENAI_REQUIRES: Mapping[str, Mapping[str, Any]] = {
    "InputTokensDetails": {"cache_write_tokens": {"type": "integer", "minimum": 0}},
}

#: Where the document contradicts itself, and how the overlay settles it.
ERRATA: Mapping[str, str] = {
    "ReasoningEffortEnum": "`minimal` is described in x-enumDescriptions but not in `enum`",
    "JsonSchemaResponseFormat": "`schema` allows only null; the request's format needs an object",
}

_CARRIED_TOOL = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "not": {"const": "function"}}},
}

_CARRIED_CHOICE = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "not": {"enum": ["function", "allowed_tools"]}}},
}

_HTTP_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": ref("ErrorPayload")},
}


class SchemaViolation(AssertionError):
    """What a server sent does not validate; the message names the schema and every path."""


def _overlaid(document: Mapping[str, Any]) -> dict[str, Any]:
    """The document with the overlays of this module's docstring applied."""
    doc = copy.deepcopy(dict(document))
    schemas = doc["components"]["schemas"]
    for name, extra in OPENAI_REQUIRES.items():
        schemas[name]["properties"].update(extra)
        schemas[name]["required"] = [*schemas[name]["required"], *extra]
    schemas["Tool"] = {"oneOf": [*schemas["Tool"]["oneOf"], _CARRIED_TOOL]}
    choice = schemas["ResponseResource"]["properties"]["tool_choice"]
    choice["oneOf"] = [*choice["oneOf"], _CARRIED_CHOICE]
    effort = schemas["ReasoningEffortEnum"]
    effort["enum"] = [
        *effort["enum"],
        *sorted(set(effort["x-enumDescriptions"]) - set(effort["enum"])),
    ]
    schemas["JsonSchemaResponseFormat"]["properties"]["schema"] = {
        "anyOf": [{"type": "object"}, {"type": "null"}]
    }
    return doc


def _event_components(document: Mapping[str, Any]) -> dict[str, str]:
    """Event type -> component, read from the document's `text/event-stream` schema."""
    post = document["paths"]["/responses"]["post"]
    stream = post["responses"]["200"]["content"]["text/event-stream"]["schema"]
    events = {}
    for ref in stream["oneOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        (kind,) = document["components"]["schemas"][name]["properties"]["type"]["enum"]
        events[kind] = name
    return events


class WireSchema:
    """Validators for every kind of object a Responses server sends, built once."""

    def __init__(self, document: Mapping[str, Any] | None = None) -> None:
        from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
        from referencing import Registry, Resource

        if document is None:
            document = orjson.loads(SPEC_PATH.read_bytes())
        doc = _overlaid(document)
        registry: Registry[Any] = Registry().with_resource(
            _URI, Resource.from_contents(doc, default_specification=_draft202012())
        )

        def validator(schema: Mapping[str, Any]) -> Any:
            return Draft202012Validator(schema, registry=registry)

        self.events: dict[str, Any] = {
            kind: validator(ref(name)) for kind, name in _event_components(doc).items()
        }
        self.websocket_error = validator(ref("WebSocketErrorEvent"))
        self.extensions = {
            kind: validator(e.schema) for kind, e in {**EXTENSION_EVENTS, **OPENAI_EVENTS}.items()
        }
        self.response = validator(ref("ResponseResource"))
        self.item = validator(ref("ItemField"))
        self.compaction = validator(ref("CompactResource"))
        self.http_error = validator(_HTTP_ERROR)

    # -- what is wrong (empty: nothing) ----------------------------------------------------------

    def event_errors(self, event: Any, *, transport: Transport = "websocket") -> list[str]:
        """Every way `event` (a decoded server event) fails its schema."""
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "error" and transport == "websocket":
            # a WebSocket error carries `status` (WebSocketErrorEvent) and is numbered as
            # every event is (ErrorStreamingEvent): it must pass both
            return [
                *_errors(self.websocket_error, event, "WebSocketErrorEvent"),
                *_errors(self.events["error"], event, "ErrorStreamingEvent"),
            ]
        checker = self.events.get(kind) if isinstance(kind, str) else None
        if checker is None and isinstance(kind, str):
            checker = self.extensions.get(kind)
        if checker is None:
            return [f"event type {kind!r} is neither in the schema nor a listed extension"]
        return _errors(checker, event, str(kind))

    def body_errors(self, path: str, status: int, body: Any, method: str = "GET") -> list[str]:
        """Every way an HTTP JSON body fails: a Response (`POST /v1/responses`, `GET
        /v1/responses/{id}`), a compaction (`/v1/responses/compact`), each item of an input
        items list, or any error body. What the document does not describe (a deletion, a
        token count, models) is not checked."""
        if status >= 400:
            return _errors(self.http_error, body, "an HTTP error body")
        path = path.split("?", 1)[0].rstrip("/")
        if path == "/v1/responses/compact":
            return _errors(self.compaction, body, "CompactResource")
        if path.endswith("/input_items"):
            return [
                e for item in body.get("data", []) for e in _errors(self.item, item, "ItemField")
            ]
        if method == "DELETE" or path == "/v1/responses/input_tokens":
            return []
        if path.startswith("/v1/responses"):
            return _errors(self.response, body, "ResponseResource")
        return []  # /healthz, /readyz: not the API's

    # -- the same, raising -----------------------------------------------------------------------

    def check_event(self, event: Any, *, transport: Transport = "websocket") -> None:
        _raise(self.event_errors(event, transport=transport), event)

    def check_body(self, path: str, status: int, body: Any) -> None:
        _raise(self.body_errors(path, status, body), body)

    def check_response(self, response: Any) -> None:
        _raise(_errors(self.response, response, "ResponseResource"), response)

    def check_item(self, item: Any) -> None:
        _raise(_errors(self.item, item, "ItemField"), item)

    def check_compaction(self, body: Any) -> None:
        _raise(_errors(self.compaction, body, "CompactResource"), body)


@functools.cache
def wire_schema() -> WireSchema:
    """The validator over the bundled document, built once per process (it takes ~0.1 s)."""
    return WireSchema()


def _draft202012() -> Any:
    from referencing.jsonschema import DRAFT202012

    return DRAFT202012


def _errors(validator: Any, instance: Any, name: str) -> list[str]:
    found: Iterator[Any] = validator.iter_errors(instance)
    return [_describe(error, name) for error in found]


def _describe(error: Any, name: str) -> str:
    from jsonschema.exceptions import best_match  # type: ignore[import-untyped]

    leaf = error
    while leaf.context:  # a failed oneOf says little: follow the branch that came closest
        branches = [e for e in leaf.context if e.validator_value != "null"] or leaf.context
        leaf = best_match(branches)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in leaf.absolute_path)
    message = leaf.message if len(leaf.message) <= 300 else leaf.message[:299] + "…"
    return f"{name} at ${where}: {message}"


def _raise(errors: list[str], instance: Any) -> None:
    if errors:
        shown = orjson.dumps(instance, default=repr).decode()
        if len(shown) > 600:
            shown = shown[:599] + "…"
        raise SchemaViolation("; ".join(errors[:5]) + f"; in {shown}")
