"""A blocking client for notebooks: trio runs in a thread of its own, across cells.

IPython's `%autoawait trio` runs each cell in its own `trio.run`, so a connection opened in one
cell cannot outlive it. Here one dedicated thread runs `trio.run` for the client's whole life;
every blocking method hands a coroutine to it through `trio.from_thread.run` and waits. The same
thread can host an in-process server (`proto_server.hosted.serving()` builds one), so a
notebook needs nothing else running.

    client = serving(script=..., timing=...)   # or BlockingClient(url)
    rollout = client.connect("prototype").create("fix the bug", tools=[...])
    rollout.step()                    # events until the suspension; shows as a table
    rollout.append({call_id: "..."})
    rollout.step()
    client.close()                    # also at interpreter (kernel) exit

Nursery tree, in the client's thread:

    main (trio.run)
     ├─ server (when hosted): the host, e.g. ProtoServer.serve
     └─ connections: one task per open connection, holding its `connect()` block
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import trio
from trio_websocket import ConnectionClosed

from proto_server.client.connection import Connection, connect
from proto_server.client.dialects import Dialect
from proto_server.client.display import Chart, ModelledTime, rollout_html, timing_chart
from proto_server.client.rollout import Rollout
from proto_server.client.segment import Received, Segment, Sent
from proto_server.client.state import RolloutState
from proto_server.wire.items import Item, ToolCall, ToolOutput
from proto_server.wire.response import Response
from proto_server.wire.tools import Tool

T = TypeVar("T")

#: How long close() lets connections say goodbye before it cancels them.
CLOSE_GRACE_S = 5.0

_open_clients: weakref.WeakSet[BlockingClient] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter (kernel) exit: stop every client still running."""
    for client in list(_open_clients):
        client.close()


class Host(Protocol):
    """A server to run in the client's thread: binds, then reports its URL (`started(url)`)."""

    async def __call__(self, *, task_status: trio.TaskStatus[str]) -> None: ...


class ClientStopped(RuntimeError):
    """The client's thread is gone (closed, or it failed); create a new client."""


