"""README.md's promises that can be checked without running them twice."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = shell_blocks()[1]
    assert test_command.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def test_the_run_command_starts_the_server_with_its_defaults() -> None:
    assert shell_blocks()[0].endswith("pip install -e . && proto-server serve")
