"""Constrained decoding for the local model (llguidance): calls the model cannot get wrong.

A small model rarely writes a tool call on its own, and a random one never does; under a
grammar even they do. The grammar is the model family's own call syntax (its `CallFrame`,
families/), for Hermes and SmolLM2:

    <tool_call>[{"name": "exec_command", "arguments": {"cmd": "ls"}}]</tool_call>

the name one of the offered tools (or the one `tool_choice` names), the arguments what that
tool's JSON schema allows, and at most as many calls as the request still allows. A `strict`
tool's schema is followed exactly (one llguidance cannot compile refuses the segment); any
other tool's schema is followed leniently (keywords llguidance does not know are ignored), or,
if it still does not compile, any JSON object is accepted: a forced call whose arguments fit
the tool is worth more to the agent than one that merely parses. Arguments are written as
`json.dumps` writes them (`", "` and `": "`, no other whitespace), as the system prompt's
example shows them (`ToolSyntax.describe_tools`), which keeps a runaway model from padding forever.

A forced call (`required`, a named function) starts at the first token. Under `auto`, when an
offered tool is `strict`, text is free (any text; of the special tokens only the end of turn)
and the grammar takes over once the model writes the open tag (a lazy trigger), so a call it
opens is a valid one. Under a structured `text.format` the answer is a JSON instance of its
schema (in the same JSON style), or, when calls are allowed, a call block instead.

Each decode step computes the set of tokens the grammar allows next and masks the others out
of the logits (`-inf`): the greedy chooser stays deterministic, it only chooses among fewer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from proto_server.core.text_format import TextFormat
from proto_server.engine.families.base import CallFrame
from proto_server.engine.families.hermes import HERMES
from proto_server.engine.limits import GenerationRefused
from proto_server.engine.schema_grammar import JSON_STYLE, guidance_schema
from proto_server.wire.tools import FunctionTool

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text)


def _compiles(schema: dict[str, Any], tokenizer: llguidance.LLTokenizer) -> str:
    """The error compiling `schema` as a grammar; empty if it compiles."""
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: %json {json.dumps(schema)}")
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)


def arguments_schema(tool: FunctionTool, tokenizer: llguidance.LLTokenizer) -> dict[str, Any]:
    """The schema a call's arguments are held to, with the JSON style (module docstring)."""
    parameters = dict(tool.parameters) if tool.parameters is not None else ANY_OBJECT
    schema = guidance_schema(parameters, strict=bool(tool.strict))
    error = _compiles(schema, tokenizer)
    if not error:
        return schema
    if tool.strict:
        raise GenerationRefused(
            "invalid_tool_schema",
            f"the strict schema of tool {tool.name!r} cannot constrain decoding ({error}); "
            "fix the schema, or send the tool with strict false.",
        )
    return {**ANY_OBJECT, "x-guidance": JSON_STYLE}


def call_grammar(
    tools: Sequence[FunctionTool],
    tokenizer: llguidance.LLTokenizer,
    *,
    max_calls: int | None,
    lazy: bool = False,
    answer: TextFormat | None = None,
    frame: CallFrame = HERMES.frame,
    specials: Mapping[str, int] | None = None,
) -> str:
    """The Lark grammar of a call block in `frame` naming one of `tools`, at most `max_calls`
    calls in it; `lazy`: free text until the model opens a block (and it need not); `answer`:
    a JSON answer of that format, or (with `tools`) a block. `specials`: the tokens llguidance
    holds apart from text (by their text), which the frame's literals name by id."""
    text = _Literals(specials or {})
    if answer is not None:
        schema = json.dumps(guidance_schema(answer.schema, strict=answer.strict))
        rules = [f"answer: %json {schema}"]
        if not tools:
            return llguidance.LLMatcher.grammar_from_lark("\n".join(["start: answer", *rules]))
        either = f"start: answer | {text.opening(frame.opening)}calls"
        rules += _calls(tools, tokenizer, max_calls, frame, text)
        return llguidance.LLMatcher.grammar_from_lark("\n".join([either, *rules]))
    if lazy:  # how llguidance's StructTag writes a trigger in running text
        start = [
            "%llguidance {}",
            "start: block* TEXT",
            f"opened[lazy]: TEXT {text(frame.trigger)}",
            f"block: opened {text.opening(frame.opening.removeprefix(frame.trigger))}calls",
            r"TEXT: /(.|\n)*/",
        ]
    else:
        start = [f"start: {text.opening(frame.opening)}calls"]
    return llguidance.LLMatcher.grammar_from_lark(
        "\n".join([*start, *_calls(tools, tokenizer, max_calls, frame, text)])
    )


