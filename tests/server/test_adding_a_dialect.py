"""docs/adding-a-dialect.md's example dialect runs as the page shows it: its Python blocks,
executed in order, register a dialect, serve it on 127.0.0.1 and speak it over a real socket."""

from __future__ import annotations

import re
from pathlib import Path

from proto_server.server.dialects.registry import DIALECTS

PAGE = Path(__file__).parents[2] / "docs" / "adding-a-dialect.md"


def test_the_pages_example_dialect_is_picked_by_name_and_serves_a_response() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert len(blocks) == 2, "the page lost its example"
    scope: dict[str, object] = {}
    # its asserts are the test; its client waits under trio.fail_after(30)
    try:
        exec(compile("\n".join(blocks), str(PAGE), "exec"), scope)
    finally:
        DIALECTS.pop("oneshot", None)  # the page registers it; no other test speaks it
