"""What a model family is to the server: how it is offered tools, how it writes a call.

Each family (Hermes/Qwen, Llama 3.x JSON, Mistral, DeepSeek V3) was tuned on its own call
syntax. A `ToolSyntax` says, for one family: how tools are offered when the chat template does
not take them (`describe_tools`), how an earlier call is written when the template does not
render `tool_calls` (`call_text`), the role a tool's output is shown under, the `CallFrame` a
grammar writes a forced call in (constraints.py for the local model, vLLM's structural tags in
vllm/grammar.py) and which ids end the model's turn (`stop_ids`). It is data: what reads its
calls (its own parser, or its frame's) and what renders its conversations (`Rendering`) are
named here and built elsewhere, by the registry (`families.parser_for`) and renderers.py, so
that a family depends on no parser or renderer that depends on it. A family whose parser also
yields reasoning (harmony) adds its own chunk kinds to the parser; nothing here assumes calls
are the only structure in a model's output.
"""

from __future__ import annotations

import enum
import itertools
import json
import re
from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs

from proto_server.engine.chunks import Chunk, ToolCallArgumentsDelta, ToolCallBegin, ToolCallEnd
from proto_server.engine.tokens import stop_ids
from proto_server.wire.json_text import MAX_JSON_DEPTH
from proto_server.wire.tools import FunctionTool

if TYPE_CHECKING:
    from proto_server.engine.limits import GenerationLimits

WHITESPACE = " \t\r\n"
#: Arguments the model nests deeper than this are no call (released as text, or a streamed
#: call ends there): the depth a client may send, and far from where Python's decoder, and
#: so the next turn's template, would run out of stack (about 990 levels).
MAX_ARGUMENTS_DEPTH = MAX_JSON_DEPTH
#: What a scan of JSON text stops at: brackets, and what opens, escapes or closes a string.
_JSON_MARKS = re.compile(r'[\[\]{}"\\]')
_STRING_MARKS = re.compile(r'["\\]')


@attrs.frozen
class CallFrame:
    """A block of calls as a grammar writes it: `open`, then `list_open`, then per call
    `name_prefix` NAME `name_suffix` ARGUMENTS `args_suffix`, calls joined by `separator`
    (None: one call a block), then `close` ("" : the block ends with the model's turn)."""

    open: str
    name_prefix: str
    name_suffix: str
    args_suffix: str
    separator: str | None
    close: str
    list_open: str = ""
    #: The block may also start without `open`, at the start of the message (Llama's JSON).
    bare: bool = False
    #: A call the model writes may hold this key after its arguments, a string (Mistral's
    #: `"id"`); a grammar writes none.
    id_key: str | None = None

    @property
    def forced_open(self) -> str:
        """What a forced block starts with: `open`, or nothing where the block may be bare."""
        return ("" if self.bare else self.open) + self.list_open

    @property
    def trigger(self) -> str:
        """What, written in free text, opens a block (a grammar's lazy trigger)."""
        return self.name_prefix if self.bare else self.open

    @property
    def opening(self) -> str:
        """A block's text up to its first call's name."""
        return self.forced_open + self.name_prefix

    def most_calls(self, max_calls: int | None) -> int | None:
        """How many calls one block can hold, when the request allows `max_calls`."""
        return 1 if self.separator is None else max_calls

    def call(self, name: str, arguments: str) -> str:
        return f"{self.name_prefix}{name}{self.name_suffix}{arguments}{self.args_suffix}"

    def block(self, calls: Sequence[tuple[str, str]]) -> str:
        """`calls` (name, arguments as JSON text) written as the model writes them."""
        joined = (self.separator or "").join(self.call(name, args) for name, args in calls)
        return f"{self.forced_open}{joined}{self.close}"


@attrs.frozen
class ParsedCall:
    name: str
    arguments: str
    #: Where `arguments` lies in the payload, when it is the model's own text (not a JSON string).
    span: tuple[int, int] | None
    #: Where the whole call lies in the payload.
    start: int
    end: int


class CallParser(Protocol):
    """A family's streaming parser (sans-IO): decoded text in, chunks out; every token fed is
    carried by exactly one chunk or returned by `finish`."""

    @property
    def calls(self) -> int:
        """Calls read so far."""
        ...

    @property
    def called(self) -> bool: ...

    @property
    def cut(self) -> bool:
        """`finish` ended a call inside its arguments (harmony's: before its `<|call|>`).
        Read only where decoding stopped at its limit: the call was cut short, so the segment
        is `incomplete`, not a turn that called (where the turn ended, its end token is not
        fed, and this says nothing). A call whose arguments are whole is a call, its frame's
        close or not."""
        ...

    def feed(self, text: str, tokens: int = 1) -> list[Chunk]: ...

    def finish(self) -> tuple[list[Chunk], int]: ...


