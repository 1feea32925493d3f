"""The one writer: a client channel drained into a socket, whatever the transport.

A WebSocket connection (`connection.py`) and an SSE response (`http.py`) write their events the
same way: every event ready at once (`Outbox.batch`: merged only when the writer fell behind),
numbered per lane, encoded once, straight to bytes, and handed to the transport, which frames
each (WebSocket text frames, `wsframes.py`; SSE `event:`/`data:` lines through h11) and writes
the batch with one socket write, so a burst costs one scheduling round and one `send` instead of
one each. Only the framing differs, so only the framing is the transport's.

An event over `--max-event-bytes` (`EventBound`) is where a default client stops reading (Python
`websockets` refuses a message over 1 MiB): a Response snapshot whose clients build its output
from the `response.output_item.done` events (the prototype dialect's) goes without its output;
any other is sent whole. Either way it is logged and counted.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Protocol

import attrs

from proto_server.core.response.status import TERMINAL_EVENTS
from proto_server.core.sequence import Sequencer
from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.process.observe import ServerObserver
from proto_server.server.process.offload import Offload
from proto_server.server.transport.outbox import Outbox
from proto_server.wire.converter import encode_server_event_bytes
from proto_server.wire.events import ResponseEvent, ServerEvent
from proto_server.wire.items import TOKEN_FIELDS
from proto_server.wire.response import Response

#: Most events framed into one socket write (a burst is written in pieces this big).
WRITE_BATCH = 64
#: The fewest bytes of JSON a tool or an output item echoed in a Response takes: what its
#: encoding is charged as, so that a Response echoing thousands of them (36,000 tools in 4 MB,
#: 80 ms of Python an event) is encoded off the event loop.
ECHOED_VALUE_BYTES = 64


@attrs.frozen
class EventBound:
    """`--max-event-bytes` as one connection's writer applies it."""

    max_bytes: int
    #: The dialect's clients take a Response's output from its `response.output_item.done`
    #: events (Codex's parser reads only `id` and `usage` of the terminal one): a snapshot over the
    #: bound may leave it out. Not so where a client reads `output` there (the Agents SDK's
    #: non-streamed WebSocket call returns the terminal event's Response as it came).
    omit_output: bool = False


class Transport(Protocol):
    """How encoded events become bytes on one transport: framed as they are added, then
    written together."""

    @property
    def name(self) -> str:
        """The `transport` label of the metrics."""
        ...

    def add(self, event: ServerEvent, payload: bytes) -> int:
        """Frame `payload` (`event` as JSON, numbered) for the next write; the bytes it counts."""
        ...

    async def flush(self) -> None:
        """Write what was added, in order, with one write."""
        ...


async def write_events(
    outbox: Outbox,
    transport: Transport,
    *,
    dialect: str,
    observer: ServerObserver | None,
    one_response: bool = False,
    offload: Offload | None = None,
    bound: EventBound | None = None,
) -> None:
    """Write what `outbox` gives until its channel ends; with `one_response` (an SSE stream
    carries one Response), until that Response's terminal event is written.

    Each lane numbers its own events from 0 (the default lane, None, is every HTTP stream's).
    An event echoing a large Response is encoded on a worker thread of `offload`; one over
    `bound` is sent as the bound says (`EventBound`)."""
    sequencers: dict[str | None, Sequencer] = {}
    while batch := await outbox.batch(WRITE_BATCH):
        sizes = []
        ended = False
        for outgoing, merged in batch:
            lane = outgoing.stream_id
            sequencer = sequencers.get(lane)
            if sequencer is None:  # lanes are few: the dialect bounds them
                sequencer = sequencers[lane] = Sequencer()
            number = sequencer.next() if outgoing.number is None else outgoing.number
            sequencer.skip_to(number + 1)  # a replayed event's number holds for the lane
            payload = await _encoded(outgoing.event, number, lane, offload)
            if bound is not None and len(payload) > bound.max_bytes:
                payload = await _over_bound(
                    outgoing.event, payload, number, lane, offload, bound,
                    dialect=dialect, transport=transport.name,
                )  # fmt: skip
            if outgoing.kept is not None:  # numbered: kept for a client that reattaches
                outgoing.kept.keep(number, outgoing.event, len(payload), merged)
            sizes.append(transport.add(outgoing.event, payload))
            if one_response and isinstance(outgoing.event, TERMINAL_EVENTS):
                ended = True
                break
        started = time.perf_counter()
        await transport.flush()
        seconds = time.perf_counter() - started
        name = transport.name
        # strict=False: what followed an ended Response in its batch is not written
        for (outgoing, merged), size in zip(batch, sizes, strict=False):
            metrics.sent(outgoing.event, dialect=dialect, transport=name, size=size,
                         seconds=seconds)  # fmt: skip
            if observer is not None:
                observer.sent(outgoing.event, merged)
        if ended:
            return


