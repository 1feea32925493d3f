"""What a client's `response.append` or `response.inject` may carry: outputs for calls that
await them, each once (an output held while its segment streams counts as given), and, for an
append, messages once no call is left unanswered. Each check raises the client's
`ProtocolError`, naming the field, and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

from proto_server.core.response.held import Held
from proto_server.wire.errors import ProtocolError, quoted, some_of
from proto_server.wire.events import RequiredInput
from proto_server.wire.items import (
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
)


class Calls:
    """The calls a Response made, in order: those awaiting output, those answered, and those
    whose injected output is `held` for the segment's end (which count as answered here)."""

    def __init__(self, response_id: str, held: Held) -> None:
        self.response_id = response_id
        self.held = held
        self.pending: dict[str, Item] = {}
        self.answered: set[str] = set()

    def made(self, call: FunctionCall) -> None:
        self.pending[call.call_id] = call

    def answer(self, items: Sequence[Item]) -> None:
        """The outputs among `items` (checked) answer their calls."""
        for item in items:
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                del self.pending[item.call_id]
                self.answered.add(item.call_id)

    @property
    def all_held(self) -> bool:
        """Every call awaiting output has one held already."""
        return self.pending.keys() <= self.held.ids

    def required_input(self) -> tuple[RequiredInput, ...]:
        """Stubs of the outputs the Response waits for (none held already)."""
        return tuple(
            RequiredInput(call_id=call_id, name=getattr(item, "name", ""))
            for call_id, item in self.pending.items()
            if call_id not in self.held.ids
        )

    def check_append(self, items: Sequence[Item]) -> None:
        if not items:
            raise ProtocolError(
                "invalid_field", "`input` is empty; append at least one item.", param="input"
            )
        answering: set[str] = set()
        has_message = False
        for index, item in enumerate(items):
            param = f"input[{index}]"
            if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                self._check_output(item.call_id, param, answering)
            elif isinstance(item, Message) and item.role != "assistant":
                has_message = True
            else:
                raise ProtocolError(
                    "invalid_field",
                    f"`{param}` is a {item.type!r} item; response.append takes "
                    "function_call_output, custom_tool_call_output and message items.",
                    param=f"{param}.type",
                )
        still_pending = self.pending.keys() - answering
        if has_message and still_pending:
            raise ProtocolError(
                "missing_tool_output",
                "A new message cannot resume the Response while calls await output: "
                f"{some_of(sorted(still_pending))}. Send their outputs first or in the same "
                "append.",
                param="input",
            )

    def check_inject(self, items: Sequence[Item]) -> None:
        """An inject carries only tool outputs, and may come while the segment streams."""
        if not items:
            raise ProtocolError(
                "invalid_field", "`input` is empty; inject at least one item.", param="input"
            )
        answering: set[str] = set()
        for index, item in enumerate(items):
            param = f"input[{index}]"
            if not isinstance(item, FunctionCallOutput | CustomToolCallOutput):
                raise ProtocolError(
                    "invalid_field",
                    f"`{param}` is a {item.type!r} item; response.inject takes client tool "
                    "outputs (function_call_output, custom_tool_call_output).",
                    param=f"{param}.type",
                )
            self._check_output(item.call_id, param, answering)

    def _check_output(self, call_id: str, param: str, answering: set[str]) -> None:
        """One output answers a call that awaits it, once; it joins `answering`."""
        if call_id in answering or call_id in self.answered or call_id in self.held.ids:
            raise ProtocolError(
                "duplicate_call_id",
                f"Call {quoted(call_id)} was already answered; send each output once.",
                param=f"{param}.call_id",
            )
        if call_id not in self.pending:
            awaiting = [c for c in self.pending if c not in self.held.ids]
            raise ProtocolError(
                "unknown_call_id",
                f"No call {quoted(call_id)} is awaiting output in response "
                f"{self.response_id}; awaiting: {some_of(awaiting)}.",
                param=f"{param}.call_id",
            )
        answering.add(call_id)
