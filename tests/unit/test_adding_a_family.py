"""docs/adding-a-family.md's example family runs as the page shows it: its Python blocks,
executed in order, define a family whose frame gives it a parser and a call text."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).parents[2] / "docs" / "adding-a-family.md"


def test_the_pages_example_family_renders_and_reads_its_calls() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert blocks, "the page lost its example"
    scope: dict[str, object] = {}
    exec(compile("\n".join(blocks), str(PAGE), "exec"), scope)  # its asserts are the test
    assert type(scope["ACME"]).__name__ == "Acme"
