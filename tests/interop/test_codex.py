"""The real Codex CLI drives rollouts end to end: 0.107.0 in the prototype dialect, 0.171.0 in
the launched dialect over WebSocket and, with WebSockets turned off, over HTTP/SSE.

Codex runs the scripted `exec_command` calls on this machine (they create files we check), and the
server's own records say what it saw. The clients come from tests/clients/package.json (the
README's test command installs them); PROTO_SERVER_CODEX_0107 / _0171 may point elsewhere.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from ..support.servers import Running, StartServer

CLIENTS = Path(__file__).resolve().parents[1] / "clients" / "node_modules"

CONFIG = """\
model = "gpt-5.1-codex"
model_provider = "proto"
approval_policy = "never"
sandbox_mode = "danger-full-access"
suppress_unstable_features_warning = true
{features}
[model_providers.proto]
name = "proto-server"
base_url = "{base_url}"
wire_api = "responses"
supports_websockets = {websockets}
"""

PROTOTYPE_FEATURES = """
[features]
responses_websockets = true
responses_websockets_v2 = false
"""

pytestmark = [pytest.mark.codex, pytest.mark.deadline(240)]  # a Codex run: up to 120 s


def codex(version: str) -> list[str]:
    override = os.environ.get(f"PROTO_SERVER_CODEX_{version.replace('.', '')[:4]}")
    if override:
        return [override]
    launcher = CLIENTS / f"codex-{version}" / "bin" / "codex.js"
    if not launcher.exists():
        pytest.fail(
            f"Codex CLI {version} not found at {launcher}. Install the test clients with "
            "`npm install --no-package-lock --prefix tests/clients`, or deselect these tests "
            "with `-m 'not codex'`."
        )
    return ["node", str(launcher)]


def three_files(out: Path, *, parallel: bool) -> dict[str, Any]:
    """Two tool rounds, the second with two parallel calls, then a final message; for a client
    that sends `parallel_tool_calls: false` (Codex 0.107) the two calls are two rounds."""
    b = {"name": "exec_command", "arguments": {"cmd": f"touch {out}/b"}}
    c = {"name": "exec_command", "arguments": {"cmd": f"echo ran > {out}/c"}}
    rounds = [{"tool_calls": [b, c]}] if parallel else [{"tool_calls": [b]}, {"tool_calls": [c]}]
    return {
        "segments": [
            {
                "text": "Creating the first file.",
                "tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"touch {out}/a"}}],
            },
            *rounds,
            {"text": "All three files are in place."},
        ]
    }


async def codex_rollout(
    start_server: StartServer,
    version: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    *,
    features: str = "",
    websockets: bool = True,
    parallel: bool = True,
    **config: Any,
) -> Running:
    """Serve `three_files`, run `codex exec` against it, and check Codex really ran the calls."""
    command = codex(version)
    out = tmp_path / "out"
    out.mkdir()
    running = await start_server(three_files(out, parallel=parallel), **config)
    caplog.set_level(logging.DEBUG, logger="proto_server")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        CONFIG.format(
            base_url=running.address.http_url,
            features=features,
            websockets=str(websockets).lower(),
        )
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home)}
    with trio.fail_after(120):
        done = await trio.run_process(
            [*command, "exec", "--skip-git-repo-check", "create the three files"],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            cwd=tmp_path,
            env=env,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert (out / "a").exists() and (out / "b").exists()
    assert (out / "c").read_text() == "ran\n"
    assert "All three files are in place." in done.stdout.decode()
    return running


def log_lines(caplog: pytest.LogCaptureFixture, message: str) -> list[Any]:
    return [r for r in caplog.records if r.getMessage() == message]


async def test_codex_0107_runs_a_whole_rollout_as_one_response(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    running = await codex_rollout(
        start_server, "0.107", tmp_path, caplog, features=PROTOTYPE_FEATURES, parallel=False
    )
    # ...over one connection: one response.create, then only appends
    opened = log_lines(caplog, "connection.opened")
    assert [(r.dialect, r.path) for r in opened] == [("prototype", "/v1/responses")]
    frames = log_lines(caplog, "client.event")
    assert {r.connection for r in frames} == {opened[0].connection}
    assert [r.type for r in frames] == ["response.create"] + ["response.append"] * 3
    assert not log_lines(caplog, "client.refused")
    (record,) = running.server.responses.turns  # one Response, four segments
    assert record.cached_tokens > 0


@pytest.mark.parametrize("deflate", [False, True], ids=["plain", "permessage-deflate"])
async def test_codex_0171_chains_turns_on_one_websocket(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, deflate: bool
) -> None:
    """Codex offers permessage-deflate: it chains alike whether the server takes it or not."""
    running = await codex_rollout(
        start_server, "0.171", tmp_path, caplog, permessage_deflate=deflate
    )
    opened = log_lines(caplog, "connection.opened")
    assert [(r.dialect, r.deflate) for r in opened] == [("launched", deflate)]
    assert [r.type for r in log_lines(caplog, "client.event")] == ["response.create"] * 4
    warmup, *turns = running.server.responses.turns
    # the warm-up built the state; every turn after it chained from the previous response
    # and rendered only its new items (tool outputs), never the ~20 KB of tools again
    assert warmup.source == "fresh" and warmup.rendered_input_tokens == warmup.prompt_tokens
    assert [t.source for t in turns] == ["cache", "cache", "cache"]
    for t in turns:
        assert t.rendered_input_tokens < t.prompt_tokens / 5
        assert t.cached_tokens + t.rendered_input_tokens == t.prompt_tokens


async def test_codex_0171_falls_back_to_http_when_websockets_are_off(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    running = await codex_rollout(start_server, "0.171", tmp_path, caplog, websockets=False)
    assert not log_lines(caplog, "connection.opened")
    assert [r.stream for r in log_lines(caplog, "http.create")] == [True, True, True]
    # stateless: every turn re-renders the whole history
    assert [t.source for t in running.server.responses.turns] == ["fresh"] * 3
    assert all(t.rendered_input_tokens == t.prompt_tokens for t in running.server.responses.turns)
