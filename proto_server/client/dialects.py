"""What differs between the dialects, from the client's side: one small strategy each.

Everything else (events, segments, pending calls, timings) is the same for all three, so the
rollout handle and its tracker ask the dialect only these questions:

- what the connection's handshake says (`headers`), and whether it is a WebSocket at all;
- whether the rollout is one Response (`one_response`: the prototype's suspended Response keeps
  each partial answer and adds its usage up; a completed Response is the end), or a chain of
  Responses, one a turn, where a completed one that ends in calls is a suspension;
- the frame that starts a rollout, and the frame (if any) that a set of tool outputs becomes;
- whether a cancel is something the server has open to cancel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

Dialect = Literal["prototype", "launched", "http"]
DIALECTS: tuple[Dialect, ...] = ("prototype", "launched", "http")


@attrs.frozen
class Answer:
    """The frame tool outputs become; `resumes`: it answers the last pending call."""

    body: Mapping[str, Any]
    resumes: bool


@attrs.define
class Turns:
    """One rollout's frames in one dialect (the base: a WebSocket `response.create` a turn)."""

    settings: Mapping[str, Any]
    input: str | list[Any]
    previous_response_id: str | None
    #: Outputs given while other calls are still pending (a chain sends them in one turn).
    waiting: list[Any] = attrs.field(factory=list)
    #: A `tool_choice` given with an answer, not yet sent: the frame that resumes carries it.
    chosen: Any = None

    def choose(self, tool_choice: Any) -> None:
        """A new `tool_choice` from the answer that resumes on: a chain's every later turn
        asks with it (the prototype's Response keeps it itself)."""
        self.chosen = tool_choice

    def first(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "response.create", **self.settings, "input": self.input}
        if self.previous_response_id is not None:
            body["previous_response_id"] = self.previous_response_id
        return body

    def answer(
        self,
        outputs: list[Any],
        *,
        answered_all: bool,
        response_id: str | None,
        unsent: Callable[[], Sequence[Any]],
    ) -> Answer | None:
        """`outputs` as a frame, or None while the server is told nothing yet."""
        if not answered_all:
            self.waiting.extend(outputs)
            return None
        outputs, self.waiting = [*self.waiting, *outputs], []
        if self.chosen is not None:
            self.settings, self.chosen = {**self.settings, "tool_choice": self.chosen}, None
        return Answer(self.next_turn(outputs, response_id, unsent), resumes=True)

    def next_turn(
        self, outputs: list[Any], response_id: str | None, unsent: Callable[[], Sequence[Any]]
    ) -> dict[str, Any]:
        """Launched: a new Response chained onto the last, with only the outputs."""
        return {
            "type": "response.create",
            **self.settings,
            "previous_response_id": response_id,
            "input": outputs,
        }


@attrs.define
class PrototypeTurns(Turns):
    """One long-lived Response: every answer goes out at once as `response.append`."""

    def answer(
        self,
        outputs: list[Any],
        *,
        answered_all: bool,
        response_id: str | None,
        unsent: Callable[[], Sequence[Any]],
    ) -> Answer | None:
        body: dict[str, Any] = {"type": "response.append", "input": outputs}
        if answered_all and self.chosen is not None:
            body["tool_choice"], self.chosen = self.chosen, None
        return Answer(body, resumes=answered_all)


@attrs.define
class HttpTurns(Turns):
    """Stateless: each turn is a POST with the whole history, streamed back as SSE."""

    history: list[Any] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.input, str):
            self.history = [{"type": "message", "role": "user", "content": self.input}]
        else:
            self.history = list(self.input)

    def first(self) -> dict[str, Any]:
        body = {key: value for key, value in super().first().items() if key != "type"}
        return {**body, "stream": True}

    def next_turn(
        self, outputs: list[Any], response_id: str | None, unsent: Callable[[], Sequence[Any]]
    ) -> dict[str, Any]:
        self.history.extend(unsent())
        self.history.extend(outputs)
        return {**self.settings, "stream": True, "input": list(self.history)}


@attrs.frozen
class DialectRules:
    name: Dialect
    one_response: bool
    over_http: bool
    headers: Mapping[str, str]
    turns: type[Turns]

    def cancels_on_server(self, *, streaming: bool) -> bool:
        """A WebSocket turn streams on the server; of a suspended rollout, only the prototype's
        Response waits there (HTTP's stream is dropped instead, and between turns nothing is
        open)."""
        return not self.over_http if streaming else self.one_response


RULES: Mapping[Dialect, DialectRules] = {
    "prototype": DialectRules(
        "prototype",
        one_response=True,
        over_http=False,
        headers={"X-Proto-Dialect": "prototype"},
        turns=PrototypeTurns,
    ),
    "launched": DialectRules(
        "launched",
        one_response=False,
        over_http=False,
        headers={},
        turns=Turns,
    ),
    "http": DialectRules(
        "http",
        one_response=False,
        over_http=True,
        headers={},
        turns=HttpTurns,
    ),
}


def rules(dialect: str) -> DialectRules:
    """The dialect's rules; a `ValueError` that lists the dialects for any other name."""
    if dialect not in RULES:
        raise ValueError(f"unknown dialect {dialect!r}; use one of {', '.join(DIALECTS)}.")
    return RULES[dialect]  # type: ignore[index]
