"""The Conversation of a rollout: its items and their rendered tokens, extended incrementally.

Rendering is the one piece of a turn's preparation that grows with what the client sent, so it
is split from extending: `render_items` is pure and safe to run on a worker thread, and
`extend_rendered` only appends what it produced. `extend` does both, for small inputs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Sequence

import attrs

from proto_server.core.compaction import counts_of, is_compaction
from proto_server.core.render import Renderer, turn_end
from proto_server.core.trace import token_field_bytes
from proto_server.wire.carried import encoded
from proto_server.wire.items import (
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    UnknownItem,
    UnknownPart,
)
from proto_server.wire.tools import Tool

#: What an item costs in memory beyond its text: the attrs object, its strings' headers, its
#: place in the lists. Calibrated with tracemalloc (tests/server/test_memory_budget.py checks it).
ITEM_OVERHEAD_BYTES = 240
#: A content part's object and headers.
PART_OVERHEAD_BYTES = 200
#: What a carried item or part holds per byte of its JSON text: its top-level fields decoded, the
#: rest kept encoded (`wire.carried`).
RAW_JSON_FACTOR = 2
#: Tokens are kept in an `array("I")`.
TOKEN_BYTES = 4


def is_model_item(item: Item) -> bool:
    """Items the model produced (as opposed to what the user or the tools said)."""
    match item:
        case FunctionCall() | CustomToolCall():
            return True
        case Message(role="assistant") | Reasoning():
            return True
    return False


def _content_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    size = 0
    for part in content if isinstance(content, tuple) else ():
        if isinstance(part, UnknownPart):
            size += RAW_JSON_FACTOR * len(encoded(part.raw))
        else:
            size += PART_OVERHEAD_BYTES + len(getattr(part, "text", ""))
    return size


def item_bytes(item: Item) -> int:
    """About how much memory `item` holds once decoded (not its tokens): for budgets, so an
    estimate that errs on the high side, computed in one cheap pass; its token fields too."""
    return _item_bytes(item) + token_field_bytes(item)


def _item_bytes(item: Item) -> int:
    match item:
        case Message(content=content):
            return ITEM_OVERHEAD_BYTES + _content_bytes(content)
        case FunctionCall(call_id=call_id, name=name, arguments=arguments):
            return ITEM_OVERHEAD_BYTES + len(call_id) + len(name) + len(arguments)
        case CustomToolCall(call_id=call_id, name=name, input=text):
            return ITEM_OVERHEAD_BYTES + len(call_id) + len(name) + len(text)
        case (
            FunctionCallOutput(call_id=call_id, output=output)
            | CustomToolCallOutput(call_id=call_id, output=output)
        ):
            return ITEM_OVERHEAD_BYTES + len(call_id) + _content_bytes(output)
        case Reasoning(id=item_id, encrypted_content=sealed):
            extra = len(item_id or "") + len(sealed or "")
            extra += sum(PART_OVERHEAD_BYTES + len(part.text) for part in item.summary)
            return ITEM_OVERHEAD_BYTES + PART_OVERHEAD_BYTES + extra + len(item.text)
        case UnknownItem(raw=raw):
            return ITEM_OVERHEAD_BYTES + RAW_JSON_FACTOR * len(encoded(raw))
    return ITEM_OVERHEAD_BYTES


def decoded_bytes(items: Sequence[Item], *, text: bool) -> int:
    """About what `items` hold with the JSON they were decoded from still kept beside them (a
    steer keeps its input as sent, to return it): each text counted at its width in memory
    (`sys.getsizeof`, so one emoji does not make a string four times cheaper), and an item's
    decoded dict beside it unless the input was one string (`text`), which the item shares."""
    per_item = ITEM_OVERHEAD_BYTES if text else 2 * ITEM_OVERHEAD_BYTES
    size = 0
    for item in items:
        size += per_item
        content = getattr(item, "content", None)
        if isinstance(content, str):
            size += sys.getsizeof(content)
        elif isinstance(content, tuple):
            for part in content:
                if isinstance(part, UnknownPart):
                    size += RAW_JSON_FACTOR * len(encoded(part.raw))
                else:
                    size += 2 * PART_OVERHEAD_BYTES + sys.getsizeof(getattr(part, "text", ""))
        else:
            size += item_bytes(item)
    return size


def prefix_bytes(instructions: str | None, tools: Sequence[Tool]) -> int:
    """About how much memory the instructions and the tools hold."""
    return len(instructions or "") + sum(
        ITEM_OVERHEAD_BYTES + RAW_JSON_FACTOR * len(str(tool)) for tool in tools
    )


@attrs.frozen
class RenderedItems:
    """Items with their tokens, their memory estimate and what the conversation counts of
    them, ready to be appended in O(1) Python steps (the array and list copies run in C)."""

    items: tuple[Item, ...]
    tokens: array[int]
    nbytes: int
    tool_outputs: int = 0
    #: Runs of consecutive model items, and whether the first and the last item are the model's.
    model_runs: int = 0
    first_is_model: bool = False
    last_is_model: bool = False
    #: Where in `tokens` the last model item ends; -1: no model item.
    model_end: int = -1
    #: The item they were rendered after (`render_items`' `after`).
    after: Item | None = None


def render_items(
    renderer: Renderer, items: Iterable[Item], after: Item | None = None
) -> RenderedItems:
    """Render `items` without touching any conversation: pure, so it may run on a worker thread
    (tiktoken releases the GIL while it encodes). `after`: the item they follow, if any (a
    renderer may join an item to the one before it)."""
    kept = tuple(items)
    tokens = array("I")
    nbytes = tool_outputs = model_runs = 0
    model_end = -1
    previous = False
    before = after
    joined_until = 0  # the items before it were rendered with a run of outputs
    # Where a run of outputs, or of calls, that the renderer would not join ends: none of its
    # shorter tails is asked again (each would be scanned and rendered: 20,000 calls in a
    # client's history took minutes). A text's turn is asked again from its calls (DeepSeek
    # V3's template joins calls, not a text and its calls).
    apart_until = 0
    render_run = getattr(renderer, "render_run", None)
    render_turn = getattr(renderer, "render_turn", None)
    for index, item in enumerate(kept):
        if index >= joined_until:
            run = None
            if index >= apart_until:
                run, apart_until = _joined_run(kept, index, before, render_run, render_turn)
            if run is not None:
                joined_until, run_tokens = run
                tokens.extend(run_tokens)
            else:
                tokens.extend(renderer.render_item(item, before))
        before = item
        nbytes += item_bytes(item)
        model = is_model_item(item)
        if model:
            model_runs += not previous
            model_end = len(tokens)
        elif isinstance(item, FunctionCallOutput | CustomToolCallOutput):
            tool_outputs += 1
        elif is_compaction(item):  # it stands for the turns and outputs it summarized
            turns, outputs = counts_of(item)
            model_runs += turns
            tool_outputs += outputs
        previous = model
    return RenderedItems(
        kept,
        tokens,
        nbytes,
        tool_outputs=tool_outputs,
        model_runs=model_runs,
        first_is_model=bool(kept) and is_model_item(kept[0]),
        last_is_model=previous,
        model_end=model_end,
        after=after,
    )


RenderRun = Callable[[Sequence[Item], Item | None], Sequence[int] | None]
_OUTPUTS = FunctionCallOutput | CustomToolCallOutput
_CALLS = FunctionCall | CustomToolCall


def _joined_run(
    items: Sequence[Item],
    start: int,
    before: Item | None,
    render_run: RenderRun | None,
    render_turn: RenderRun | None,
) -> tuple[tuple[int, Sequence[int]] | None, int]:
    """Where `items[start:]` begins with two or more items the renderer renders together: a
    run of tool outputs (`render_run`: Qwen3's template joins them in one user message), or
    a model turn (`render_turn`: Qwen3's joins a text and the calls after it): where it ends
    and its tokens, or None; and, when it renders them apart, up to where no shorter tail
    of the run need be asked (`start` when one may). A run is one batch's (an append, a
    create): outputs a prototype client sends in several appends are rendered an append at
    a time, which a cold rebuild of the same items renders together (the known difference);
    a turn is rendered so as `Conversation.extend_turn` renders it as the model writes it."""
    item = items[start]
    is_output = isinstance(item, _OUTPUTS)
    kind = _OUTPUTS if is_output else _CALLS
    render = render_run if is_output else render_turn
    if render is None:
        return None, start
    if is_output:
        end = start + 1
        while end < len(items) and isinstance(items[end], _OUTPUTS):
            end += 1
    else:
        end = turn_end(items, start)
    if end - start < 2:
        return None, start
    joined = render(items[start:end], before)
    if joined is not None:
        return (end, joined), start
    # a tail of calls (or outputs) after a call (an output) is asked as this run was: not again
    return None, end if isinstance(item, kind) and isinstance(before, kind) else start


def counted(items: Iterable[Item]) -> tuple[int, int]:
    """The model turns (runs of model items) and the tool outputs among `items`, as a
    Conversation holding them counts them; what a compaction of them seals."""
    turns = outputs = 0
    previous = False
    for item in items:
        model = is_model_item(item)
        turns += model and not previous
        if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
            outputs += 1
        elif is_compaction(item):
            more_turns, more_outputs = counts_of(item)
            turns, outputs = turns + more_turns, outputs + more_outputs
        previous = model
    return turns, outputs


class Conversation:
    """Items in order, and the tokens they render to.

    `extend` renders only the items it is given, so a turn that appends N items costs O(N)
    whatever the history; `rendered_tokens` counts every token ever rendered, so tests and the
    benchmark can prove it. `retained_bytes` is what the conversation holds in memory, for the
    server's budgets.
    """

    def __init__(
        self,
        renderer: Renderer,
        *,
        instructions: str | None = None,
        tools: Sequence[Tool] = (),
        effort: str | None = None,
        prefix: Sequence[int] | None = None,
        prefix_nbytes: int | None = None,
    ) -> None:
        """`prefix`: the tokens of `render_prefix(instructions, tools, effort=effort)`, and
        `prefix_nbytes` their `prefix_bytes`, when counted already (off the event loop); else
        rendered and counted here."""
        self.renderer = renderer
        self.instructions = instructions
        self.tools: tuple[Tool, ...] = tuple(tools)
        #: The reasoning effort its prefix says (where the renderer says one).
        self.effort = renderer.prefix_effort(effort)
        self._items: list[Item] = []
        if prefix is None:
            prefix = renderer.render_prefix(instructions, self.tools, effort=effort)
        self.tokens = array("I", prefix)
        self.rendered_tokens = len(self.tokens)
        if prefix_nbytes is None:
            prefix_nbytes = prefix_bytes(instructions, self.tools)
        self._item_bytes = prefix_nbytes
        self.model_segments = 0
        self.tool_outputs = 0
        self.model_output_end = 0
        self._last_was_model = False
        #: The model's turn `open_turn` began: its first item's index and token, and the item
        #: it is rendered after, until anything but `extend_turn` appends.
        self._turn: tuple[int, int, Item | None] | None = None
        #: `open_turn` closed the last item's message (the renderer had left it open).
        self._closed = False

    def opens_with(
        self, instructions: str | None, tools: Sequence[Tool], effort: str | None = None
    ) -> bool:
        """Whether a turn with this prefix (instructions, tools, and the effort as the renderer
        would say it) extends this conversation rather than rebuilding it."""
        return (
            self.instructions == instructions
            and self.tools == tuple(tools)
            and self.effort == self.renderer.prefix_effort(effort)
        )

    @property
    def items(self) -> Sequence[Item]:
        return self._items

    @property
    def token_count(self) -> int:
        return len(self.tokens)

    @property
    def retained_bytes(self) -> int:
        """About how much memory the items and tokens hold (see `item_bytes`)."""
        return self._item_bytes + TOKEN_BYTES * len(self.tokens)

    @property
    def render_after(self) -> Item | None:
        """The item new items are rendered after (`render_items`' `after`): the last one,
        unless the model's turn after it began by closing its message (`open_turn`)."""
        return self._items[-1] if self._items and not self._closed else None

    def extend(self, items: Iterable[Item]) -> int:
        """Render and append new items; return how many tokens they added."""
        return self.extend_rendered(render_items(self.renderer, items, self.render_after))

    def turn_prompt(self, opening: Sequence[int]) -> list[int]:
        """The prompt of the model's next turn: the conversation, what closes its last
        message where the renderer left it open (a turn that ended in its reasoning, in
        Qwen3's template), then `opening` (the renderer's generation prompt)."""
        return [*self.tokens, *self._closing(), *opening]

    def _closing(self) -> Sequence[int]:
        closing = getattr(self.renderer, "closing", None)
        if closing is None or self._closed:
            return ()
        tokens: Sequence[int] = closing(self.render_after)
        return tokens

    def open_turn(self) -> None:
        """The model's turn begins here (after `turn_prompt`): what `extend_turn` appends
        next is what it writes. A message the renderer left open is closed first, as the
        prompt closed it, so the model's own message is not rendered as continuing it."""
        close = self._closing()
        if close:
            self.tokens.extend(close)
            self.rendered_tokens += len(close)
            self._closed = True
        self._turn = (len(self._items), len(self.tokens), self.render_after)

    def extend_turn(self, item: Item) -> int:
        """Append an item the model wrote in the turn `open_turn` began; return how the token
        count changed. Where the renderer renders a turn's items as one message
        (`render_turn`: a text and the calls after it, in Qwen3's template), the turn so far
        is rendered again with it, exactly as `render_items` renders the same items at once
        (a resume, a stateless client's history). The turn is the model's own output, so
        this is bounded by its output limit."""
        turn = self._turn
        if turn is None or len(self._items) == turn[0] or not hasattr(self.renderer, "render_turn"):
            return self._append(render_items(self.renderer, (item,), self.render_after))
        first, start, previous = turn
        rendered = render_items(self.renderer, [*self._items[first:], item], previous)
        before = len(self.tokens)
        del self.tokens[start:]
        self.tokens.extend(rendered.tokens)
        self.rendered_tokens += len(rendered.tokens)
        self._items.append(item)
        self._item_bytes += item_bytes(item)
        if rendered.model_end >= 0:
            self.model_output_end = start + rendered.model_end
        self._last_was_model = rendered.last_is_model  # the turn goes on: no new segment
        return len(self.tokens) - before

    def extend_rendered(self, rendered: RenderedItems) -> int:
        """Append items rendered by `render_items`; return how many tokens they added. Items
        rendered after another item than a last reasoning item are rendered again after it
        (a renderer may join them: Qwen3's reasoning and the call after it are one message).
        What is appended so ends the model's turn (`open_turn`)."""
        self._turn = None
        return self._append(rendered)

    def _append(self, rendered: RenderedItems) -> int:
        if not rendered.items:
            return 0
        last = self.render_after
        if isinstance(last, Reasoning) and rendered.after is not last:
            rendered = render_items(self.renderer, rendered.items, last)
        before = len(self.tokens)
        self.tokens.extend(rendered.tokens)
        self.rendered_tokens += len(rendered.tokens)
        self._items.extend(rendered.items)
        self._closed = False
        self._item_bytes += rendered.nbytes
        self.tool_outputs += rendered.tool_outputs
        # a run of model items that continues the last one is not a new segment
        self.model_segments += rendered.model_runs - (
            self._last_was_model and rendered.first_is_model
        )
        if rendered.model_end >= 0:
            self.model_output_end = before + rendered.model_end
        self._last_was_model = rendered.last_is_model
        return len(self.tokens) - before
