"""What the generator produced, streamed as the Response's output: the model's text and
reasoning as they grow, and its tool calls, each call one of the machine's (`Streamed`, a part
of `ResponseMachine`). Each call returns the events it causes, or raises `IllegalTransition` when
the Response is not streaming: the generator misbehaved, and nothing changed."""

from __future__ import annotations

from proto_server.core.response.answers import Calls
from proto_server.core.response.items import Output, TextKind
from proto_server.core.response.status import Status
from proto_server.core.response.transitions import IllegalTransition
from proto_server.core.response.usage import Tokens
from proto_server.core.trace import Sampled
from proto_server.wire.events import ServerEvent
from proto_server.wire.items import Logprob


class Streamed:
    """`ResponseMachine`'s calls for what its generator produced, over the parts it keeps."""

    status: Status
    _items: Output
    _tokens: Tokens
    _calls: Calls
    _tool_calls: int

    @property
    def logprobs(self) -> bool:
        """The client asked for logprobs: each segment's generator is asked for them."""
        return self._items.logprobs

    @property
    def token_ids(self) -> bool:
        """The client asked for token ids: each segment's generator is asked for them."""
        return self._items.token_ids

    def text_delta(
        self,
        delta: str,
        *,
        tokens: int,
        logprobs: tuple[Logprob, ...] = (),
        sampled: Sampled | None = None,
    ) -> list[ServerEvent]:
        """The model speaks: an assistant message opens (closing reasoning before it) and grows;
        `logprobs`, those of its tokens, and `sampled`, their ids, are kept where the client
        asked for them."""
        return self._stream_text("message", delta, tokens, logprobs, sampled)

    def reasoning_delta(
        self, delta: str, *, tokens: int, sampled: Sampled | None = None
    ) -> list[ServerEvent]:
        """The model thinks: a `reasoning` item opens (closing text before it) and grows; its
        tokens are reasoning tokens too."""
        events = self._stream_text("reasoning", delta, tokens, (), sampled)
        self._tokens.reasoning += tokens
        return events

    def _stream_text(
        self,
        kind: TextKind,
        delta: str,
        tokens: int,
        logprobs: tuple[Logprob, ...] = (),
        sampled: Sampled | None = None,
    ) -> list[ServerEvent]:
        self._require_streaming(f"stream {kind} text")
        events = self._items.text(
            kind, delta, after_calls=bool(self._calls.pending), logprobs=logprobs, sampled=sampled
        )
        self._tokens.output += tokens
        return events

    def begin_function_call(
        self, name: str, *, tokens: int = 0, sampled: Sampled | None = None
    ) -> list[ServerEvent]:
        self._require_streaming("call a tool")
        events = self._items.begin_call(name, sampled)
        self._tokens.output += tokens
        return events

    def function_call_arguments_delta(
        self, delta: str, *, tokens: int, sampled: Sampled | None = None
    ) -> list[ServerEvent]:
        self._require_streaming("stream tool-call arguments")
        events = self._items.arguments(delta, sampled)
        self._tokens.output += tokens
        return events

    def end_function_call(self) -> list[ServerEvent]:
        self._require_streaming("stream tool-call arguments")
        item, events = self._items.end_call()
        self._calls.made(item)
        self._tool_calls += 1
        return events

    def _require_streaming(self, what: str) -> None:
        if self.status is not Status.IN_PROGRESS:
            raise IllegalTransition(f"cannot {what} while {self.status.value}")
