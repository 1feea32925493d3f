"""What this server refuses of a request when it arrives, before any work: what the core
refuses of a create (`core/request.py`), a compaction or reasoning item it did not seal, and
what its generator cannot do (a forced tool call, logprobs or token ids, a `text.format` schema
its grammar cannot take). Synchronous: `Responses.check` runs it off the event loop when large."""

from __future__ import annotations

from collections.abc import Mapping

from proto_server.core.compaction import CompactionKey, check_compactions
from proto_server.core.reasoning import check_reasonings
from proto_server.core.request import (
    LOGPROBS,
    TOKEN_IDS,
    check_create,
    input_items,
    request_bytes,
    wants_logprobs,
    wants_token_ids,
)
from proto_server.core.text_format import parse_text_format
from proto_server.core.tool_choice import ToolChoice, parse_tool_choice
from proto_server.engine.base import GrammarGenerator, TokenGenerator, says_logprobs
from proto_server.wire.errors import ProtocolError
from proto_server.wire.events import ResponseCreate


def check_servable(create: ResponseCreate, generator: TokenGenerator, key: CompactionKey) -> None:
    """Refuse a create this server cannot serve: what `check_create` refuses, a compaction item
    `key` did not seal, and a forced tool call the generator cannot make, logprobs or token ids
    it cannot say, a `text.format` schema its grammar cannot take."""
    check_create(create)
    check_compactions(input_items(create), key)
    check_reasonings(input_items(create), key)
    check_forcing(parse_tool_choice(create.tool_choice), generator)
    for wanted, name, code in (
        (wants_logprobs, LOGPROBS, "unsupported_logprobs"),
        (wants_token_ids, TOKEN_IDS, "unsupported_token_ids"),
    ):
        if wanted(create) and not says_logprobs(generator):
            raise ProtocolError(
                code,
                f"`include` names {name!r}, but this server's generator cannot say its "
                "tokens' ids and logprobs; remove it from `include` (or serve the "
                "simulated, local or vllm generator, which can).",
                param="include",
            )
    form = parse_text_format(create.text)
    if form is not None and isinstance(generator, GrammarGenerator):
        generator.check_text_format(form)


def check_forcing(choice: ToolChoice, generator: TokenGenerator) -> None:
    """Refuse a forced tool call (`required`, a named function) the generator cannot make."""
    if choice.mode == "required" and not generator.forces_tool_calls:
        demanded = f"names {choice.name!r}" if choice.name is not None else 'is "required"'
        raise ProtocolError(
            "unsupported_tool_choice",
            f"`tool_choice` {demanded}: a forced tool call, which this server's generator "
            'cannot make yet; send "auto" (or "none") instead.',
            param="tool_choice",
        )


def servable_bytes(create: ResponseCreate, generator: TokenGenerator, key: CompactionKey) -> int:
    """`check_servable`, then about how much memory `create` holds while it waits."""
    check_servable(create, generator, key)
    return request_bytes(create)


def compiles_schema(create: ResponseCreate, generator: TokenGenerator) -> bool:
    """Whether checking `create` compiles a `json_schema` answer (valid or not: checking it is
    the work) for a grammar engine: work that grows with more than the request's size."""
    form = create.text.get("format") if isinstance(create.text, Mapping) else None
    is_schema = isinstance(form, Mapping) and form.get("type") == "json_schema"
    return is_schema and isinstance(generator, GrammarGenerator)
