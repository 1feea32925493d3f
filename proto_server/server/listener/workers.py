"""`serve --workers N`: N server processes on one port, supervised by the one that binds it.

    supervisor (trio; loads no model, holds no connection)
     ├─ the listening socket, bound once and inherited by every worker
     ├─ worker 1..N: `proto-server serve ... --listen-fd FD`, each a whole server, its metrics
 │   in a directory they share (a scrape of any one sums them all)
     └─ signals: SIGINT/SIGTERM passed on to every worker (a second one too: stop at once)

The kernel hands each new connection to one worker, and it lives there: warm rollouts,
connection caches, suspended Responses and every limit are per worker. A worker that dies is
started again (the restart logged, with a growing pause if it keeps dying young); one that
cannot start at all (a bad flag, a store that does not answer) stops the whole server with its
exit status, since the next would fail the same way. Workers run in sessions of their own, so
a terminal's Ctrl-C reaches the supervisor once, and it shuts them down as one server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import attrs
import trio

from proto_server.server.listener.app import BoundAddress
from proto_server.server.process import metrics
from proto_server.server.process.logs import log

#: A worker that lived less than this long before dying waits before it is started again...
YOUNG_S = 5.0
#: ...starting at this pause, doubled each time it dies young again, up to the last.
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.5, 30.0


class WorkerFailed(Exception):
    """A worker exited before it listened: the server cannot start."""

    def __init__(self, status: int) -> None:
        super().__init__(f"a worker exited with status {status} before it listened")
        self.status = status


@attrs.define
class Supervisor:
    """Runs `workers` copies of `command(fd)`, each given the listening socket's descriptor."""

    command: Callable[[int], Sequence[str]]
    workers: int
    listener: socket.socket
    #: Where the workers keep their metrics, so a scrape of any one sums all (metrics.py).
    metrics_dir: str
    processes: dict[int, trio.Process] = attrs.field(factory=dict)
    restarts: int = 0
    stopping: bool = False
    #: 0 once every worker stopped with 0 after a signal; else 1.
    status: int = 1

    @property
    def address(self) -> BoundAddress:
        host, port = self.listener.getsockname()[:2]
        return BoundAddress(host, port)

    async def run(
        self, *, task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start every worker, report the address once all listen, and keep them running until
        each has stopped after a signal; `status` is 0 if every worker's was."""
        statuses: list[int] = []
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as supervisor:
                supervisor.start_soon(self._pass_on, signals)
                async with trio.open_nursery() as workers:
                    for index in range(self.workers):
                        await workers.start(self._keep, index, statuses)
                    task_status.started(self.address)
                supervisor.cancel_scope.cancel()  # every worker has stopped
        self.status = 0 if all(status == 0 for status in statuses) else 1

    async def _pass_on(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            again = self.stopping
            self.stopping = True
            print(
                f"proto-server: {name}{' again' if again else ''}, stopping {self.workers} "
                "workers" + (" now" if again else ""),
                file=sys.stderr,
                flush=True,
            )
            for process in list(self.processes.values()):
                process.send_signal(signal.SIGTERM)

    async def _keep(
        self, index: int, statuses: list[int], *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Worker `index`, started again whenever it dies, until the server stops."""
        pause = FIRST_PAUSE_S
        ready = False
        while True:
            started = trio.current_time()
            process = await trio.lowlevel.open_process(
                list(self.command(self.listener.fileno())),
                stdout=subprocess.PIPE,
                pass_fds=(self.listener.fileno(),),
                start_new_session=True,
                env={**os.environ, metrics.MULTIPROC_ENV: self.metrics_dir},
            )
            self.processes[index] = process
            try:
                listening = await _first_line(process)
                if not ready:
                    if not listening:
                        raise WorkerFailed(await process.wait())
                    ready = True
                    task_status.started()
                log.info("worker.started", extra={"worker": index, "pid": process.pid})
                status = await process.wait()
            finally:
                with trio.CancelScope(shield=True):
                    if process.returncode is None:  # the supervisor itself is being stopped
                        process.kill()
                        await process.wait()
            del self.processes[index]
            metrics.worker_gone(process.pid, self.metrics_dir)
            if self.stopping:
                statuses.append(status)
                return
            lived = trio.current_time() - started
            self.restarts += 1
            log.warning(
                "worker.restarted",
                extra={"worker": index, "pid": process.pid, "status": status,
                       "lived_s": round(lived, 3)},
            )  # fmt: skip
            if lived < YOUNG_S:
                await trio.sleep(pause)
                pause = min(pause * 2, LONGEST_PAUSE_S)
            else:
                pause = FIRST_PAUSE_S


async def _first_line(process: trio.Process) -> bool:
    """Read the worker's first line of output; True if it says the worker listens."""
    assert process.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        part = await process.stdout.receive_some(4096)
        if not part:
            return False
        line += part
    return line.startswith(b"proto-server listening on ")


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """The socket every worker accepts on (OSError if it cannot be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=backlog)
    os.set_inheritable(listener.fileno(), True)
    return listener
