"""The deployment of docs/deployment.md, for real: HAProxy (Debian's package, with
`deploy/haproxy.cfg` as shipped) in front of two separate `proto-server serve` processes that
share a throwaway PostgreSQL store, everything on loopback.

Codex-shaped rollouts (launched dialect over WebSocket, `store: true`, a warm-up, then turns
chained with `previous_response_id` carrying tool outputs) go through the proxy; one process is
killed mid-rollout, and its clients reconnect through the proxy and finish from the store with
nothing lost. A SIGTERMed process leaves the rotation through `/readyz` while it still accepts.

Without haproxy the tests are skipped and say what to install; in CI (`CI` set) they fail.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio
from proto_server_bench.workload import MODEL, Workload, make_workload
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from proto_server.server.store import chain_items, owner_id
from proto_server.server.store.postgres import PostgresStore
from proto_server.wire.converter import as_json

from ..support.servers import free_port, read_line

pytestmark = [pytest.mark.proxy, pytest.mark.postgres, pytest.mark.deadline(240)]

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
INSTALL = "apt-get install haproxy (the Debian package)"
KEY = "sk-proxy-test"
#: What Codex 0.171 sends on its upgrade (tests/clients, /work/shared/captures).
CODEX_HEADERS = [
    (b"authorization", f"Bearer {KEY}".encode()),
    (b"openai-beta", b"responses_websockets=2026-02-06"),
    (b"originator", b"codex_exec"),
    (b"user-agent", b"codex_exec/0.171.0 (Debian 12.0.0; x86_64)"),
]
TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}


def haproxy_binary() -> str:
    """The haproxy executable, or a skip (a failure in CI)."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None
    )
    if found is not None:
        return found
    message = f"no haproxy here; install it: {INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (.ci/run must install it)", pytrace=False)
    pytest.skip(message)


@attrs.define
class Server:
    name: str
    process: trio.Process
    port: int

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@attrs.define
class Deployment:
    servers: dict[str, Server]
    proxy_port: int
    socket: Path
    pg_url: str

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.proxy_port}/v1/responses"

    async def admin(self, command: str) -> str:
        """One command on HAProxy's stats socket, its whole answer."""
        with trio.fail_after(5):
            stream = await trio.open_unix_socket(str(self.socket))
            async with stream:
                await stream.send_all(command.encode() + b"\n")
                data = b""
                while chunk := await stream.receive_some():
                    data += chunk
        return data.decode()

    async def states(self) -> dict[str, dict[str, str]]:
        """HAProxy's view of each server of the backend: `status`, `check_status`, ..."""
        text = (await self.admin("show stat")).removeprefix("# ")
        rows = csv.DictReader(line for line in text.splitlines() if line)
        return {r["svname"]: r for r in rows if r["pxname"] == "proto" and r["svname"] in
                self.servers}  # fmt: skip

    async def wait_for(self, done: Callable[[dict[str, dict[str, str]]], bool]) -> None:
        """Until HAProxy's view satisfies `done` (polled: HAProxy tells no one), at most 20 s."""
        for _ in range(400):
            states = await self.states()
            if done(states):
                return
            await trio.sleep(0.05)
        raise AssertionError(f"HAProxy never got there: {states}")


