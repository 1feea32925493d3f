"""`proto-server serve` as a user runs it: a real process, a real port, a clean stop."""

from __future__ import annotations

import json
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
from ..support.frames import create
from ..support.servers import read_line


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
async def test_serve_prints_where_it_listens_serves_and_stops_cleanly(
    nursery: trio.Nursery, stop: signal.Signals, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                check=False,
                env=env,
            )
        )
        assert process.stdout is not None and process.stderr is not None
        line = await read_line(process.stdout)
        assert line.startswith("proto-server listening on http://127.0.0.1:")
        ws_url = line.split("WebSocket ")[1].split(";")[0]
        async with connect(ws_url + "?dialect=prototype") as client:
            await client.send(create(tools=[]))
            events = await client.segment()
        assert events[-1]["type"] == "response.completed"
        process.send_signal(stop)
        assert await process.wait() == 0
        err = (await process.stderr.receive_some()).decode()
        assert f"{stop.name}, stopping" in err
    # the default store is a SQLite file in the user's data directory
    assert (tmp_path / "proto-server" / "responses.sqlite3").exists()


def test_a_bad_script_is_reported_before_listening(tmp_path: object) -> None:
    path = tmp_path / "bad.json"  # type: ignore[operator]
    path.write_text(json.dumps({"segments": [{"text": 3}]}))
    done = subprocess.run(
        [sys.executable, "-m", "proto_server", "serve", "--script", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "segments[0].text must be a string" in done.stderr


def test_bench_local_runs_the_local_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench local` is the local model's warm-against-cold benchmark: with a model path that
    does not exist it stops at loading the model, one line and exit 2."""
    from proto_server.cli import main

    assert main(["bench", "local", "--model", "/nonexistent/model.gguf"]) == 2
    assert "local model" in capsys.readouterr().err


def test_bench_without_the_benchmarks_installed_says_what_to_install() -> None:
    """The benchmarks are a distribution of their own (benchmarks/): without them, `bench` says
    how to install them and exits 2; `serve` does not need them."""
    hidden = """
import sys
class Absent:  # as if the benchmarks were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "proto_server_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from proto_server.cli import main
sys.exit(main(["bench", "fleet"]))
"""
    done = subprocess.run(
        [sys.executable, "-c", hidden], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "pip install -e ./benchmarks" in done.stderr


def test_bench_refuses_a_setting_out_of_range_naming_its_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bench section's flags are its settings' fields: a value out of a field's range is
    one line naming the flag, exit 2 (as serve's are)."""
    from proto_server.cli import main

    assert main(["bench", "vllm", "--engine-url", "u", "--engine-pid", "1", "--turns", "0"]) == 2
    assert "proto-server bench vllm: --turns: must be at least 1, got 0" in (
        capsys.readouterr().err
    )


async def test_keys_from_the_environment_turn_auth_on(nursery: trio.Nursery) -> None:
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:"]
    env = {**os.environ, "PROTO_SERVER_API_KEYS": "k1, k2"}
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False, env=env)
        )
        assert process.stdout is not None
        http_url = (await read_line(process.stdout)).split("listening on ")[1].split(" ")[0]
        async with httpx.AsyncClient() as http:
            body = {"model": "m", "input": "hi"}
            refused = await http.post(f"{http_url}/responses", json=body)
            served = await http.post(
                f"{http_url}/responses", json=body, headers={"Authorization": "Bearer k2"}
            )
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    assert refused.status_code == 401
    assert served.status_code == 200


@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
async def test_serve_charges_a_stateless_repeat_only_past_its_shared_prefix(
    nursery: trio.Nursery, cache: bool
) -> None:
    """As a real engine would: the second stateless request resends the first's history, and
    the simulated GPU of `serve` finds its blocks in the prefix cache, unless it has none."""
    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0", "--store", ":memory:"]
    if not cache:
        command.append("--no-prefix-cache")
    history = [{"role": "user", "content": "word " * 300}]
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        http_url = (await read_line(process.stdout)).split("listening on ")[1].split(" ")[0]
        usage = []
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(2):
                body = {"model": "m", "input": history, "store": False}
                answer = await http.post(f"{http_url}/responses", json=body)
                assert answer.status_code == 200, answer.text
                usage.append(answer.json()["usage"])
                history = [*history, *answer.json()["output"], {"role": "user", "content": "more"}]
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    first, second = (u["input_tokens_details"]["cached_tokens"] for u in usage)
    assert first == 0
    if cache:  # whole 64-token blocks of what the first request sent, and of its answer
        assert second % 64 == 0 and usage[0]["input_tokens"] - 64 <= second
        assert second <= usage[1]["input_tokens"]
    else:
        assert second == 0


def test_a_prefix_cache_smaller_than_a_block_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "--prefix-cache-tokens: must be at least 64" in serve_refusal(
        capsys, "--prefix-cache-tokens", "10"
    )


def serve_refusal(capsys: pytest.CaptureFixture[str], *flags: str, store: str = ":memory:") -> str:
    """`proto-server serve` with `flags` must refuse to start (exit 2); what it said."""
    from proto_server.cli import main

    try:
        code = main(["serve", "--port", "0", "--store", store, *flags])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "keys", [[""], ["  "], ["k1", ""]], ids=["empty", "blank", "empty-beside-a-real-one"]
)
def test_an_empty_api_key_refuses_to_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, keys: list[str]
) -> None:
    monkeypatch.delenv("PROTO_SERVER_API_KEYS", raising=False)
    flags = [part for key in keys for part in ("--api-key", key)]
    assert "--api-key must not be empty" in serve_refusal(capsys, *flags)


@pytest.mark.parametrize(
    ("value", "said"),
    [(" , ", "holds no key"), ("", "holds no key"), ("k1,,k2", "empty key"), ("k1,", "empty key")],
)
def test_a_key_list_with_blanks_or_nothing_in_it_refuses_to_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    monkeypatch.setenv("PROTO_SERVER_API_KEYS", value)
    err = serve_refusal(capsys)
    assert "PROTO_SERVER_API_KEYS" in err and said in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--store-max-responses", "0"), ("--store-max-responses", "-3"),
     ("--store-max-age", "-1"), ("--store-max-age", "0"), ("--store-timeout", "0")],
)  # fmt: skip
def test_store_limits_that_would_delete_everything_refuse_to_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str
) -> None:
    err = serve_refusal(capsys, f"{flag}={value}", store=str(tmp_path / "store.sqlite3"))
    assert f"{flag}: must be" in err and f"got {value}" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["sqlite:///x.db", "mysql://user@db.example/responses"])
def test_a_store_url_other_than_postgresql_is_refused_and_creates_nothing(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    url: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    err = serve_refusal(capsys, store=url)
    scheme = url.split(":")[0]
    assert f"proto-server: --store: {scheme}:// URLs are not supported" in err
    assert "pass a file path, :memory: or a postgresql:// URL" in err
    assert list(tmp_path.iterdir()) == []


def test_a_postgresql_store_that_does_not_answer_stops_start_up_and_hides_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ..support.servers import free_port

    url = f"postgresql://proto:s3cret@127.0.0.1:{free_port()}/proto"
    err = serve_refusal(capsys, "--store-timeout", "1", store=url)
    assert "cannot open the store postgresql://proto:***@127.0.0.1:" in err
    assert "s3cret" not in err and "start it or pass another --store" in err


BAD_FLAGS = [
    ("--port", "70000", "must be between 0 and 65535, got 70000"),
    ("--port", "-1", "must be between 0 and 65535, got -1"),
    ("--max-message-bytes", "0", "must be at least 1024, got 0"),
    ("--max-connection-lifetime", "0", "must be positive, got 0.0"),
    ("--max-connections", "0", "must be at least 1, got 0"),
    ("--max-queued-requests", "0", "must be at least 1, got 0"),
    ("--max-queued-requests", "-1", "must be at least 1, got -1"),
    ("--max-lanes", "0", "must be at least 1, got 0"),
    ("--max-pending-steers", "0", "must be at least 1, got 0"),
    ("--handshake-timeout", "nan", "must be positive, got nan"),
    ("--suspend-timeout", "-3", "must be positive, got -3.0"),
    ("--max-suspended-rollouts", "0", "must be at least 1, got 0"),
    ("--shutdown-grace", "0", "must be positive, got 0.0"),
    ("--drain-delay", "-1", "must be between 0 and 3600, got -1.0"),
    ("--drain-delay", "nan", "must be between 0 and 3600, got nan"),
    ("--decode-rate", "0", "must be positive, got 0.0"),
    ("--prefill-rate", "-1", "must be positive, got -1.0"),
    ("--burst-rate", "0", "must be positive, got 0.0"),
    ("--burst-share", "2", "must be between 0 and 1, got 2.0"),
]


@pytest.mark.parametrize(("flag", "value", "why"), BAD_FLAGS)
def test_a_setting_out_of_range_is_refused_at_start_naming_its_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, why: str
) -> None:
    from proto_server.cli import main

    assert main(["serve", "--store", ":memory:", flag, value]) == 2
    assert capsys.readouterr().err == f"proto-server: {flag}: {why}\n"


@pytest.mark.parametrize("flag", ["--max-tokens", "--threads"])
def test_the_local_model_flags_must_be_positive(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    from proto_server.cli import main

    assert main(["serve", "--generator", "local", flag, "0"]) == 2
    assert capsys.readouterr().err == f"proto-server: {flag}: must be at least 1, got 0\n"


def test_every_validated_setting_the_cli_sets_has_its_flag() -> None:
    """Derived from the fields (core/settings.py): each is a flag the parser takes, and what
    it parses builds the class back with its defaults."""
    import attrs

    from proto_server.cli import SETTINGS, build_parser
    from proto_server.core.settings import flag_name, from_flags
    from proto_server.server.process.config import ServerConfig

    unset = {"client_queue_events", "chunk_queue", "max_request_head_bytes"}  # no flag
    # their own flags: --api-key also reads PROTO_SERVER_API_KEYS (--admin-key, its
    # PROTO_SERVER_ADMIN_KEY), --key-weight parses pairs
    own = {"api_keys": "--api-key", "key_weights": "--key-weight", "admin_key": "--admin-key"}
    for cls in SETTINGS:
        for field in attrs.fields(cls):
            if field.validator is None or field.name in unset:
                continue
            flag = own.get(field.name) or flag_name(field)
            assert flag is not None, field.name
            _, unknown = build_parser().parse_known_args(["serve", flag, "1"])
            assert unknown == [], field.name
    parsed = build_parser().parse_args(["serve"])
    assert [from_flags(cls, parsed) for cls in SETTINGS] == [cls() for cls in SETTINGS]
    assert from_flags(ServerConfig, build_parser().parse_args(["serve", "--max-memory", "3"])) == (
        ServerConfig(max_memory_bytes=3 * 1024 * 1024)
    )


def test_a_queue_of_minus_one_is_refused_by_the_real_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proto_server", "serve", "--max-queued-requests", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == "proto-server: --max-queued-requests: must be at least 1, got -1\n"


def test_permessage_deflate_is_one_flag_both_ways() -> None:
    from proto_server.cli import build_parser
    from proto_server.server.process.config import ServerConfig

    def parsed(*flags: str) -> bool:
        return bool(build_parser().parse_args(["serve", *flags]).permessage_deflate)

    assert parsed() is ServerConfig().permessage_deflate is False  # off: see docs/flags.md
    assert parsed("--permessage-deflate") is True
    assert parsed("--permessage-deflate", "--no-permessage-deflate") is False
    with pytest.raises(SystemExit):
        parsed("--permessage-deflate=yes")


async def test_serve_with_permessage_deflate_compresses_for_a_client_that_offers_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    from proto_server_bench.transports import CountingStream, open_websocket

    command = [sys.executable, "-m", "proto_server", "serve", "--port", "0"]
    command += ["--permessage-deflate", "--store", ":memory:"]
    with trio.fail_after(30):
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert process.stdout is not None
        port = int((await read_line(process.stdout)).split("127.0.0.1:")[1].split("/")[0])
        stream = CountingStream(await trio.open_tcp_stream("127.0.0.1", port))
        ws = await open_websocket(nursery, stream, "127.0.0.1", "/v1/responses", deflate=True)
        await ws.send_message(json.dumps({"type": "response.create", "input": "hi"}))
        decoded = 0
        while True:
            message = await ws.get_message()
            decoded += len(message)
            if json.loads(message)["type"] == "response.completed":
                break
        assert stream.received < decoded / 2  # the Response objects, compressed
        await ws.aclose()
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0


def test_a_bad_key_weight_or_target_fill_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from proto_server.cli import main

    assert main(["serve", "--store", ":memory:", "--key-weight", "k1=2"]) == 2
    assert "--key-weight: expected KEY_ID=WEIGHT" in capsys.readouterr().err
    assert main(["serve", "--store", ":memory:", "--kv-target-fill", "2"]) == 2
    assert "--kv-target-fill: must be between 0.01 and 1" in capsys.readouterr().err


def test_shared_admission_without_a_shared_store_or_a_capacity_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from proto_server.cli import main

    shared = ["--admission-shared", "--kv-capacity-tokens", "1000"]
    assert main(["serve", "--store", ":memory:", *shared]) == 2
    assert "--admission-shared needs a store the processes share" in capsys.readouterr().err
    assert main(["serve", "--store", str(tmp_path / "s.sqlite3"), "--admission-shared"]) == 2
    assert "pass --kv-capacity-tokens or --kv-capacity-from-engine" in capsys.readouterr().err