class BlockingClient:
    """Owns the trio thread; every other blocking object goes through `call`."""

    def __init__(
        self,
        url: str | None = None,
        *,
        host: Host | None = None,
        timing: ModelledTime | None = None,
    ) -> None:
        if (url is None) == (host is None):
            raise ValueError(
                "give a server URL, or a server to host (proto_server.hosted.serving())."
            )
        self.url = url
        #: What the charts call modelled GPU time (a hosted simulated GPU's timing model).
        self.timing = timing
        self._host = host
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop = trio.Event()
        self._connections: trio.Nursery | None = None
        self._lock = trio.Lock()  # one call at a time in the trio thread
        #: One event per open connection: set it and the connection closes.
        self._holds: set[trio.Event] = set()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="proto-client-trio", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise ClientStopped(f"the client's trio thread failed to start: {self._failure}")
        _open_clients.add(self)

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._failure = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as outer:
            if self._host is not None:
                self.url = await outer.start(self._host)
            async with trio.open_nursery() as connections:
                self._connections = connections
                self._ready.set()
                await self._stop.wait()
                # Let each connection close properly (a close frame), but not forever.
                connections.cancel_scope.deadline = trio.current_time() + CLOSE_GRACE_S
                for done in self._holds:
                    done.set()
            outer.cancel_scope.cancel()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` in the client's trio thread and wait for its result.

        Calls run one at a time. An interrupt (Ctrl-C, the notebook's stop button) cancels the
        call in the trio thread too, so the next call never overlaps it.
        """
        token = self._token
        if token is None or not self._thread.is_alive():
            raise self._stopped()
        scope = trio.CancelScope()

        async def guarded() -> T:
            async with self._lock:
                with scope:
                    return await fn(*args)
            raise ClientStopped("interrupted")  # nobody waits for this: the caller was interrupted

        try:
            return trio.from_thread.run(guarded, trio_token=token)
        except trio.RunFinishedError:
            raise self._stopped() from None
        except KeyboardInterrupt:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(scope.cancel, trio_token=token)
            raise

    def _stopped(self) -> ClientStopped:
        if self._failure is not None:
            return ClientStopped(
                f"this client's trio thread failed ({self._failure!r}); create a new client."
            )
        return ClientStopped("this client is closed; create a new one.")

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        token = self._token
        if token is None or not self._thread.is_alive():
            raise self._stopped()
        try:
            return trio.from_thread.run_sync(partial(fn, *args), trio_token=token)
        except trio.RunFinishedError:
            raise self._stopped() from None

    # -- what a notebook uses ------------------------------------------------------------------

    def connect(
        self, dialect: Dialect = "prototype", *, headers: Mapping[str, str] | None = None
    ) -> BlockingConnection:
        """Open a connection in `dialect`; it lives until closed or until the client closes."""
        assert self.url is not None
        return self.call(self._open, self.url, dialect, headers)

    async def _open(
        self, url: str, dialect: Dialect, headers: Mapping[str, str] | None
    ) -> BlockingConnection:
        assert self._connections is not None
        done = trio.Event()
        self._holds.add(done)
        connection = await self._connections.start(_hold, url, dialect, headers, done)
        return BlockingConnection(self, connection, done)

    def close(self) -> None:
        """Close every connection, stop the hosted server, end the thread. Idempotent."""
        _open_clients.discard(self)
        if self._token is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(CLOSE_GRACE_S + 5)

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _hold(
    url: str,
    dialect: Dialect,
    headers: Mapping[str, str] | None,
    done: trio.Event,
    *,
    task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep one connection's `connect()` block open until `done` is set."""
    started = False
    try:
        async with connect(url, dialect=dialect, headers=headers) as connection:
            task_status.started(connection)
            started = True
            await done.wait()
    except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        # The server went away after the connection opened: using it says so; the client lives.
        if not started:
            raise


class BlockingConnection:
    """A connection used from the notebook's thread; see `Connection`."""

    def __init__(self, client: BlockingClient, connection: Connection, done: trio.Event) -> None:
        self.client = client
        self.connection = connection
        self._done = done

    @property
    def dialect(self) -> Dialect:
        return self.connection.dialect

    @property
    def last_response_id(self) -> str | None:
        return self.connection.last_response_id

    @property
    def transcript(self) -> list[Sent | Received]:
        """Everything sent and received on this connection, in order."""
        return list(self.connection.transcript)

    def create(
        self,
        input: str | Sequence[Item | Mapping[str, Any]],
        *,
        model: str | None = None,
        tools: Sequence[Tool | Mapping[str, Any]] = (),
        instructions: str | None = None,
        previous_response_id: str | None = None,
        **fields: Any,
    ) -> BlockingRollout:
        """Start a rollout (see `Connection.create`); `step()` reads its first segment."""
        rollout = self.client.call(
            partial(
                self.connection.create,
                input,
                model=model,
                tools=tools,
                instructions=instructions,
                previous_response_id=previous_response_id,
                **fields,
            )
        )
        return BlockingRollout(self.client, rollout)

    def reattach(self, response_id: str, *, starting_after: int = -1) -> BlockingRollout:
        """Take up a Response whose connection dropped mid-stream (see `Connection.reattach`);
        `step()` reads what was kept after `starting_after`, then the live rest."""
        rollout = self.client.call(
            partial(self.connection.reattach, response_id, starting_after=starting_after)
        )
        return BlockingRollout(self.client, rollout)

    def send(self, body: Mapping[str, Any]) -> int:
        """The low-level door: send one event as given (see `Connection.send`)."""
        return self.client.call(self.connection.send, body)

    def receive(self, timeout: float = 10.0) -> Received:
        """The next server event; `TimeoutError` if none comes within `timeout` seconds."""

        async def receive() -> Received:
            with trio.fail_after(timeout):
                return await self.connection.receive()

        try:
            return self.client.call(receive)
        except trio.TooSlowError:
            raise TimeoutError(f"no server event within {timeout} s") from None

    def close(self) -> None:
        """Close this connection (a close frame); its rollouts end with it on the server."""
        self.client._holds.discard(self._done)
        self.client.call_sync(self._done.set)


class BlockingRollout:
    """A rollout stepped from the notebook's thread; see `Rollout`."""

    def __init__(self, client: BlockingClient, rollout: Rollout) -> None:
        self.client = client
        self.rollout = rollout

    @property
    def state(self) -> RolloutState:
        return self.rollout.state

    @property
    def pending_calls(self) -> list[ToolCall]:
        return self.rollout.pending_calls

    @property
    def response(self) -> Response | None:
        return self.rollout.response

    @property
    def output(self) -> list[Item]:
        return self.rollout.output

    @property
    def segments(self) -> list[Segment]:
        return self.rollout.segments

    @property
    def events(self) -> list[Received]:
        """Every event received in this rollout so far."""
        return self.rollout.received

    @property
    def response_id(self) -> str | None:
        return self.rollout.response_id

    def step(self) -> Segment:
        """Read events until the next suspension or the end; the segment (shows as a table)."""
        return self.client.call(self.rollout.step)

    def read(self, count: int) -> list[Received]:
        """Read `count` events of this segment, fewer if it suspends or ends first."""

        async def read() -> list[Received]:
            events = self.rollout.events()
            return [
                await anext(events) for _ in range(count) if self.state is RolloutState.STREAMING
            ]

        return self.client.call(read)

    def append(
        self, outputs: Mapping[str, str] | Sequence[ToolOutput], *, tool_choice: Any = None
    ) -> None:
        """Answer pending calls; once all are answered the rollout streams again (step()).
        `tool_choice`: a new one from the answer that resumes on (`Rollout.append`)."""
        self.client.call(partial(self.rollout.append, outputs, tool_choice=tool_choice))

    def cancel(self) -> None:
        self.client.call(self.rollout.cancel)

    def timing_chart(self, title: str = "") -> Chart:
        """Per segment: client time, modelled GPU time (hosted server only), server + wire."""
        return timing_chart(self.rollout.segments, self.client.timing, title=title)

    def _repr_html_(self) -> str:
        return rollout_html(self.rollout.tracker)