class ParserFactory(Protocol):
    """A family's own parser class: what the registry builds for a segment."""

    def __call__(
        self, tool_names: Collection[str], *, max_calls: int | None = ..., forced: bool = ...
    ) -> CallParser: ...


class Rendering(enum.Enum):
    """What turns a family's conversations into tokens (renderers.py builds it)."""

    #: The model's own chat template (chat_template.py).
    CHAT_TEMPLATE = "chat_template"
    #: openai-harmony's: gpt-oss has no chat template (harmony_renderer.py).
    HARMONY = "harmony"
    #: mistral-common's where the model's folder holds its `tekken.json`
    #: (mistral_renderer.py), else the chat template.
    MISTRAL_COMMON = "mistral_common"


def at_limit(chunks: list[Chunk], parser: CallParser) -> list[Chunk]:
    """`parser.finish()`'s chunks where decoding stopped at its limit: a call the limit cut
    short is not ended, so its item stays open and the segment's `incomplete` end marks it
    `incomplete` (never a `completed` call of half its arguments)."""
    if not parser.cut:
        return chunks
    last = max((i for i, chunk in enumerate(chunks) if isinstance(chunk, ToolCallEnd)), default=-1)
    return chunks if last < 0 else chunks[:last] + chunks[last + 1 :]


def object_arguments(arguments: str) -> str:
    """`arguments` as the JSON object a call holds: itself if it is one, else as a string
    (a custom tool's free-form input)."""
    return arguments if json_object(arguments) else json.dumps(arguments)


def json_object(text: str) -> bool:
    """`text` is a JSON object, nested at most `MAX_ARGUMENTS_DEPTH` deep (so reading it, here
    or in a template, cannot run out of stack)."""
    if too_deep(text):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def too_deep(text: str, depth: int = MAX_ARGUMENTS_DEPTH) -> bool:
    """`text`'s arrays and objects nest deeper than `depth` (strings aside)."""
    if text.count("[") + text.count("{") <= depth:
        return False  # too few brackets to nest that deep: no need to look
    braces, at = Braces(depth=0, limit=depth), 0
    while (end := braces.close(text, at)) is not None:
        at = end
    return braces.deep


@attrs.define
class Braces:
    """Where a scan of a JSON value's brackets stands (outside strings), from just past its
    `{`: resumed on each piece, so a value is scanned once however it is split. A value that
    nests deeper than `limit` stops the scan (`deep`)."""

    depth: int = 1
    in_string: bool = False
    escaped: bool = False
    deep: bool = False
    limit: int = MAX_ARGUMENTS_DEPTH

    def close(self, text: str, start: int) -> int | None:
        """Where the value ends (past its closing bracket), scanning from `start`; None: not in
        `text` yet (the scan goes on from its end), or `deep`."""
        at = start
        if self.escaped and at < len(text):
            self.escaped, at = False, at + 1
        while not self.deep and (found := _JSON_MARKS.search(text, at)) is not None:
            at = found.start()
            char = text[at]
            if self.in_string:
                if char == "\\":
                    if at + 1 == len(text):
                        self.escaped = True
                        return None
                    at += 1  # the escaped character is no mark
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
                self.deep = self.depth > self.limit
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
            at += 1
        return None


@attrs.define
class Quote:
    """Where a scan of a JSON string stands, from just past its opening quote: resumed on each
    piece, so a string is scanned once however it is split."""

    escaped: bool = False

    def end(self, text: str, start: int) -> int | None:
        """Where the string ends (past its closing quote), scanning from `start`; None: not in
        `text` yet."""
        at = start
        if self.escaped and at < len(text):
            self.escaped, at = False, at + 1
        while (found := _STRING_MARKS.search(text, at)) is not None:
            at = found.start()
            if text[at] == '"':
                return at + 1
            if at + 1 == len(text):
                self.escaped = True
                return None
            at += 2
        return None


def tool_specs(tools: Sequence[FunctionTool]) -> str:
    """The offered tools as the JSON list a system prompt shows them in."""
    return json.dumps(
        [
            {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.parameters or {"type": "object", "properties": {}},
            }
            for tool in tools
        ]
    )