async def _encoded(
    event: ServerEvent, number: int, lane: str | None, offload: Offload | None
) -> bytes:
    encode = partial(encode_server_event_bytes, event, number, lane)
    return encode() if offload is None else await offload.run(encode, size=echoed_bytes(event))


async def _over_bound(
    event: ServerEvent,
    payload: bytes,
    number: int,
    lane: str | None,
    offload: Offload | None,
    bound: EventBound,
    *,
    dialect: str,
    transport: str,
) -> bytes:
    """`event`, encoded as `payload` over `bound`: without its Response's output where the
    bound allows that, else as it is; logged and counted either way."""
    whole = len(payload)
    lean = _without_output(event) if bound.omit_output else None
    if lean is not None:
        payload = await _encoded(lean, number, lane, offload)
    extra = {"type": event.type, "bytes": whole, "sent_bytes": len(payload),
             "limit": bound.max_bytes, "dialect": dialect, "transport": transport}  # fmt: skip
    if lean is not None:
        log.info("event.output_omitted", extra=extra)
    else:
        log.warning("event.over_limit", extra={**extra, "flag": "--max-event-bytes"})
    action = "sent_whole" if lean is None else "output_omitted"
    metrics.LARGE_EVENTS.labels(dialect, transport, action).inc()
    return payload


def _without_output(event: ServerEvent) -> ServerEvent | None:
    """`event`'s Response snapshot with `output: []`; None if it carries no output."""
    if isinstance(event, ResponseEvent) and event.response.output:
        return attrs.evolve(event, response=attrs.evolve(event.response, output=()))
    return None


async def discard_events(outbox: Outbox, *, dialect: str, one_response: bool = False) -> None:
    """Take what `outbox` gives until its channel ends (with `one_response`, until a terminal
    event), writing none of it: for a client that stopped reading (`--send-timeout`), so its
    Responses can still end (their producers wait on the channel) and be counted as ended."""
    while batch := await outbox.batch(WRITE_BATCH):
        for outgoing, _ in batch:
            metrics.ended(outgoing.event, dialect=dialect)
            if one_response and isinstance(outgoing.event, TERMINAL_EVENTS):
                return


def echoed_bytes(event: ServerEvent) -> int:
    """The least the Response `event` echoes (if any) takes as JSON, counted by its tools and
    output items, each a Python step to encode, and by the token ids its items carry (when a
    client asked for them, every item holds its whole prompt's): cheap to count, whatever
    their size."""
    item = getattr(event, "item", None)
    response = getattr(event, "response", None)
    if isinstance(response, Response):
        return response_bytes(response)
    return _token_bytes(item) if item is not None else 0


def response_bytes(response: Response) -> int:
    """The least `response` takes as JSON (`echoed_bytes`)."""
    size = ECHOED_VALUE_BYTES * (len(response.tools) + len(response.output))
    return size + sum(_token_bytes(output) for output in response.output)


#: What one token id or logprob takes as JSON, about (the ids of a 200,000 vocabulary).
TOKEN_JSON_BYTES = 8


def _token_bytes(item: object) -> int:
    return TOKEN_JSON_BYTES * sum(len(getattr(item, name, None) or ()) for name in TOKEN_FIELDS)
