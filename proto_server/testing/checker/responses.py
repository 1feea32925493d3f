"""The checker's model of a connection's Responses, built from the server's events alone.

Each Response keeps its items (with the deltas that built their texts and arguments), the calls
waiting for output, its usage and where its current segment began; `Responses` holds them all
and checks what the events say about them: items open and close in order and their done texts
equal their deltas (invariant 3), suspensions follow calls (4), call ids are never reused (5),
usage only grows and adds up (6), and every snapshot matches what streamed. It knows nothing of
what the client sent: whether an event answers a frame is the ledger's to say.

The item events build the `Item` and `Response` records that the
snapshot and usage checks compare with, and a snapshot must repeat exactly what the deltas built.
So what builds the records and what checks against them (invariants 3 to 6) are read together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from proto_server.testing.checker.invariants import Broken, Dialect

TERMINAL_EVENTS: Mapping[str, str] = {
    "response.completed": "completed",
    "response.failed": "failed",
    "response.incomplete": "incomplete",
    "response.cancelled": "cancelled",
}
CALL_TYPES = frozenset({"function_call", "custom_tool_call"})
#: The text events, and the item type each streams in.
TEXT_EVENTS = {
    "response.output_text.delta": "message",
    "response.output_text.done": "message",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_text.done": "reasoning",
}


@functools.cache
def _encoding() -> Any:
    from proto_server.core.tokenizer import o200k_base

    return o200k_base()


def o200k_count(text: str) -> int:
    """Tokens in `text` by OpenAI's o200k_base: what this server counts `output_tokens` with."""
    return len(_encoding().encode_ordinary(text))


@attrs.define
class Item:
    """One output item as its events built it: what its done event and snapshots must repeat."""

    index: int
    id: str
    type: str
    call_id: str | None
    name: str | None
    parts: list[list[str]] = attrs.field(factory=list)  # message: deltas per content part
    parts_open: set[int] = attrs.field(factory=set)
    texts_done: set[int] = attrs.field(factory=set)
    arguments: list[str] = attrs.field(factory=list)  # tool call: argument (or input) deltas
    arguments_done: bool = False
    done: bool = False


@attrs.define
class Response:
    """One Response: its phase, its items, the calls it waits on, and its usage so far."""

    id: str
    phase: str = "streaming"  # streaming | suspended | resuming | a terminal status
    items: list[Item] = attrs.field(factory=list)
    segment_start: int = 0
    pending: dict[str, int] = attrs.field(factory=dict)  # call_id -> output_index
    answered: set[str] = attrs.field(factory=set)
    cancel_frame: int | None = None  # the accepted response.cancel, until it takes effect
    usage: tuple[int, int, int] = (0, 0, 0)  # input, cached, output
    segment_base: tuple[int, int] = (0, 0)
    last_prompt: int | None = None
    told_ended: int | None = None  # a frame refused as too late while it still streamed
    waits: bool = False  # multi-agent beta: it waits silently on its calls for injects
    injected: bool = False  # outputs were injected while this segment streamed

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_EVENTS.values()

    @property
    def open_item(self) -> Item | None:
        return next((item for item in self.items if not item.done), None)

    @property
    def waiting_on_injects(self) -> bool:
        """A beta Response waiting silently (no `response.done`) for its calls' outputs."""
        return bool(self.waits and self.pending and self.open_item is None)

    def answer(self, call_id: str) -> None:
        """An output for `call_id` was accepted: the call waits no more."""
        del self.pending[call_id]
        self.answered.add(call_id)


