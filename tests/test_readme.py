"""README.md's promises that can be checked without running them twice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_the_flags_table_lists_every_serve_flag_and_no_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The flags come from the settings' fields (core/settings.py) and `serve --help` lists
    them; the README's table must keep up with them."""
    from proto_server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = capsys.readouterr().out.split("\n\n", 1)[0]  # the usage lines: every flag once
    flags = set(re.findall(r"(--[a-z0-9-]+)", usage))
    section = (ROOT / "README.md").read_text().split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(--[a-z0-9-]+)", section, re.M))

    def pair(flag: str) -> str:  # a bool's other half: --x and --no-x
        return f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}"

    missing = {flag for flag in flags if flag not in listed and pair(flag) not in listed}
    assert not missing, f"serve flags the README's Flags table does not list: {sorted(missing)}"
    unknown = listed - flags
    assert not unknown, f"the README lists flags serve does not take: {sorted(unknown)}"
