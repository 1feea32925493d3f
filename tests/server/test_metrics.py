"""`GET /metrics`: the numbers move as a rollout runs, it is behind auth when auth is on, and
under `--workers` a scrape of any worker counts them all."""

from __future__ import annotations

import signal
import subprocess
import sys
from functools import partial
from typing import Any

import httpx
import trio

from ..support.clients import connect
from ..support.frames import EXEC_COMMAND, THREE_SEGMENTS
from ..support.metrics import scrape, value
from ..support.servers import StartServer, read_line


async def test_a_rollout_moves_the_numbers_it_should(start_server: StartServer) -> None:
    running = await start_server(script=THREE_SEGMENTS)
    base = running.address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(30):
            before = await scrape(http, base)
            async with connect(running.prototype_url) as client:
                await client.send({"type": "response.create", "model": "m", "input": "Fix it.",
                                   "tools": [EXEC_COMMAND]})  # fmt: skip
                first = await client.segment()
                during = await scrape(http, base)  # suspended on its first call
                events = list(first)
                for _ in range(2):
                    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"
                             and e["item"]["type"] == "function_call"]  # fmt: skip
                    outputs = [{"type": "function_call_output", "call_id": c["call_id"],
                                "output": "ok"} for c in calls]  # fmt: skip
                    await client.send({"type": "response.append", "input": outputs})
                    events = await client.segment()
                    first += events
            refused = await http.post(f"{base}/v1/responses", content=b"{not json")
            after = await scrape(http, base)
    assert first[-1]["type"] == "response.completed"
    assert refused.status_code == 400

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert value(during, "proto_server_suspended_responses") >= 1
    assert value(during, "proto_server_connections_open") >= 1
    assert delta("proto_server_responses_total", dialect="prototype", status="completed") == 1
    assert delta("proto_server_turns_total", source="fresh") == 1
    usage = first[-1]["response"]["usage"]
    assert delta("proto_server_tokens_total", kind="prompt") == usage["input_tokens"]
    assert (
        delta("proto_server_tokens_total", kind="cached")
        == (usage["input_tokens_details"]["cached_tokens"])
    )
    assert delta("proto_server_tokens_total", kind="rendered") > 0
    assert delta("proto_server_frames_out_total", transport="websocket") == len(first)
    assert delta("proto_server_bytes_out_total", transport="websocket") > 100 * len(first)
    assert delta("proto_server_event_write_seconds_count", transport="websocket") == len(first)
    assert delta("proto_server_errors_total", code="invalid_json") == 1
    for phase in ("prepare", "decode", "first_event"):
        assert delta("proto_server_phase_seconds_count", phase=phase) == 1
    assert delta("proto_server_store_seconds_count", operation="put", outcome="ok") == 1
    assert value(after, "proto_server_suspended_responses") == value(
        before, "proto_server_suspended_responses"
    )


async def test_metrics_are_behind_auth_when_it_is_on(start_server: StartServer) -> None:
    running = await start_server(api_keys=("k1",))
    base = running.address.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(10):
            refused = await http.get(f"{base}/metrics")
            samples = await scrape(http, base, authorization="Bearer k1")
    assert refused.status_code == 401
    assert ("proto_server_connections_open", ()) in samples


async def test_a_scrape_of_any_worker_counts_every_worker(nursery: trio.Nursery) -> None:
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store",
               ":memory:", "--workers", "2"]  # fmt: skip
    served = 12
    labels = {"dialect": "http", "status": "completed"}
    counts = set()
    with trio.fail_after(60):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        base = (await read_line(process.stdout)).split("listening on ")[1].split(" ")[0]
        base = base.removesuffix("/v1")
        body: dict[str, Any] = {"model": "m", "input": "hi", "store": False}
        for _ in range(served):  # new connections each: the kernel spreads them over the workers
            async with httpx.AsyncClient(timeout=10) as http:
                assert (await http.post(f"{base}/v1/responses", json=body)).status_code == 200
        for _ in range(6):
            async with httpx.AsyncClient(timeout=10) as http:
                samples = await scrape(http, base)
            counts.add(value(samples, "proto_server_responses_total", **labels))
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    assert counts == {served}
