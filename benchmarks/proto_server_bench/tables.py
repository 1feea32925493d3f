"""What every bench report is made of: targets that hold or not, and plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Target:
    name: str
    holds: bool | None  # None: not measured in this run
    detail: str


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