class ToolSyntax:
    """One family's call syntax (module docstring); subclasses set the class attributes."""

    #: The `--tool-syntax` value that picks it.
    name: str
    frame: CallFrame
    #: The role a tool's output is shown under when the template has no tool role of its own.
    output_role: str = "tool"
    #: The chat template reads a call's arguments as JSON text (else as an object).
    template_arguments_text: bool = False
    #: The content of an assistant message that only calls (some templates test for None).
    call_content: str | None = ""
    #: What a constrained answer (a structured one, no call allowed) opens with, put in the
    #: prompt rather than decoded: where the family writes its answer under a header.
    answer_head: str = ""
    #: The parser of its calls where it has one of its own; None: its frame's (framed.py).
    own_parser: ClassVar[ParserFactory | None] = None
    #: What renders its conversations.
    rendering: Rendering = Rendering.CHAT_TEMPLATE

    def answer_prompt(self, limits: GenerationLimits, tools: Sequence[FunctionTool]) -> str:
        """What a segment's prompt ends with past the generation prompt, so that the model is
        not asked to decode it: a structured answer's header where no call is allowed."""
        if limits.text_format is None or limits.must_call or (tools and limits.max_calls != 0):
            return ""
        return self.answer_head

    def describe_tools(self, tools: Sequence[FunctionTool]) -> str:
        """The system-prompt text that offers `tools`, for a template that does not take them."""
        example = self.frame.block([("tool_name", '{"argument": "value"}')])
        return (
            "You have access to the following tools:\n"
            f"<tools>{tool_specs(tools)}</tools>\n\n"
            f"To call tools, answer with only this, and nothing after it:\n{example}"
        )

    def call_text(self, name: str, arguments: str) -> str:
        """A call written as the model writes it, so a rendered call matches its tokens."""
        return self.frame.block([(name, object_arguments(arguments))])

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str | None:
        """A turn's calls (name, arguments) written as the model writes them, in one block;
        None where a block holds one call and these are more."""
        if self.frame.separator is None and len(calls) > 1:
            return None
        return self.frame.block([(name, object_arguments(arguments)) for name, arguments in calls])

    def stop_ids(self, tokenizer: Any, configured: int | Sequence[int] | None) -> frozenset[int]:
        """The ids that end the model's turn (`tokens.stop_ids`)."""
        return stop_ids(tokenizer, configured)

    def stop(self, max_calls: int | None) -> list[str]:
        """What the engine stops at once a call is complete: the block's close, if it has
        one, unless the request allows another call and the family writes the next one
        after the close (Qwen's form: a tag pair a call): the engine then goes on to the end
        of the model's turn, and what the model writes after its calls is not said."""
        frame = self.frame
        if not frame.close:
            return []
        if max_calls != 1 and (frame.separator or "").startswith(frame.close):
            return []
        return [frame.close]


def call_chunks(
    payload: str, calls: Sequence[ParsedCall], marks: Sequence[tuple[int, int]]
) -> list[Chunk]:
    """Begin, argument deltas and end per call, each piece's tokens (`marks`: its offset in
    `payload`, its tokens) on the chunk it opens: pieces before a call's arguments go to its
    begin, those after the last call's arguments to its last delta."""
    chunks: list[Chunk] = []
    at = 0  # the first mark not yet given to a chunk (marks come in the payload's order)
    for number, call in enumerate(calls):
        a_start, a_end = call.span or (call.start, call.end)
        last = number == len(calls) - 1
        begin = 0
        while at < len(marks) and marks[at][0] < a_start:
            begin += marks[at][1]
            at += 1
        chunks.append(ToolCallBegin(call.name, begin))
        first = at
        while at < len(marks) and marks[at][0] < a_end:
            at += 1
        inside = marks[first:at]
        after = sum(t for _, t in marks[at:]) if last else 0
        if call.span is None:
            chunks.append(ToolCallArgumentsDelta(call.arguments, sum(t for _, t in inside)))
        else:
            cuts = sorted({a_start, *(o for o, _ in inside), a_end})
            tokens_at: dict[int, int] = defaultdict(int)
            for offset, tokens in inside:
                tokens_at[offset] += tokens
            for left, right in itertools.pairwise(cuts):
                chunks.append(ToolCallArgumentsDelta(payload[left:right], tokens_at.get(left, 0)))
        if after:
            final = chunks[-1]
            assert isinstance(final, ToolCallArgumentsDelta)
            chunks[-1] = ToolCallArgumentsDelta(final.delta, final.tokens + after)
        chunks.append(ToolCallEnd())
    return chunks
