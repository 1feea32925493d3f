"""The flag reference page (docs/flags.md), written from `serve`'s parser, so the page says
what the settings declare (core/settings.py derives their flags) and is never kept by hand.

`python -m proto_server.flag_reference > docs/flags.md` writes it; tests/unit/test_docs.py checks
that the committed page is this module's output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import attrs

from proto_server.cli import SETTINGS, build_parser
from proto_server.core.settings import FLAG, flag_name, range_of
from proto_server.launch import default_store_path

INTRO = """\
# Flags

`proto-server serve` takes these flags (`proto-server serve --help` prints the same, with each
default). A setting's flag, help, default and range are declared once, on its field in
`Launch` or `LocalModel` (`launch.py`), `ServerConfig` (`server/process/config.py`),
`TimingModel` or `StoreRetention`, and its flag is derived from it (`core/settings.py`); this
page is written from the same parser and fields by
`python -m proto_server.flag_reference > docs/flags.md`, and a test fails when the two differ.

Every value is checked at start-up: one out of its range stops the server before it listens,
with exit status 2 and a line naming the flag and the range (see
[Limits and errors](limits.md#settings-are-checked-at-start-up)). A flag in another unit than
its setting (MiB, days) takes any positive number of its unit.

| flag | default | range | what |
|---|---|---|---|
"""


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise LookupError("the parser has no serve command")


def _default(action: argparse.Action) -> str:
    default: Any = action.default
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if action.dest == "store" and default == str(default_store_path()):
        return "`$XDG_DATA_HOME/proto-server/responses.sqlite3` (`~/.local/share/...`)"
    if default is None:
        return "not set"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"`{default:g}`"
    return f"`{default}`"


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.choices is not None:
        return f"{names} `{{{','.join(map(str, action.choices))}}}`"
    if action.metavar is not None:
        return f"{names} `{action.metavar}`"
    return names


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")


def ranges() -> dict[str, str]:
    """Each flag's range in words, from its field's validator (core/ranges.py)."""
    found = {}
    for cls in SETTINGS:
        for field in attrs.fields(cls):
            flag, says = flag_name(field), range_of(field)
            if flag is not None and says is not None:
                found[flag] = says if field.metadata[FLAG].unit == 1 else "positive"
    return found


def render() -> str:
    """The page: one row per `serve` flag, in the parser's order."""
    rows, allowed = [], ranges()
    for action in serve_parser()._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        says = allowed.get(action.option_strings[0], "")
        rows.append(
            f"| {_cell(_flag(action))} | {_cell(_default(action))} | {_cell(says)} "
            f"| {_cell(action.help or '')} |"
        )
    return INTRO + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
