"""Plain-text tables for benchmark output."""

from __future__ import annotations

from collections.abc import Sequence


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)
