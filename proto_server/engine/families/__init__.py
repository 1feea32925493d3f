"""Model families' tool-call syntaxes (base.py), one module each, which one a model is, and
the parser that reads its calls (`parser_for`; renderers.py builds its renderer).

A family is recognised by the special tokens of its call syntax in the tokenizer's vocabulary
(or its chat template's text; gpt-oss by harmony's `<|channel|>` and `<|start|>`; Qwen from
Hermes, whose `<tool_call>` it shares, by the form its template renders a call in);
`--tool-syntax` overrides that. A model that shows none is read as Hermes, the syntax SmolLM2
uses, and the log says so.

To add a family: a module with a `ToolSyntax` (its `CallFrame`, and what else differs from the
defaults: a parser of its own, another `Rendering`), listed in `FAMILIES`, with the token that
tells it in `detect`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from proto_server.engine.families.base import CallParser, ToolSyntax
from proto_server.engine.families.deepseek_v3 import CALLS_BEGIN, DEEPSEEK_V3
from proto_server.engine.families.framed import FramedCallParser
from proto_server.engine.families.harmony import CHANNEL, HARMONY, START
from proto_server.engine.families.hermes import HERMES, OPEN
from proto_server.engine.families.llama3 import HEADER, LLAMA3_JSON
from proto_server.engine.families.mistral import ARGS, MISTRAL, MISTRAL_JSON, TOOL_CALLS
from proto_server.engine.families.qwen import QWEN, renders_its_calls

FAMILIES: dict[str, ToolSyntax] = {
    family.name: family
    for family in (HERMES, QWEN, LLAMA3_JSON, MISTRAL, MISTRAL_JSON, DEEPSEEK_V3, HARMONY)
}
#: `--tool-syntax`'s default: the family the tokenizer shows.
AUTO = "auto"
CHOICES = (AUTO, *FAMILIES)
log = logging.getLogger("proto_server.engine.families")


def detect(tokenizer: Any) -> tuple[ToolSyntax, str | None]:
    """The family `tokenizer` shows, and the token that showed it (None: none did)."""
    vocabulary = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else str(template or "")

    def has(token: str) -> bool:
        return token in vocabulary or token in text

    if has(CHANNEL) and has(START):
        return HARMONY, CHANNEL
    if has(CALLS_BEGIN):
        return DEEPSEEK_V3, CALLS_BEGIN
    if has(TOOL_CALLS):
        return (MISTRAL, ARGS) if has(ARGS) else (MISTRAL_JSON, TOOL_CALLS)
    for token in (LLAMA3_JSON.frame.open, HEADER):
        if has(token):
            return LLAMA3_JSON, token
    if has(OPEN):
        rendered = renders_its_calls(tokenizer)
        return (HERMES, OPEN) if rendered is None else (QWEN, rendered)
    return HERMES, None


def choose(tokenizer: Any, wanted: str = AUTO) -> ToolSyntax:
    """The family named by `--tool-syntax`, or (`auto`) the one the tokenizer shows; logged."""
    if wanted != AUTO:
        family = FAMILIES[wanted]
        log.info("tool_syntax", extra={"tool_syntax": family.name, "chosen_by": "--tool-syntax"})
        return family
    family, token = detect(tokenizer)
    if token is None:
        log.info(
            "tool_syntax.unknown",
            extra={
                "tool_syntax": family.name,
                "why": "the tokenizer shows no known family's call tokens; pass --tool-syntax "
                "to read another syntax",
            },
        )
    else:
        log.info("tool_syntax", extra={"tool_syntax": family.name, "chosen_by": token})
    return family


def parser_for(
    syntax: ToolSyntax,
    tool_names: Collection[str],
    *,
    max_calls: int | None = None,
    forced: bool = False,
) -> CallParser:
    """A segment's parser of `syntax`'s calls: the family's own (Hermes', harmony's), else the
    one that reads its frame."""
    if syntax.own_parser is not None:
        return syntax.own_parser(tool_names, max_calls=max_calls, forced=forced)
    return FramedCallParser(syntax.frame, tool_names, max_calls=max_calls, forced=forced)
