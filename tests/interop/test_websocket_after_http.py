"""Node's WebSocket clients, opened after HTTP calls to the same server: undici's (the one Node
22 builds in, which the Vercel AI SDK, openai-node and the Agents SDK use there) sends its
upgrade on a kept-alive connection of its pool that has already served those calls; `ws` opens
its own. Both must get a WebSocket (undici's was answered 404 when the server took an upgrade
only as a connection's first request). `tests/clients/websocket_after_http.mjs` drives them."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import trio

from ..support.servers import StartServer

pytestmark = pytest.mark.npm

CLIENTS = Path(__file__).resolve().parents[1] / "clients"


@pytest.mark.parametrize("client", ["undici", "ws"])
async def test_a_websocket_after_http_calls_serves_a_response(
    start_server: StartServer, client: str
) -> None:
    running = await start_server()
    address = running.address
    with trio.fail_after(60):
        done = await trio.run_process(
            ["node", str(CLIENTS / "websocket_after_http.mjs"),
             f"{address.host}:{address.port}", client],
            cwd=CLIENTS, capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
    result = orjson.loads(done.stdout.splitlines()[-1]) if done.stdout else {}
    assert done.returncode == 0, (result, done.stderr.decode()[-2000:])
    assert result["statuses"] == [200, 200]
    assert result["types"][0] == "response.created"
    assert result["status"] == "completed"
