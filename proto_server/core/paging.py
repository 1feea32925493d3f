"""A page of a list, as OpenAI pages its lists (`GET /v1/responses/{id}/input_items`): `limit`
1-100 (default 20), `order` asc or desc (default desc), `after` an id of the list; the body
`{"object": "list", "data", "first_id", "last_id", "has_more"}`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast
from urllib.parse import parse_qsl

import attrs

from proto_server.wire.errors import ProtocolError, quoted

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
#: What `include` may ask for (openai-python's `ResponseIncludable`). None of it is anything
#: this server adds to an item (it stores no images, search results or logprobs), so each is
#: accepted and changes nothing.
INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
    }
)


@attrs.frozen
class PageQuery:
    limit: int = DEFAULT_LIMIT
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    include: tuple[str, ...] = ()


def parse_page_query(query: str) -> PageQuery:
    """A list's query string (`include` repeated, or `include[]` as openai-python sends it);
    a value out of range is a 400 naming the parameter."""
    values: dict[str, str] = {}
    include: list[str] = []
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in ("include", "include[]"):
            if value not in INCLUDABLE:
                raise _invalid("include", f"has {quoted(value)}; it may hold only {_listed()}")
            include.append(value)
        else:
            values[name] = value
    limit = values.get("limit", str(DEFAULT_LIMIT))
    if not (
        len(limit) <= 3 and limit.isascii() and limit.isdigit() and 1 <= int(limit) <= MAX_LIMIT
    ):
        raise _invalid("limit", f"is {quoted(limit)}; send a whole number from 1 to {MAX_LIMIT}")
    order = values.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _invalid("order", f'is {quoted(order)}; send "asc" or "desc"')
    return PageQuery(
        int(limit), cast(Literal["asc", "desc"], order), values.get("after"), tuple(include)
    )


def page(items: Sequence[Mapping[str, Any]], query: PageQuery) -> dict[str, Any]:
    """The page `query` asks for of `items` (in ascending order, each with an `id`)."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start = 0
    if query.after is not None:
        ids = [item.get("id") for item in ordered]
        if query.after not in ids:
            raise _invalid("after", f"is {quoted(query.after)}, which is no item of this list")
        start = ids.index(query.after) + 1
    data = ordered[start : start + query.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": start + query.limit < len(ordered),
    }


def _listed() -> str:
    return ", ".join(sorted(INCLUDABLE))


def _invalid(param: str, problem: str) -> ProtocolError:
    return ProtocolError("invalid_field", f"`{param}` {problem}.", param=param)
