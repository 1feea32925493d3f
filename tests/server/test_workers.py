"""`serve --workers N`: N server processes accepting on the one port their supervisor bound, a
worker that dies started again, a signal stopping all of them as one server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from ..support.clients import connect
from ..support.metrics import scrape, value
from ..support.servers import read_line


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def listening_inode(pid: int) -> set[str]:
    """The sockets a process holds (`socket:[inode]` names)."""
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            names.add(target)
    return names


async def start_workers(nursery: trio.Nursery, *flags: str) -> tuple[trio.Process, str]:
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store",
               ":memory:", "--workers", "2", *flags]  # fmt: skip
    process: trio.Process = await nursery.start(
        partial(
            trio.run_process, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False
        )
    )
    assert process.stdout is not None
    line = await read_line(process.stdout)
    assert line.startswith("proto-server listening on http://127.0.0.1:"), line
    assert "2 workers" in line
    return process, line.split("listening on ")[1].split(" ")[0]


async def wait_for_workers(
    supervisor: int, count: int, not_in: frozenset[int] = frozenset()
) -> list[int]:
    for _ in range(200):
        pids = children(supervisor)
        if len(pids) == count and not (set(pids) & not_in):
            return pids
        await trio.sleep(0.05)
    raise AssertionError(
        f"the supervisor never had {count} workers (it has {children(supervisor)})"
    )


@pytest.mark.slow
async def test_two_workers_share_the_port_serve_and_stop_together(nursery: trio.Nursery) -> None:
    with trio.fail_after(60):
        process, http_url = await start_workers(nursery)
        workers = await wait_for_workers(process.pid, 2)
        # every worker accepts on the socket the supervisor bound
        shared = listening_inode(process.pid)
        for worker in workers:
            assert listening_inode(worker) & shared
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(4):
                answer = await http.post(
                    f"{http_url}/responses", json={"model": "m", "input": "hi"}
                )
                assert answer.status_code == 200 and answer.json()["status"] == "completed"
        async with connect(http_url.replace("http://", "ws://", 1) + "/responses") as client:
            await client.send({"type": "response.create", "model": "m", "input": "hi"})
            events = await client.until("response.completed", "error")
        assert events[-1]["type"] == "response.completed"
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
        assert process.stderr is not None
        said = (await process.stderr.receive_some(65536)).decode()
    assert "SIGTERM, stopping 2 workers" in said
    assert not any(alive(worker) for worker in workers)  # gone with it


@pytest.mark.slow
async def test_a_worker_that_dies_is_started_again_and_the_server_goes_on(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(60):
        process, http_url = await start_workers(nursery, "--log-level", "warning")
        first = await wait_for_workers(process.pid, 2)
        os.kill(first[0], signal.SIGKILL)
        now = await wait_for_workers(process.pid, 2, not_in=frozenset({first[0]}))
        assert first[1] in now
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(4):
                answer = await http.get(f"{http_url.removesuffix('/v1')}/healthz")
                assert answer.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
        assert process.stderr is not None
        said = (await process.stderr.receive_some(65536)).decode()
    assert "worker.restarted" in said and f"pid={first[0]}" in said and "status=-9" in said


def metrics_dir(worker: int) -> Path:
    """The directory the supervisor gave `worker` for its metrics (from its environment)."""
    for entry in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"worker {worker} has no metrics directory")


@pytest.mark.slow
async def test_dead_workers_leave_their_totals_and_no_files_behind(nursery: trio.Nursery) -> None:
    """Killed 4 times, the workers leave one archive per type, not two files each time, and
    what the dead ones counted is still in every scrape."""
    served, kills = 4, 4
    labels = {"dialect": "http", "status": "completed"}
    with trio.fail_after(90):
        process, http_url = await start_workers(nursery, "--log-level", "warning")
        base = http_url.removesuffix("/v1")
        workers = await wait_for_workers(process.pid, 2)
        directory = metrics_dir(workers[0])
        body = {"model": "m", "input": "hi", "store": False}
        for _ in range(served):  # new connections each: the kernel spreads them over the workers
            async with httpx.AsyncClient(timeout=10) as http:
                assert (await http.post(f"{http_url}/responses", json=body)).status_code == 200
        async with httpx.AsyncClient(timeout=10) as http:
            before = value(await scrape(http, base), "proto_server_responses_total", **labels)
        assert before == served
        # each live worker: a counter, a histogram and one file per live-gauge mode
        per_worker = len(list(directory.glob(f"*_{workers[0]}.db")))
        assert per_worker >= 3
        files = []
        for kill in range(kills):
            victim = workers[kill % 2]
            os.kill(victim, signal.SIGKILL)
            workers = await wait_for_workers(process.pid, 2, not_in=frozenset({victim}))
            files.append(len(list(directory.glob("*.db"))))
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(4):  # whichever worker answers
                samples = await scrape(http, base)
                assert value(samples, "proto_server_responses_total", **labels) == served
                assert value(samples, "proto_server_connections_open") >= 1  # the scrape's own
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    # the live workers' files, and the dead ones' merged into two archives, however many died
    assert max(files) <= 2 * per_worker + 2, (files, per_worker)


def test_a_worker_that_cannot_start_stops_the_server_with_its_status(tmp_path: Path) -> None:
    """A store that cannot be opened fails every worker the same way: no restart loop."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--workers", "2",
         "--store", str(blocked / "responses.sqlite3")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "cannot open the store" in done.stderr and "a worker could not start" in done.stderr


