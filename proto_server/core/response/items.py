"""A Response's output items: the message or reasoning item whose text streams, the tool call
whose arguments stream, each closed with its `done` events. A finished item joins the
conversation too (the model reads it next segment); an abandoned call does not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs

from proto_server.core.conversation import Conversation
from proto_server.core.response.transitions import IllegalTransition
from proto_server.core.trace import Sampled, SegmentTokens, Trace, token_fields
from proto_server.wire.events import (
    CompactionCompacting,
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ServerEvent,
)
from proto_server.wire.items import (
    FunctionCall,
    Item,
    Logprob,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
    UnknownItem,
)

#: The two items whose text streams: what the model says, and what it thinks first.
TextKind = Literal["message", "reasoning"]


@attrs.define
class OpenText:
    """A message or reasoning item streaming: its text so far."""

    kind: TextKind
    item_id: str
    output_index: int
    deltas: list[str] = attrs.field(factory=list)
    #: The logprobs of its tokens so far, when the client asked for them (`include`).
    logprobs: list[Logprob] | None = None
    #: Its token ids so far, when the client asked for them (`include`).
    trace: Trace | None = None

    def part(self) -> OutputText | ReasoningText:
        text = "".join(self.deltas)
        return self.output_text(text) if self.kind == "message" else ReasoningText(text=text)

    def output_text(self, text: str) -> OutputText:
        logprobs = None if self.logprobs is None else tuple(self.logprobs)
        return OutputText(text=text, logprobs=logprobs)

    def item(self, status: str, *, seal: Callable[[str], str] | None = None) -> Item:
        """The item with the text so far (none while `in_progress`); a finished reasoning
        item carries its `seal` when the client asked for it."""
        done = status != "in_progress"
        text = "".join(self.deltas)
        tokens = token_fields(self.trace, status)
        if self.kind == "message":
            content = (self.output_text(text),) if done else ()
            return Message(
                id=self.item_id, role="assistant", content=content, status=status, **tokens
            )
        return Reasoning(
            id=self.item_id,
            content=(ReasoningText(text=text),) if done else (),
            encrypted_content=seal(text) if seal is not None and done else None,
            status=status,
            **tokens,
        )


@attrs.define
class OpenCall:
    item_id: str
    output_index: int
    call_id: str
    name: str
    deltas: list[str] = attrs.field(factory=list)
    trace: Trace | None = None

    def item(self, status: str) -> FunctionCall:
        """The call so far; once done, with its token ids where they were asked."""
        return FunctionCall(
            id=self.item_id,
            call_id=self.call_id,
            name=self.name,
            arguments="".join(self.deltas),
            status=status,
            **token_fields(self.trace, status),
        )


class Output:
    """The items of one Response, in order, and the one streaming (`open`), if any.

    `new_id(prefix)` names the items (`msg_...`, `fc_...`, `call_...`); `seal(text)` makes a
    finished reasoning item's `encrypted_content`; `logprobs`: messages' text parts carry the
    logprobs of their tokens (the client asked for them); `token_ids`: every item the model
    makes carries its token ids once done (`core/trace.py`; the client asked for them)."""

    def __init__(
        self,
        conversation: Conversation,
        *,
        new_id: Callable[[str], str],
        seal: Callable[[str], str] | None,
        logprobs: bool = False,
        token_ids: bool = False,
    ) -> None:
        self.conversation = conversation
        self._new_id = new_id
        self._seal = seal
        self.logprobs = logprobs
        self.token_ids = token_ids
        self._segment = SegmentTokens()
        self.items: list[Item] = []
        self.open: OpenText | OpenCall | None = None

    @property
    def in_call(self) -> bool:
        return isinstance(self.open, OpenCall)

    def compaction(self, item: UnknownItem) -> list[ServerEvent]:
        """A server-side compaction's item, in the conversation already: only the output gets it."""
        index = len(self.items)
        self.items.append(item)
        item_id = str(item.raw.get("id"))
        return [
            OutputItemAdded(output_index=index, item=item),
            CompactionCompacting(item_id=item_id, output_index=index),
            OutputItemDone(output_index=index, item=item),
        ]

    def begin_segment(
        self, prompt_ids: tuple[int, ...] | None, weight_version: str | None = None
    ) -> None:
        """A segment begins on a prompt of `prompt_ids` (those the engine was sent), sampled
        with the weights labelled `weight_version`."""
        if self.token_ids:
            self._segment.begin(prompt_ids, weight_version)

    def _trace(self) -> Trace | None:
        return self._segment.open() if self.token_ids else None

    def end_segment(self, sampled: Sampled | None) -> None:
        """The segment's last tokens, which no chunk carried (the end of the turn): the text
        item still open, if one is, takes them; after a call they are no item's."""
        text = self.open
        self._segment.add(text.trace if isinstance(text, OpenText) else None, sampled)

    def text(
        self,
        kind: TextKind,
        delta: str,
        *,
        after_calls: bool,
        logprobs: tuple[Logprob, ...] = (),
        sampled: Sampled | None = None,
    ) -> list[ServerEvent]:
        """`delta` of `kind`: an item of that kind opens (closing one of the other) and grows.
        `after_calls`: the segment made calls already, so no text may follow them;
        `logprobs`: those of `delta`'s tokens (a message's, kept only where they were asked);
        `sampled`: their ids (kept where they were asked)."""
        if isinstance(self.open, OpenCall):
            raise IllegalTransition(f"{kind} text arrived inside a tool call")
        if after_calls:
            # a suspension must follow the calls it waits for (`response.done` ends on them)
            raise IllegalTransition(
                f"{kind} text arrived after a tool call; a segment's calls come last"
            )
        events: list[ServerEvent] = []
        if self.open is not None and self.open.kind != kind:
            events += self.close_text()
        if self.open is None:
            item_id = self._new_id("msg" if kind == "message" else "rs")
            index = len(self.items)
            self.open = OpenText(
                kind,
                item_id,
                index,
                logprobs=[] if self.logprobs and kind == "message" else None,
                trace=self._trace(),
            )
            events.append(OutputItemAdded(output_index=index, item=self.open.item("in_progress")))
            events.append(
                ContentPartAdded(
                    item_id=item_id, output_index=index, content_index=0, part=self.open.part()
                )
            )
        text = self.open
        assert isinstance(text, OpenText)
        text.deltas.append(delta)
        self._segment.add(text.trace, sampled)
        if kind == "reasoning":
            events.append(
                ReasoningTextDelta(
                    item_id=text.item_id,
                    output_index=text.output_index,
                    content_index=0,
                    delta=delta,
                )
            )
            return events
        if text.logprobs is None:
            logprobs = ()
        else:
            text.logprobs += logprobs
        events.append(
            OutputTextDelta(
                item_id=text.item_id,
                output_index=text.output_index,
                content_index=0,
                delta=delta,
                logprobs=logprobs,
            )
        )
        return events

    def begin_call(self, name: str, sampled: Sampled | None = None) -> list[ServerEvent]:
        """A call to `name` opens (closing text before it); `sampled`: the ids that opened it."""
        if self.in_call:
            raise IllegalTransition("a tool call began inside another")
        events = self.close_text()
        call = OpenCall(
            self._new_id("fc"), len(self.items), self._new_id("call"), name, trace=self._trace()
        )
        self._segment.add(call.trace, sampled)
        self.open = call
        item = FunctionCall(
            id=call.item_id, call_id=call.call_id, name=name, arguments="", status="in_progress"
        )
        events.append(OutputItemAdded(output_index=call.output_index, item=item))
        return events

    def call(self) -> OpenCall:
        """The call whose arguments stream."""
        if not isinstance(self.open, OpenCall):
            raise IllegalTransition("no tool call is open")
        return self.open

    def arguments(self, delta: str, sampled: Sampled | None = None) -> list[ServerEvent]:
        call = self.call()
        call.deltas.append(delta)
        self._segment.add(call.trace, sampled)
        return [
            FunctionCallArgumentsDelta(
                item_id=call.item_id, output_index=call.output_index, delta=delta
            )
        ]

    def end_call(self) -> tuple[FunctionCall, list[ServerEvent]]:
        """The call made: its item (done, in the conversation) and its events."""
        call = self.call()
        item = call.item("completed")
        self.open = None
        self.finish(item)
        return item, [
            FunctionCallArgumentsDone(
                item_id=call.item_id,
                output_index=call.output_index,
                name=call.name,
                arguments=item.arguments,
            ),
            OutputItemDone(output_index=call.output_index, item=item),
        ]

    def finish(self, item: Item) -> None:
        self.items.append(item)
        self.conversation.extend_turn(item)

    def close_text(self, status: str = "completed") -> list[ServerEvent]:
        """Close the message or reasoning item that is streaming, if one is."""
        text = self.open
        if not isinstance(text, OpenText):
            return []
        self.open = None
        item = text.item(status, seal=self._seal)
        part = text.part()
        self.finish(item)
        item_id, index = text.item_id, text.output_index
        if isinstance(part, OutputText):
            done: ServerEvent = OutputTextDone(
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=part.logprobs or (),
            )
        else:
            done = ReasoningTextDone(
                item_id=item_id, output_index=index, content_index=0, text=part.text
            )
        return [
            done,
            ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=part),
            OutputItemDone(output_index=index, item=item),
        ]

    def abandon(self) -> list[ServerEvent]:
        """Close whatever was streaming as `incomplete`, so every `added` gets its `done`."""
        call = self.open
        if not isinstance(call, OpenCall):
            return self.close_text("incomplete")
        self.open = None
        item = call.item("incomplete")
        self.items.append(item)  # never answered, so kept out of the conversation
        return [OutputItemDone(output_index=call.output_index, item=item)]