class Responses:
    """Every Response of one connection (or lane), and the one its events are about now."""

    def __init__(self, *, dialect: Dialect, count_tokens: Callable[[str], int] | None) -> None:
        self.dialect = dialect
        self.count_tokens = count_tokens
        self.by_id: dict[str, Response] = {}
        self.current: Response | None = None

    def adopt(self, response: Mapping[str, Any]) -> None:
        """Start from a suspension another connection saw: `response` is the Response object of
        its last `response.done`. Its output is closed, its usage kept, and the calls of its last
        segment wait."""
        rid = response.get("id")
        if not isinstance(rid, str) or rid in self.by_id:
            raise ValueError(f"cannot resume {rid!r} on this checker")
        r = Response(rid, phase="suspended")
        output = [item for item in response.get("output") or () if isinstance(item, Mapping)]
        for index, item in enumerate(output):
            adopted = Item(index, str(item.get("id")), str(item.get("type")),
                           item.get("call_id"), item.get("name"), done=True)  # fmt: skip
            if adopted.type == "message":
                adopted.parts = [[part.get("text", "")] for part in item.get("content") or ()]
            elif adopted.type in CALL_TYPES:
                adopted.arguments = [str(item.get("arguments", item.get("input", "")))]
                adopted.arguments_done = True
            r.items.append(adopted)
        waiting = len(r.items)
        while waiting and r.items[waiting - 1].type in CALL_TYPES:
            waiting -= 1  # a segment's calls come last: those of the last one wait
        r.pending = {i.call_id: i.index for i in r.items[waiting:] if i.call_id is not None}
        r.answered = {i.call_id for i in r.items[:waiting] if i.call_id is not None}
        r.segment_start = len(r.items)
        usage = response.get("usage")
        if isinstance(usage, Mapping):
            r.usage = (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                       usage["output_tokens"])  # fmt: skip
            r.segment_base = r.usage[:2]
        self.by_id[rid] = r
        self.current = r

    # -- a Response's life -----------------------------------------------------------------------

    def begin(self, rid: str, response: Mapping[str, Any]) -> Response:
        """`response.created`: a new Response, once the one before it has ended."""
        current = self.current
        if current is not None and not current.terminal:
            raise Broken(
                2, f"response.created while Response {current.id} is still {current.phase}"
            )
        if response.get("status") not in ("in_progress", "queued"):
            raise Broken(2, f"a new Response has status {response.get('status')!r}")
        if response.get("output"):
            raise Broken(3, "a new Response already has output")
        r = Response(rid)
        self.by_id[rid] = r
        self.current = r
        return r

    def own(self, obj: Mapping[str, Any]) -> Response:
        """The Response a response-level event is about: the connection's current one."""
        rid = response_object(obj).get("id")
        current = self.current
        if current is None or rid != current.id:
            known = rid in self.by_id
            raise Broken(2, f"{obj['type']} for {'an ended' if known else 'an unknown'} Response")
        return current

    def cut_by_steer(self, r: Response, obj: Mapping[str, Any]) -> None:
        """A steer cut the segment (or came as it ended), in the prototype dialect: the same
        Response goes on with a new segment, announced by `obj` (`response.in_progress`)."""
        if r.open_item is not None:
            raise Broken(3, f"a steer cut the segment with item {r.open_item.id} still open")
        self.check_usage(r, response_object(obj))
        if r.usage[0] > r.segment_base[0]:  # cut before its prefill: no prompt to compare
            r.last_prompt = r.usage[0] - r.segment_base[0]
        r.segment_base = r.usage[:2]
        if r.pending:
            raise Broken(4, f"a steer cut Response {r.id} while calls await output")
        r.segment_start = len(r.items)

    def resume(self, r: Response) -> None:
        """A suspended Response streams again: only once no call waits."""
        if r.pending:
            waiting = ", ".join(r.pending)
            raise Broken(4, f"Response {r.id} resumed while calls still await output: {waiting}")
        r.phase = "streaming"
        r.injected = False
        r.segment_start = len(r.items)
        r.segment_base = r.usage[:2]

    def resume_silently(self, r: Response, obj: Mapping[str, Any]) -> None:
        """`response.in_progress` inside a stream: a Response that waited silently on its calls
        (the multi-agent beta) or had outputs injected resumes with a new segment."""
        if not (r.waits or r.injected):
            raise Broken(2, f"response.in_progress inside a segment of Response {r.id}")
        segment = r.items[r.segment_start :]
        if not segment or segment[-1].type not in CALL_TYPES:
            raise Broken(4, f"Response {r.id} resumed after a segment that called no tool")
        if r.pending:
            waiting = ", ".join(r.pending)
            raise Broken(4, f"Response {r.id} resumed while calls still await output: {waiting}")
        self.close_segment(r, obj)
        r.segment_start = len(r.items)
        r.injected = False

    def suspend(self, r: Response, obj: Mapping[str, Any]) -> None:
        """`response.done`: the segment ended in tool calls, and the Response waits on them."""
        if r.phase != "streaming":
            raise Broken(4, f"response.done while Response {r.id} is {r.phase}")
        if r.told_ended is not None:
            raise Broken(
                7, f"frame #{r.told_ended} was told Response {r.id} had ended; it suspended"
            )
        self.close_segment(r, obj)
        segment = r.items[r.segment_start :]
        if not segment or segment[-1].type not in CALL_TYPES:
            raise Broken(4, "response.done after a segment whose last item is not a tool call")
        if not r.pending:
            raise Broken(4, "response.done with no call awaiting output")
        self.check_snapshot(r, obj, "in_progress")
        r.phase = "suspended"

    def check_end(self, r: Response, obj: Mapping[str, Any], status: str) -> None:
        """A terminal event (`status`) may end `r`: it has not ended, its items are closed, a
        completed one waits on no call it must, and a failure or an incompletion says why."""
        if r.terminal:
            raise Broken(2, f"Response {r.id} already ended ({r.phase})")
        if status == "completed":
            if r.phase != "streaming":
                raise Broken(4, f"response.completed while Response {r.id} is {r.phase}")
            self.close_segment(r, obj)
            if (self.dialect == "prototype" or r.waits) and r.pending:
                raise Broken(4, f"Response {r.id} completed with calls awaiting output")
        elif r.open_item is not None:
            raise Broken(3, f"Response {r.id} ended with item {r.open_item.id} still open")
        response = response_object(obj)
        if status == "failed" and not error_detail_ok(response.get("error")):
            raise Broken(2, "response.failed without an error {type, code, message}")
        if status == "incomplete":
            details = response.get("incomplete_details")
            if not isinstance(details, Mapping) or not details.get("reason"):
                raise Broken(2, "response.incomplete without incomplete_details.reason")

    def end(self, r: Response, obj: Mapping[str, Any], status: str) -> None:
        """`r` ended with `status`, its final snapshot in `obj` (checked by `check_end`)."""
        self.check_snapshot(r, obj, status)
        r.phase = status
        r.cancel_frame = None

    def close_segment(self, r: Response, obj: Mapping[str, Any]) -> None:
        """A segment ended: nothing left open, and its prompt no shorter than the last one's."""
        if r.open_item is not None:
            raise Broken(3, f"the segment ended with item {r.open_item.id} still open")
        response = response_object(obj)
        self.check_usage(r, response)
        prompt = r.usage[0] - r.segment_base[0]
        cached = r.usage[1] - r.segment_base[1]
        if response.get("usage") is None:
            return
        if cached > prompt:
            raise Broken(6, f"this segment reports {cached} cached of {prompt} input tokens")
        if self.dialect == "prototype" and r.last_prompt is not None and prompt <= r.last_prompt:
            raise Broken(
                6,
                f"a resumed segment read a prompt of {prompt} tokens, no more than the "
                f"previous segment's {r.last_prompt}: the conversation only grows",
            )
        r.last_prompt = prompt
        r.segment_base = r.usage[:2]

    # -- events of an item -----------------------------------------------------------------------

    def item_event(self, obj: Mapping[str, Any]) -> None:
        """An event of an output item (or of a `response.` kind this checker does not know)."""
        r = self._streaming()
        kind = obj["type"]
        index = obj.get("output_index")
        if kind == "response.output_item.added":
            self._item_added(r, obj, index)
            return
        if not isinstance(index, int) or not 0 <= index < len(r.items):
            raise Broken(3, f"{kind} for output_index {index!r}, which was never added")
        item = r.items[index]
        if item.done:
            raise Broken(3, f"{kind} after output_item.done of item {item.id}")
        if kind == "response.output_item.done":
            self._item_done(r, item, obj)
            return
        if obj.get("item_id") != item.id:
            raise Broken(3, f"{kind} names item {obj.get('item_id')!r}, but {index} is {item.id}")
        if kind in ("response.content_part.added", "response.content_part.done"):
            self._content_part(item, obj)
        elif kind in TEXT_EVENTS:
            text = kind.split(".")[1]  # output_text, reasoning_text
            if item.type != TEXT_EVENTS[kind]:
                raise Broken(3, f"{kind} inside a {item.type} item")
            part = self._open_part(item, obj)
            if kind.endswith(".delta"):
                if part in item.texts_done:
                    raise Broken(3, f"a {text}.delta after its {text}.done")
                item.parts[part].append(_text(obj, "delta"))
            else:
                if obj.get("text") != "".join(item.parts[part]):
                    raise Broken(3, f"{text}.done's text is not the concatenated deltas")
                item.texts_done.add(part)
        elif kind in (
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
        ):
            expected = "function_call" if "function_call" in kind else "custom_tool_call"
            if item.type != expected:
                raise Broken(3, f"{kind} inside a {item.type} item")
            if item.arguments_done:
                raise Broken(3, f"{kind} after the arguments were done")
            if kind.endswith(".delta"):
                item.arguments.append(_text(obj, "delta"))
            else:
                field = "arguments" if expected == "function_call" else "input"
                if obj.get(field) != "".join(item.arguments):
                    raise Broken(3, f"{kind}'s {field} is not the concatenated deltas")
                if expected == "function_call" and obj.get("name") != item.name:
                    raise Broken(3, f"{kind} names {obj.get('name')!r}, the item {item.name!r}")
                item.arguments_done = True

    def _streaming(self) -> Response:
        r = self.current
        if r is None:
            raise Broken(2, "an item event before any response.created")
        if r.terminal:
            raise Broken(2, f"an item event after Response {r.id} ended ({r.phase})")
        if r.phase != "streaming":
            raise Broken(4, f"an item event while Response {r.id} is {r.phase}")
        return r

    def _item_added(self, r: Response, obj: Mapping[str, Any], index: Any) -> None:
        if r.open_item is not None:
            raise Broken(3, f"an item was added while item {r.open_item.id} is still open")
        if index != len(r.items):
            raise Broken(
                4, f"output_index {index!r} does not continue the output at {len(r.items)}"
            )
        raw = obj.get("item")
        if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
            raise Broken(3, "output_item.added without an item id")
        if any(item.id == raw["id"] for r2 in self.by_id.values() for item in r2.items):
            raise Broken(3, f"item id {raw['id']} was used before")
        item_type = str(raw.get("type"))
        call_id = raw.get("call_id")
        if item_type in CALL_TYPES:
            if not isinstance(call_id, str) or not call_id:
                raise Broken(5, f"a {item_type} without a call_id")
            if any(i.call_id == call_id for r2 in self.by_id.values() for i in r2.items):
                raise Broken(5, f"call_id {call_id} was emitted before")
        name = raw.get("name")
        r.items.append(
            Item(index, raw["id"], item_type, call_id, name if isinstance(name, str) else None)
        )

    def _content_part(self, item: Item, obj: Mapping[str, Any]) -> None:
        if item.type not in ("message", "reasoning"):
            raise Broken(3, f"a content part inside a {item.type} item")
        part = obj.get("content_index")
        if obj["type"].endswith(".added"):
            if part != len(item.parts) or item.parts_open:
                raise Broken(3, f"content_part.added at content_index {part!r} out of order")
            item.parts.append([])
            item.parts_open.add(part)
            return
        part = self._open_part(item, obj)
        text = "".join(item.parts[part])
        if part not in item.texts_done:
            raise Broken(3, "content_part.done before its text's .done")
        shown = obj.get("part")
        if not isinstance(shown, Mapping) or shown.get("text") != text:
            raise Broken(3, "content_part.done's text is not the concatenated deltas")
        item.parts_open.discard(part)

    def _open_part(self, item: Item, obj: Mapping[str, Any]) -> int:
        part = obj.get("content_index")
        if not isinstance(part, int) or part not in item.parts_open:
            raise Broken(3, f"{obj['type']} outside an open content part ({part!r})")
        return part

    def _item_done(self, r: Response, item: Item, obj: Mapping[str, Any]) -> None:
        raw = obj.get("item")
        if not isinstance(raw, Mapping) or raw.get("id") != item.id:
            raise Broken(3, f"output_item.done does not close item {item.id}")
        if raw.get("type") != item.type:
            raise Broken(3, f"item {item.id} was added as {item.type}, done as {raw.get('type')}")
        if item.parts_open:
            raise Broken(3, f"output_item.done while content part(s) {item.parts_open} are open")
        if item.type in ("message", "reasoning"):
            content = raw.get("content")
            texts = [p.get("text") for p in content if isinstance(p, Mapping)] if content else []
            if texts != ["".join(deltas) for deltas in item.parts]:
                raise Broken(3, f"the done {item.type}'s text is not the concatenated deltas")
        elif item.type in CALL_TYPES:
            field = "arguments" if item.type == "function_call" else "input"
            if raw.get(field) != "".join(item.arguments):
                raise Broken(3, f"the done call's {field} is not the concatenated deltas")
            if raw.get("call_id") != item.call_id or raw.get("name") != item.name:
                raise Broken(
                    5, f"item {item.id} changed its call_id or name between added and done"
                )
            if raw.get("status") == "completed":
                assert item.call_id is not None
                r.pending[item.call_id] = item.index
        item.done = True

    # -- snapshots and usage ---------------------------------------------------------------------

    def check_snapshot(self, r: Response, obj: Mapping[str, Any], status: str) -> None:
        """The Response object `obj` carries has `status`, exactly the items streamed (or, in
        the prototype dialect, none: a snapshot over `--max-event-bytes` leaves them out, its
        clients having every item from its `response.output_item.done`), and usage that adds
        up."""
        response = response_object(obj)
        if response.get("status") != status:
            raise Broken(2, f"{obj['type']} carries status {response.get('status')!r}")
        output = response.get("output")
        ids = [i.get("id") for i in output if isinstance(i, Mapping)] if output else []
        omitted = not ids and self.dialect == "prototype"
        if not omitted and ids != [item.id for item in r.items]:
            raise Broken(3, f"the Response's output {ids} is not the items streamed")
        self.check_usage(r, response)

    def check_usage(self, r: Response, response: Mapping[str, Any]) -> None:
        """Usage, where a Response object carries it: totals add up, nothing goes down, and
        (with `count_tokens`) output_tokens counts exactly what streamed."""
        usage = response.get("usage")
        if usage is None:
            return
        try:
            input_tokens = usage["input_tokens"]
            cached = usage["input_tokens_details"]["cached_tokens"]
            output = usage["output_tokens"]
            total = usage["total_tokens"]
        except (KeyError, TypeError):
            raise Broken(6, "usage lacks input, cached, output or total tokens") from None
        if total != input_tokens + output:
            raise Broken(6, f"total_tokens {total} is not input {input_tokens} + output {output}")
        if cached > input_tokens:
            raise Broken(6, f"cached_tokens {cached} exceed input_tokens {input_tokens}")
        now = (input_tokens, cached, output)
        if any(a < b for a, b in zip(now, r.usage, strict=True)):
            raise Broken(6, f"usage went down from {r.usage} to {now} (input, cached, output)")
        r.usage = now
        details = usage.get("output_tokens_details")
        reasoning = details.get("reasoning_tokens", 0) if isinstance(details, Mapping) else 0
        if not isinstance(reasoning, int) or not 0 <= reasoning <= output:
            raise Broken(6, f"reasoning_tokens {reasoning!r} is not within output {output}")
        if self.count_tokens is not None:
            streamed = sum(self._tokens(item) for item in r.items)
            if output != streamed:
                raise Broken(6, f"output_tokens is {output}, but what streamed counts {streamed}")
            thought = sum(self._tokens(item) for item in r.items if item.type == "reasoning")
            if reasoning != thought:
                raise Broken(6, f"reasoning_tokens is {reasoning}, but reasoning counts {thought}")

    def _tokens(self, item: Item) -> int:
        count = self.count_tokens
        assert count is not None
        if item.type in ("message", "reasoning"):
            return sum(count("".join(deltas)) for deltas in item.parts)
        if item.type in CALL_TYPES:
            return count(item.name or "") + count("".join(item.arguments))
        return 0


def response_object(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The Response object a response-level event carries."""
    response = obj.get("response")
    if not isinstance(response, Mapping):
        raise Broken(2, f"{obj.get('type')} without a response object")
    return response


def error_detail_ok(detail: Any) -> bool:
    """An error object as the protocol has it: a non-empty type, code and message."""
    return isinstance(detail, Mapping) and all(
        isinstance(detail.get(key), str) and detail.get(key) for key in ("type", "code", "message")
    )


def _text(obj: Mapping[str, Any], field: str) -> str:
    value = obj.get(field)
    if not isinstance(value, str):
        raise Broken(3, f"{obj['type']} without a string {field}")
    return value
