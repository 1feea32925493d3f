"""The real Codex CLI 0.107.0, which speaks the prototype dialect, drives a rollout end to end.

Codex runs the scripted `exec_command` calls on this machine (they create files we check), and the
server must have seen one connection carrying one `response.create` and then only appends.
Install it with `npm install --prefix .npm @openai/codex@0.107.0` (the README's test command does),
or point PROTO_SERVER_CODEX_0107 at a `codex` executable of that version.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
import trio

from .conftest import StartServer

ROOT = Path(__file__).resolve().parents[1]
CODEX = Path(os.environ.get("PROTO_SERVER_CODEX_0107", ROOT / ".npm/node_modules/.bin/codex"))

CONFIG = """\
model = "gpt-5.1-codex"
model_provider = "proto"
approval_policy = "never"
sandbox_mode = "danger-full-access"
suppress_unstable_features_warning = true

[features]
responses_websockets = true
responses_websockets_v2 = false

[model_providers.proto]
name = "proto-server"
base_url = "{base_url}"
wire_api = "responses"
supports_websockets = true
"""


def codex_executable() -> Path:
    if not CODEX.exists():
        pytest.fail(
            f"Codex CLI not found at {CODEX}. Install it with "
            "`npm install --prefix .npm @openai/codex@0.107.0` or set PROTO_SERVER_CODEX_0107; "
            "deselect this test with `-m 'not codex'` to run without it."
        )
    return CODEX


@pytest.mark.codex
async def test_codex_0107_runs_a_whole_rollout_as_one_response(
    start_server: StartServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    codex = codex_executable()
    out = tmp_path / "out"
    out.mkdir()
    script = {
        "segments": [
            {
                "text": "Creating the first file.",
                "tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"touch {out}/a"}}],
            },
            {
                "tool_calls": [
                    {"name": "exec_command", "arguments": {"cmd": f"touch {out}/b"}},
                    {"name": "exec_command", "arguments": {"cmd": f"echo ran > {out}/c"}},
                ]
            },
            {"text": "All three files are in place."},
        ]
    }
    running = await start_server(script)
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG.format(base_url=running.address.http_url))
    caplog.set_level(logging.DEBUG, logger="proto_server")

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home)}
    with trio.fail_after(120):
        done = await trio.run_process(
            [str(codex), "exec", "--skip-git-repo-check", "create the three files"],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            cwd=tmp_path,
            env=env,
            check=False,
        )
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    # Codex really ran the commands the model asked for
    assert (out / "a").exists() and (out / "b").exists()
    assert (out / "c").read_text() == "ran\n"
    assert "All three files are in place." in stdout

    # ...over one connection: one response.create, then only appends
    opened = [r for r in caplog.records if r.getMessage() == "connection.opened"]
    assert [(r.dialect, r.path) for r in opened] == [("prototype", "/v1/responses")]  # type: ignore[attr-defined]
    frames = [r for r in caplog.records if r.getMessage() == "client.event"]
    assert {r.connection for r in frames} == {opened[0].connection}  # type: ignore[attr-defined]
    assert [r.type for r in frames] == [  # type: ignore[attr-defined]
        "response.create",
        "response.append",
        "response.append",
    ]
    assert not [r for r in caplog.records if r.getMessage() == "client.refused"]