@pytest.mark.parametrize("value", ["0", "-1"])
def test_workers_must_be_positive(capsys: pytest.CaptureFixture[str], value: str) -> None:
    from proto_server.cli import main

    assert main(["serve", "--store", ":memory:", "--workers", value]) == 2
    assert capsys.readouterr().err == f"proto-server: --workers: must be at least 1, got {value}\n"


def test_a_listen_fd_that_is_no_socket_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from proto_server.cli import main

    assert main(["serve", "--store", ":memory:", "--listen-fd", "987"]) == 2
    assert "--listen-fd 987 is no socket" in capsys.readouterr().err


@pytest.mark.slow
async def test_workers_without_a_shared_store_each_schedule_against_a_part_of_the_cache(
    nursery: trio.Nursery,
) -> None:
    """Workers on `:memory:` stores cannot see each other's admissions: each takes 1/N of the
    capacity, so together they never admit more than the engine holds."""
    with trio.fail_after(60):
        process, http_url = await start_workers(nursery, "--kv-capacity-tokens", "1000")
        await wait_for_workers(process.pid, 2)
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(4):  # whichever worker answers counts both (the largest, here)
                answer = await http.get(http_url.removesuffix("/v1") + "/metrics")
                assert "proto_server_kv_capacity_tokens 450.0" in answer.text  # 1000 / 2 x 0.9
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0


@pytest.mark.slow
async def test_workers_sharing_a_store_file_admit_against_the_whole_cache_together(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """--workers N with a store file turns --admission-shared on: each worker publishes its
    load there and reads the other's, and they schedule against the whole capacity (the
    rule each applies is tested with two servers in test_admission.py)."""
    with trio.fail_after(60):
        process, http_url = await start_workers(
            nursery, "--store", str(tmp_path / "s.sqlite3"), "--kv-capacity-tokens", "1000",
            "--admission-sync-interval", "0.1",
        )  # fmt: skip
        await wait_for_workers(process.pid, 2)
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(100):  # until each worker has read the other's load
                text = (await http.get(http_url.removesuffix("/v1") + "/metrics")).text
                if "proto_server_admission_peers 2.0" in text:
                    break
                await trio.sleep(0.1)
            else:
                raise AssertionError(f"the workers never saw each other:\n{text}")
            assert "proto_server_kv_capacity_tokens 900.0" in text  # 1000 x 0.9, shared
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
