"""README.md's promises that can be checked without running them twice."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = shell_blocks()[1]
    assert test_command.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def test_the_run_command_starts_the_server_with_its_defaults() -> None:
    assert shell_blocks()[0].endswith("pip install -e . && proto-server serve")


@pytest.mark.timeout(60)
def test_the_readme_python_examples_run_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """The openai SDK's WebSocket mode chained through a tool call, then the blocking client
    (which defines `tools` from the first), against the default model as `serve` has it."""
    from proto_server.client import RolloutState
    from proto_server.hosted import serving

    sdk, blocking = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    with serving() as host:
        assert host.url is not None
        namespace: dict[str, Any] = {}
        exec(sdk.replace("http://127.0.0.1:8000/v1", host.url), namespace)
        assert "I ran exec_command" in capsys.readouterr().out  # the answer after the call
        exec(blocking, namespace)
        assert namespace["rollout"].state is RolloutState.COMPLETED
