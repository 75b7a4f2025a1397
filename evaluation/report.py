"""Short result tables on stdout and atomic JSON files."""
from __future__ import annotations

from typing import Any



def format_table(title: str, rows: list[tuple[str, Any]]) -> str:
    """Two-column text table; floats with 4 decimals (6 significant digits for large values)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 1e5 else f"{v:.6g}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [(k, fmt(v)) for k, v in rows]
    w0 = max([len(title)] + [len(k) for k, _ in cells])
    w1 = max([len(v) for _, v in cells] + [1])
    line = "-" * (w0 + w1 + 3)
    out = [title, line] + [f"{k:<{w0}}   {v:>{w1}}" for k, v in cells] + [line]
    return "\n".join(out)


