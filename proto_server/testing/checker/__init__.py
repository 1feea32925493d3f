"""The event-ordering invariants of a Responses connection, checked as the events arrive.

    checker = StreamChecker(dialect="prototype", count_tokens=o200k_count)
    checker.sent(frame)        # every frame the client sent, in order
    checker.received(event)    # every event it received (a decoded JSON object or frame text)
    checker.finish()           # the client is done: every frame must have been answered

The checker keeps a model of what the server must have done, built only from the frames and
events themselves (not from this server's code), and raises `InvariantViolation` at the first
event that breaks one of `INVARIANTS`, naming the invariant, the event and its sequence number.

The package reads in three parts: `responses.py`, the model of Responses (items, texts, calls
waiting, usage, snapshots); `ledger.py`, the ledger of what the client sent and what each frame
may still earn (frames race the stream, so a frame keeps every answer that was legal while it
was in doubt); and `stream.py`, the `StreamChecker` that composes the two and dispatches each
event by its type. `invariants.py` holds `INVARIANTS` and `InvariantViolation`, `lanes.py` the
`LaneChecker`.

Two dialects: `prototype` (one Response per rollout, `response.done` suspends it and an append
resumes it) and `launched` (many Responses, one at a time, each a plain create-to-terminal run;
a create sent while one runs is served after it, announced by `response.queued`).

Lanes: `LaneChecker` holds a `StreamChecker` per `stream_id` (a lane is a connection of its own:
its events are numbered from 0, its Responses one at a time) and routes each frame and event to
its lane. `response.inject` (the multi-agent beta) is answered by `response.inject.created`,
whose outputs must answer calls that are waiting, or `response.inject.failed`, which returns the
input as sent; a Response created with `multi_agent.enabled` waits silently on its calls (no
`response.done`) and resumes with `response.in_progress` only once every one is answered.

Steering: a `response.steer` goes to the lane of the Response it names and is answered by
`response.steer.accepted` (the Response is active, or completed with calls awaiting output)
or `response.steer.failed` (the input as sent, a known code). An accepted steer is then
committed (launched: the Response ends `incomplete` with reason `steered`, or completes, and
the next `response.created` on the lane is its successor, `previous_response_id` the steered
one, asked for by no create; or the create that continues a Response it was pending for;
prototype: the same Response's next `response.in_progress`), or it fails, with its id and its
input back; `response.steer.pending` only while its Response waits on calls, naming them.
"""

from proto_server.testing.checker.invariants import INVARIANTS, Dialect, InvariantViolation
from proto_server.testing.checker.lanes import LaneChecker
from proto_server.testing.checker.responses import TERMINAL_EVENTS, o200k_count
from proto_server.testing.checker.stream import StreamChecker

__all__ = [
    "INVARIANTS",
    "TERMINAL_EVENTS",
    "Dialect",
    "InvariantViolation",
    "LaneChecker",
    "StreamChecker",
    "o200k_count",
]