async def serve(nursery: trio.Nursery, name: str, pg_url: str, script: Path) -> Server:
    command = [
        *(sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", pg_url),
        *("--store-timeout", "2", "--api-key", KEY, "--script", str(script)),
        # cold is cold: a rebuilt turn's cached_tokens is 0, a warm one's is not
        *("--no-prefix-cache", "--decode-rate", "400", "--prefill-rate", "1000000"),
        *("--drain-delay", "3", "--shutdown-grace", "2", "--log-level", "info"),
    ]
    process: trio.Process = await nursery.start(
        partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
    )
    assert process.stdout is not None
    line = await read_line(process.stdout)
    port = int(line.split("listening on http://127.0.0.1:")[1].split("/")[0])
    return Server(name, process, port)


@asynccontextmanager
async def deployed(pg_url: str, workload: Workload, tmp_path: Path) -> AsyncIterator[Deployment]:
    """Two servers on `pg_url` following `workload`'s script, HAProxy in front, both UP."""
    haproxy = haproxy_binary()
    script = tmp_path / "script.json"
    segments = [
        {"text": s.text, "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                        for c in s.tool_calls]}
        for s in workload.script().segments
    ]  # fmt: skip
    script.write_bytes(orjson.dumps({"segments": segments}))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            servers = {n: await serve(nursery, n, pg_url, script) for n in ("one", "two")}
        proxy_port = free_port()
        env = {
            **os.environ,
            "PROXY_BIND": f"127.0.0.1:{proxy_port}",
            "SERVER_ONE": f"127.0.0.1:{servers['one'].port}",
            "SERVER_TWO": f"127.0.0.1:{servers['two'].port}",
            "HAPROXY_SOCKET": str(tmp_path / "haproxy.sock"),
        }
        log = (tmp_path / "haproxy.log").open("wb")
        proxy: trio.Process = await nursery.start(
            partial(trio.run_process, [haproxy, "-f", str(CONFIG), "-db"], env=env,
                    stdout=log, stderr=subprocess.STDOUT, check=False)
        )  # fmt: skip
        deployment = Deployment(servers, proxy_port, tmp_path / "haproxy.sock", pg_url)
        try:
            with trio.fail_after(20):
                for _ in range(400):  # HAProxy is listening once its stats socket is there
                    if deployment.socket.exists():
                        break
                    assert proxy.poll() is None, (tmp_path / "haproxy.log").read_text()
                    await trio.sleep(0.05)
                await deployment.wait_for(
                    lambda s: all(r["status"] == "UP" and r["check_status"] == "L7OK"
                                  for r in s.values()) and len(s) == 2
                )  # fmt: skip
            yield deployment
        finally:
            for server in servers.values():
                if server.process.returncode is None:
                    server.process.kill()
            proxy.kill()
            log.close()


# -- a Codex-shaped client --------------------------------------------------------------------


def _item(item: dict[str, Any]) -> tuple[Any, ...]:
    """An item as both sides must agree on it, ids and status aside."""
    if item["type"] == "message":
        return ("message", item["role"], tuple(part["text"] for part in item["content"]))
    if item["type"] == "function_call":
        return ("function_call", item["call_id"], item["name"], item["arguments"])
    if item["type"] == "function_call_output":
        return ("function_call_output", item["call_id"], item["output"])
    return (item["type"],)


def served_by(headers: tuple[tuple[bytes, bytes], ...]) -> str:
    """Which process HAProxy sent an upgrade to (`X-Proto-Server`, deploy/haproxy.cfg)."""
    return dict(headers)[b"x-proto-server"].decode()


@attrs.define
class Turn:
    response: dict[str, Any]
    server: str
    rebuilt: bool  # the first turn served on a connection made after a drop


@attrs.define
class CodexRollout:
    """One rollout as Codex 0.171 drives it: a `generate: false` warm-up, the task, then a turn
    per tool output, each chained to the last completed Response; every one `store: true`."""

    index: int
    workload: Workload
    url: str
    turns: list[Turn] = attrs.Factory(list)
    #: Every item the client sent and every output item it received, in order.
    conversation: list[dict[str, Any]] = attrs.Factory(list)
    server: str | None = None  # where its connection is now
    in_flight: bool = False
    drops: int = 0
    cut: int = 0  # turns whose answer a drop cut off, sent again
    progress: trio.Event = attrs.Factory(trio.Event)

    def frames(self) -> list[list[dict[str, Any]]]:
        """The input of each request, the tool outputs filled in as the calls come."""
        opening = self.workload.opening(f"rollout-{self.index}")
        return [opening[:1], opening[1:]]

    def create(self, new_items: list[dict[str, Any]], warmup: bool) -> dict[str, Any]:
        session = f"rollout-{self.index}"
        frame: dict[str, Any] = {
            "type": "response.create", "model": MODEL, "stream": True, "input": new_items,
            "tools": list(self.workload.tools), "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": session,
            "client_metadata": {"session_id": session, "thread_id": session},
        }  # fmt: skip
        if warmup:
            frame["generate"] = False
        if self.turns:
            frame["previous_response_id"] = self.turns[-1].response["id"]
        return frame

    async def run(self) -> None:
        opening = self.frames()
        pending: list[dict[str, Any]] | None = opening[0]
        warmup, fresh = True, False
        attempts = 0
        while pending is not None:
            attempts += 1
            assert attempts < 200, "the rollout did not finish"
            try:
                async with open_websocket_url(
                    self.url, extra_headers=CODEX_HEADERS, max_message_size=16 * 2**20
                ) as ws:
                    self.server = served_by(ws.handshake_headers)
                    while pending is not None:
                        frame = self.create(pending, warmup)
                        self.in_flight = True
                        await ws.send_message(orjson.dumps(frame).decode())
                        while True:
                            event = orjson.loads(await ws.get_message())
                            if event["type"] in TERMINAL:
                                break
                        self.in_flight = False
                        assert event["type"] == "response.completed", event
                        response = event["response"]
                        self.turns.append(Turn(response, self.server, fresh))
                        fresh = False
                        self.conversation += [*pending, *response["output"]]
                        pending = self.next_input(response, warmup, opening)
                        warmup = False
                        self.progress.set()
                        self.progress = trio.Event()
            except (ConnectionClosed, HandshakeError, OSError):
                # the process behind the connection is gone: reconnect through the proxy, send
                # the turn that was cut again, chained to the last completed one
                self.cut += self.in_flight
                self.drops += 1
                self.in_flight, fresh = False, True
                await trio.sleep(0.1)

    def next_input(
        self, response: dict[str, Any], warmup: bool, opening: list[list[dict[str, Any]]]
    ) -> list[dict[str, Any]] | None:
        if warmup:
            return opening[1]
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        if not calls:
            return None  # the final answer
        rounds = sum(1 for item in self.conversation if item["type"] == "function_call_output")
        return [self.workload.tool_output(rounds, call["call_id"]) for call in calls]


async def test_a_killed_process_behind_haproxy_loses_nothing_its_clients_finish_from_the_store(
    pg_url: str, tmp_path: Path
) -> None:
    workload = make_workload(seed=3, rounds=6, output_kb=(0.5, 1.0), large_share=0.0,
                             developer_kb=4.0, final_tokens=40)  # fmt: skip
    async with deployed(pg_url, workload, tmp_path) as deployment:
        rollouts = [CodexRollout(i, workload, deployment.ws_url) for i in range(4)]
        with trio.fail_after(120):
            async with trio.open_nursery() as clients:
                for rollout in rollouts:
                    clients.start_soon(rollout.run)
                # mid-rollout: every rollout has done its warm-up and two turns, and one of
                # those on `one` has a turn in flight
                for _ in range(20_000):
                    if all(len(r.turns) >= 3 for r in rollouts) and any(
                        r.server == "one" and r.in_flight for r in rollouts
                    ):
                        break
                    assert all(len(r.turns) < workload.turns + 1 for r in rollouts), "too late"
                    await trio.sleep(0.005)
                victims = [r for r in rollouts if r.server == "one"]
                done_before = {r.index: len(r.turns) for r in rollouts}
                deployment.servers["one"].process.kill()  # SIGKILL: no drain, no goodbye
        with trio.fail_after(10):
            assert await deployment.servers["one"].process.wait() == -signal.SIGKILL
        async with httpx.AsyncClient(
            base_url=deployment.http, headers={"authorization": f"Bearer {KEY}"}, timeout=10
        ) as http:
            with trio.fail_after(30):
                got = {
                    turn.response["id"]: await http.get(f"/v1/responses/{turn.response['id']}")
                    for rollout in rollouts
                    for turn in rollout.turns
                }
                stateless = []
                for rollout in rollouts:  # the final turn's prompt, sent whole to a fresh turn
                    history = rollout.conversation[: -len(rollout.turns[-1].response["output"])]
                    body = {"model": MODEL, "input": history, "tools": list(workload.tools),
                            "store": False}  # fmt: skip
                    stateless.append(await http.post("/v1/responses", json=body))
        store = PostgresStore(pg_url)
        try:
            with trio.fail_after(30):
                chains = [await store.chain(r.turns[-1].response["id"], owner=owner_id(KEY))
                          for r in rollouts]  # fmt: skip
        finally:
            await store.aclose()
    assert victims and len(victims) < len(rollouts)  # leastconn spread them over both
    assert any(r.cut for r in victims)  # a turn was cut in the middle and sent again
    for rollout, chain, fresh in zip(rollouts, chains, stateless, strict=True):
        # each finished: warm-up, a turn per tool round, the final answer
        assert len(rollout.turns) == workload.turns + 1
        final = rollout.turns[-1].response
        assert final["output"][-1]["content"][0]["text"] == workload.final
        if rollout in victims:
            # one drop, and its reconnect went through at once: a connection HAProxy still
            # sent to the dead process (not yet marked down) was refused and redispatched
            assert rollout.drops == 1
            assert rollout.turns[-1].server == "two"
            # the first turn after the drop chained to the last completed one, rebuilt cold
            (after,) = [t for t in rollout.turns if t.rebuilt]
            index = rollout.turns.index(after)
            # (a turn may have completed just as the process died, its answer already sent)
            assert index in (done_before[rollout.index], done_before[rollout.index] + 1)
            assert after.server == "two"
            assert after.response["previous_response_id"] == rollout.turns[index - 1].response["id"]
            assert after.response["usage"]["input_tokens_details"]["cached_tokens"] == 0
        else:
            assert rollout.drops == 0
        # warm turns on a live connection re-read nothing
        warm = [t for t in rollout.turns[2:] if not t.rebuilt]
        assert all(t.response["usage"]["input_tokens_details"]["cached_tokens"] > 0 for t in warm)
        # every completed Response is retrievable, through the proxy, from either process
        for turn in rollout.turns:
            answer = got[turn.response["id"]]
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] == "completed"
        # the final turn's chain is exactly the Responses this client saw completed, and it
        # holds every item, in order: nothing the client sent or received was lost
        assert chain is not None
        assert [s.response.id for s in chain] == [t.response["id"] for t in rollout.turns]
        stored = [_item(as_json(item)) for item in chain_items(chain)]
        assert stored == [_item(item) for item in rollout.conversation]
        # and the final turn read all of it: as many tokens as the whole history sent afresh
        assert fresh.status_code == 200, fresh.text
        assert final["usage"]["input_tokens"] == fresh.json()["usage"]["input_tokens"]


async def test_a_sigtermed_process_leaves_the_rotation_by_readiness_before_it_stops_accepting(
    pg_url: str, tmp_path: Path
) -> None:
    workload = make_workload(seed=1, rounds=1, developer_kb=1.0, final_tokens=10)
    async with deployed(pg_url, workload, tmp_path) as deployment:
        one = deployment.servers["one"]
        with trio.fail_after(30):
            one.process.send_signal(signal.SIGTERM)
            started = trio.current_time()
            await deployment.wait_for(lambda s: s["one"]["status"].startswith("DOWN"))
            states = await deployment.states()
            # taken out by its answer (L7STS: a 503), while its port was still open, not by
            # a connection refused (L4CON)
            assert states["one"]["check_status"] == "L7STS", states["one"]
            assert states["two"]["status"] == "UP"
            async with httpx.AsyncClient(base_url=one.root, timeout=5) as direct:
                alive, ready = await direct.get("/healthz"), await direct.get("/readyz")
            assert one.process.returncode is None
            answered_by = []
            for _ in range(6):  # new connections, through the proxy: all to `two`
                async with httpx.AsyncClient(base_url=deployment.http, timeout=10) as http:
                    answer = await http.post(
                        "/v1/responses",
                        json={
                            "model": MODEL,
                            "input": "hi",
                            "tools": list(workload.tools),
                            "store": False,
                        },
                        headers={"authorization": f"Bearer {KEY}"},
                    )
                assert answer.status_code == 200, answer.text
                assert answer.json()["status"] == "completed", answer.text
                answered_by.append(answer.headers["x-proto-server"])
            async with open_websocket_url(deployment.ws_url, extra_headers=CODEX_HEADERS) as ws:
                upgraded_to = served_by(ws.handshake_headers)
            assert await one.process.wait() == 0
            stopped_after = trio.current_time() - started
    assert alive.status_code == 200
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "server_shutting_down"
    assert answered_by == ["two"] * 6
    assert upgraded_to == "two"
    # out of rotation (above) while it still answered, and it waited out its 3 s drain delay
    assert stopped_after >= 3
