"""A proto-server inside the client's own process: what a notebook uses to need nothing else.

It sits above both the client (which speaks only the wire) and the server: it builds a server
on the simulated GPU and hands the blocking client a host to run in its trio thread.

    from proto_server.hosted import serving
    client = serving(script, timing=TimingModel())   # a server on 127.0.0.1, a free port
    rollout = client.connect("prototype").create(...)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from proto_server.client.facade import BlockingClient
from proto_server.compose import simulated
from proto_server.engine.default_model import DefaultModel
from proto_server.engine.script import Planner, parse_script
from proto_server.engine.simulated import TimingModel
from proto_server.launch import Launch
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig


class HostedClient(BlockingClient):
    """A `BlockingClient` whose server runs in its own trio thread; `server` is that server."""

    def __init__(self, server: ProtoServer, timing: TimingModel | None) -> None:
        self.server = server
        super().__init__(host=self._serve, timing=timing)

    async def _serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(self.server.serve)
            task_status.started(address.http_url)


def serving(
    script: Mapping[str, Any] | None = None,
    *,
    planner: Planner | None = None,
    timing: TimingModel | None = None,
    config: ServerConfig | None = None,
) -> HostedClient:
    """A client with its own in-process server on 127.0.0.1 (a free port): `script` (a rollout
    script), or any `planner`, on the simulated GPU with `timing`; the default model if
    neither."""
    if planner is None:
        planner = parse_script(script) if script is not None else DefaultModel()
    timing = timing or TimingModel()
    generator = simulated(planner, timing, Launch(prefix_cache=False))
    return HostedClient(ProtoServer(generator, config or ServerConfig(port=0)), timing)