class _Literals:
    """Text as Lark literals, a special token in it as `<[id]>` (llguidance matches a special
    token only so, never by its text)."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self._specials = specials
        self._split = (
            re.compile(
                "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
            )
            if specials
            else None
        )

    def __call__(self, text: str) -> str:
        if self._split is None:
            return _literal(text)
        parts = [part for part in self._split.split(text) if part]
        return " ".join(
            f"<[{self._specials[part]}]>" if part in self._specials else _literal(part)
            for part in parts
        )

    def opening(self, text: str) -> str:
        """`text` followed by a space, or nothing for no text."""
        return f"{self(text)} " if text else ""


def _calls(
    tools: Sequence[FunctionTool],
    tokenizer: llguidance.LLTokenizer,
    max_calls: int | None,
    frame: CallFrame,
    text: _Literals,
) -> list[str]:
    """The rules of `calls`: what follows the block's opening (up to the first name)."""
    rules = []
    for number, tool in enumerate(tools):
        head = text(tool.name + frame.name_suffix)
        schema = json.dumps(arguments_schema(tool, tokenizer))
        rules.append(
            f"call_{number}: {head} args_{number} {text.opening(frame.args_suffix)}".rstrip()
        )
        rules.append(f"args_{number}: %json {schema}")
    most = frame.most_calls(max_calls)
    separator = text((frame.separator or "") + frame.name_prefix)
    if frame.separator is None or most == 1:
        more = ""
    elif most is None:
        more = f"({separator} call)*"
    else:
        more = f"({separator} call){{0,{most - 1}}}"
    return [
        f"calls: call {more} {text.opening(frame.close)}".rstrip(),
        "call: " + " | ".join(f"call_{number}" for number in range(len(tools))),
        *rules,
    ]


def byte_level_json(backend: Any) -> str:
    """The tokenizer as llguidance reads it (`tokenizer.json`), its decoder fixed for byte-level
    vocabularies: transformers' GGUF conversion decodes with [ByteFallback, Fuse, Replace,
    ByteLevel], and llguidance, seeing ByteFallback, would read `Ġ"` as those two characters'
    bytes rather than ` "`, so its masks would be wrong wherever a token starts with a space."""
    spec = json.loads(backend.to_str())
    spec.pop("padding", None)
    spec.pop("truncation", None)
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", ()) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return json.dumps(spec)


class Guide:
    """The model's vocabulary as llguidance reads it: built once per generator, on the first
    constrained segment (about a second for SmolLM2's 49,152 tokens)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_ids: Collection[int]) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._added: dict[str, int] = dict(getattr(tokenizer, "get_added_vocab", dict)())
        self._specials: dict[str, int] | None = None
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def available(self) -> bool:
        """llguidance reads fast (Rust) tokenizers only; a slow (Python) one has no grammar."""
        return self._backend is not None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._backend is None:
                raise GenerationRefused(
                    "unsupported_tool_choice",
                    "constrained decoding needs a fast (Rust) tokenizer; this model has none",
                )
            self._tokenizer = llguidance.LLTokenizer(
                byte_level_json(self._backend), n_vocab=self._vocab_size, eos_token=self._stop_ids
            )
        return self._tokenizer

    def constrain(
        self,
        tools: Sequence[FunctionTool],
        *,
        max_calls: int | None,
        lazy: bool = False,
        answer: TextFormat | None = None,
        frame: CallFrame = HERMES.frame,
    ) -> Constraint:
        """The constraint of one segment (blocking: compiling a schema can take a while)."""
        if self._specials is None:
            is_special = self.tokenizer.is_special_token
            self._specials = {text: i for text, i in self._added.items() if is_special(i)}
        grammar = call_grammar(
            tools,
            self.tokenizer,
            max_calls=max_calls,
            lazy=lazy,
            answer=answer,
            frame=frame,
            specials=self._specials,
        )
        return Constraint(llguidance.LLMatcher(self.tokenizer, grammar))


class Constraint:
    """One segment's grammar state: it masks the logits of each step and follows each choice."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error():
            raise GenerationRefused("invalid_tool_schema", matcher.get_error())
        self._matcher = matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every token the grammar forbids next at -inf."""
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(packed, bitorder="little")[: logits.shape[-1]].astype(bool)
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), -torch.inf)

    def consume(self, token: int) -> None:
        """Advance past the chosen token; one the grammar forbids is a bug in the chooser."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding: token {token} was not allowed here")
