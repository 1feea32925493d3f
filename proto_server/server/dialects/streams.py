"""A Response as Server-Sent Events: the stream of `POST /v1/responses` with `stream: true`
(`stream_created`), and `GET /v1/responses/{id}?stream=true&starting_after=N` (`serve_reattach`),
the same stream again for a client that went away (server/rollouts/kept.py), as OpenAI resumes a
background Response's stream. A background Response (`create_background`, run by the process:
server/rollouts/background.py) is streamed to its creator as a reattach from its first event is,
so that its creator leaving leaves it running.

A reattach's answer is the Response's stream from the first event numbered above `N` (every
kept one without it), then the live rest to its terminal event, each with the number it first
had: joined to what the client saw up to `N`, one stream, no gap, nothing twice. Only
the key that created the Response finds it; for another it is not there (404, as the store
answers). Events no longer kept are refused before the stream begins (410
`reattach_events_lost`), or, for a reader that falls behind the bound, said by an `error` event
that ends the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl

import attrs
import h11
import trio

from proto_server.server.process import metrics
from proto_server.server.process.logs import log
from proto_server.server.rollouts.kept import KeptEvents, tail
from proto_server.server.rollouts.responses import Responses
from proto_server.server.rollouts.sampling import SamplingLoop
from proto_server.server.rollouts.turns import TurnSource
from proto_server.server.transport.outbox import LaneSink, Outbox, Outgoing
from proto_server.server.transport.sendtimeout import SLOW_READER, SendTimeout
from proto_server.server.transport.sse import SSETransport
from proto_server.server.transport.writer import EventBound, discard_events, write_events
from proto_server.wire.errors import ProtocolError, quoted
from proto_server.wire.events import ErrorEvent, ResponseCreate
from proto_server.wire.items import Item
from proto_server.wire.response import Response

SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]


async def stream_created(
    responses: Responses,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    receive: trio.MemoryReceiveChannel[Outgoing],
    loop: SamplingLoop,
    kept: KeptEvents | None,
    response: trio.CancelScope,
) -> None:
    """The one writer (`writer.py`), each event an SSE block in an h11 chunk and each batch
    one socket write; the stream ends with its Response. A client that takes no bytes for
    `--send-timeout` has its Response end `incomplete` (`slow_reader`: stored so, counted
    so, sent to no one) before its connection is closed. One that goes away leaves its
    Response running for `--reattach-grace`, its events `kept`, before `response` (its
    nursery) is cancelled, as it is at once without a grace."""
    outbox = Outbox(receive, merge=responses.config.merge_deltas)
    if kept is None:
        await _write_created(responses, stream, conn, outbox, loop, None, response)
        return
    async with responses.detached.keeping(kept):
        await _write_created(responses, stream, conn, outbox, loop, kept, response)


async def _write_created(
    responses: Responses,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    outbox: Outbox,
    loop: SamplingLoop,
    kept: KeptEvents | None,
    response: trio.CancelScope,
) -> None:
    try:
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=SSE_HEADERS)) or b"")
        await write_events(
            outbox,
            SSETransport(stream, conn),
            dialect="http",
            observer=responses.observer,
            one_response=True,
            offload=responses.offload,
            bound=EventBound(responses.config.max_event_bytes),
        )
    except SendTimeout as stall:
        log.warning(
            "http.slow_reader",
            extra={"response": loop.machine.id, "timeout_s": stall.timeout_s,
                   "unsent_bytes": len(stall.unsent)},
        )  # fmt: skip
        metrics.SEND_TIMEOUTS.labels("http").inc()
        loop.expire(SLOW_READER)
        await discard_events(outbox, dialect="http", one_response=True)
        raise  # the connection closes: nothing more can be said on it
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        if kept is not None:
            grace_s = responses.config.reattach_grace_s
            await responses.detached.hold(kept, outbox, response.cancel, grace_s=grace_s)
        raise
    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")


async def create_background(
    responses: Responses,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    create: ResponseCreate,
    history: Sequence[Item],
    *,
    owner: str,
    size: int,
) -> Response | None:
    """Begin `create` in the background; stream it (a client leaving leaves it running), or
    return the Response `queued` for the caller to answer with (it has not run yet)."""
    responses.background.check_room()
    kept = responses.keeper(owner, background=True)
    assert kept is not None
    send, receive = trio.open_memory_channel[Outgoing](responses.config.client_queue_events)
    budget = responses.connection_budget()  # its own: no connection holds it
    try:
        loop = await responses.begin(
            create,
            LaneSink(send),
            budget=budget,
            history=history,
            source=TurnSource.STORE if history else TurnSource.FRESH,
            size=size,
            owner=owner,
        )
    except BaseException:
        budget.close()
        raise
    kept.response_id = loop.machine.id
    try:
        responses.background.start(loop, kept, send, receive, budget)
    except ProtocolError:  # the last place was taken while it was being built
        await loop.close()
        budget.close()
        raise
    if not create.stream:
        return attrs.evolve(loop.snapshot(), status="queued")
    await serve_reattach(responses, stream, conn, kept, -1, first=True)
    return None


def starting_after(query: str) -> int | None:
    """With `stream=true`, the number after which a reattach streams (-1: from the first
    event); None for a plain retrieve."""
    fields = dict(parse_qsl(query, keep_blank_values=True))
    if fields.get("stream", "false").lower() != "true":
        return None
    after = fields.get("starting_after", "-1")
    try:
        number = int(after)
    except ValueError:
        number = -2
    if number < -1:
        raise ProtocolError(
            "invalid_field",
            f"`starting_after` must be a sequence_number (0 or more), got {quoted(after)}.",
            param="starting_after",
        )
    return number


def not_in_flight(response_id: str) -> ProtocolError:
    return ProtocolError(
        "response_not_found",
        f"No Response {quoted(response_id)} to reattach to: only a streamed Response whose "
        "client went away is kept (for --reattach-grace), or a background one (while it runs, "
        "and for --reattach-grace after), and only for the key that created it. A stored one "
        "that ended is retrieved without `stream=true`.",
        status=404,
    )


async def serve_reattach(
    responses: Responses,
    stream: trio.abc.Stream,
    conn: h11.Connection,
    kept: KeptEvents,
    after: int,
    *,
    first: bool = False,
) -> None:
    """Stream `kept` after `after` to this client, then its live rest, as SSE (`first`: to the
    client that created it, a background Response's first reader)."""
    kept.after(after)  # refused before the stream begins if some are lost already
    if not first:
        log.info("response.reattached", extra={"response": kept.response_id, "after": after})
    send, receive = trio.open_memory_channel[Outgoing](responses.config.client_queue_events)
    followed = delivered = False

    async def follow() -> None:
        """`tail`, then the end of the channel; a reader fallen behind the bound is told so."""
        nonlocal followed
        async with send:
            try:
                await tail(kept, after, send)
                followed = kept.ended
            except ProtocolError as lost:
                await send.send(Outgoing(ErrorEvent(status=lost.status, error=lost.detail)))

    kept.attach()
    try:
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=SSE_HEADERS)) or b"")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow)
            async with receive:
                await write_events(
                    Outbox(receive, merge=False),  # merged, the numbers would skip
                    SSETransport(stream, conn),
                    dialect="http",
                    observer=responses.observer,
                    one_response=True,
                    offload=responses.offload,
                    bound=EventBound(responses.config.max_event_bytes),
                )
            nursery.cancel_scope.cancel()
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        delivered = followed  # its terminal event is written: nothing more need be kept
    finally:
        kept.detach(delivered=delivered)
