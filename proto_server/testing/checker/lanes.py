"""`LaneChecker`: a connection with lanes (`stream_id`), one `StreamChecker` per lane.

A lane is a connection of its own: its events are numbered from 0, its Responses one at a time.
What no lane can see on its own is checked here: a Response lives on the lane it was created on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from proto_server.testing.checker.invariants import Dialect, InvariantViolation
from proto_server.testing.checker.stream import StreamChecker
from proto_server.wire.converter import as_json, lane_of
from proto_server.wire.events import (
    ClientEvent,
    ResponseAppend,
    ResponseCancel,
    ResponseCreate,
    ResponseInject,
)

if TYPE_CHECKING:
    from proto_server.testing.schema import WireSchema


class LaneChecker:
    """One connection with lanes: a `StreamChecker` per `stream_id` (None: the default lane),
    each frame and event routed to its lane, and what no lane can see on its own checked here
    (a Response id is never reused on another lane). An inject goes to the lane of the Response
    it names, as far as the events have shown it; an unknown one to the default lane."""

    def __init__(
        self,
        *,
        dialect: Dialect = "launched",
        count_tokens: Callable[[str], int] | None = None,
        unsolicited_errors: Iterable[str] = ("websocket_connection_limit_reached",),
        schema: WireSchema | None = None,
    ) -> None:
        self._settings: dict[str, Any] = {
            "dialect": dialect,
            "count_tokens": count_tokens,
            "unsolicited_errors": unsolicited_errors,
            "schema": schema,
        }
        self.lanes: dict[str | None, StreamChecker] = {}
        self._home: dict[str, str | None] = {}  # response id -> its lane

    def lane(self, stream_id: str | None) -> StreamChecker:
        checker = self.lanes.get(stream_id)
        if checker is None:
            checker = self.lanes[stream_id] = StreamChecker(**self._settings)
            checker.stream_id = stream_id
        return checker

    def sent(self, frame: Mapping[str, Any] | ClientEvent | str | bytes) -> None:
        obj: Any = frame
        if isinstance(frame, ResponseCreate | ResponseAppend | ResponseCancel | ResponseInject):
            obj = as_json(frame)
        elif isinstance(frame, str | bytes):
            try:
                obj = orjson.loads(frame)
            except orjson.JSONDecodeError:
                obj = None
        kind = obj.get("type") if isinstance(obj, Mapping) else None
        if kind in ("response.inject", "response.steer"):  # the lane of the Response named
            assert isinstance(obj, Mapping)
            rid = obj.get("response_id" if kind == "response.inject" else "previous_response_id")
            stream_id = self._home.get(rid) if isinstance(rid, str) else None
        else:
            stream_id = lane_of(dict(obj)) if isinstance(obj, Mapping) else None
        self.lane(stream_id).sent(frame)

    def received(self, event: Mapping[str, Any] | str | bytes) -> None:
        obj: Mapping[str, Any] = orjson.loads(event) if isinstance(event, str | bytes) else event
        stream_id = obj.get("stream_id")
        if stream_id is not None and not isinstance(stream_id, str):
            raise InvariantViolation(
                9, f"stream_id {stream_id!r} is not a string", sequence_number=None, event=obj
            )
        response = obj.get("response")
        if obj.get("type") in ("response.created", "response.queued") and isinstance(
            response, Mapping
        ):
            rid = response.get("id")
            if isinstance(rid, str):
                if self._home.get(rid, stream_id) != stream_id:
                    raise InvariantViolation(
                        9,
                        f"Response {rid} of lane {self._home[rid]!r} appeared on {stream_id!r}",
                        sequence_number=obj.get("sequence_number"),
                        event=obj,
                    )
                self._home[rid] = stream_id
        self.lane(stream_id).received(obj)

    def finish(self, *, closed: bool = False) -> None:
        for checker in self.lanes.values():
            checker.finish(closed=closed)

    @property
    def violation(self) -> InvariantViolation | None:
        return next((c.violation for c in self.lanes.values() if c.violation), None)
