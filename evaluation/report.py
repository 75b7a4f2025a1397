"""Short result tables on stdout and atomic JSON files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ds_suite.core import atomic


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


def write_json_atomic(path: str | Path, obj: dict[str, Any]) -> Path:
    """Write ``obj`` as indented JSON to a temporary name, then rename (never half-written)."""
    return atomic.write_json(path, obj, indent=2)
