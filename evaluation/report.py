"""Short result tables on stdout and atomic JSON files; the output path checked before any work."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from evaluation.errors import EvalError


def check_output_path(path: str | Path, what: str = "--json") -> None:
    """Refuse, in one line and before any scoring, an output file that could not be written at the end: an
    existing folder, a path through a file, or a folder where no file can be created (tried for real: a
    permission check alone says yes to root). Missing folders are fine (the atomic writer creates them)."""
    p = Path(path)
    if p.is_dir():
        raise EvalError(f"{what} {p} is a folder: give the path of a JSON file to write")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise EvalError(f"{what} {p}: {parent} is a file, not a folder: choose another output path")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.probe-")
    except OSError as e:
        raise EvalError(f"{what} {p}: cannot write into {parent} ({e.strerror or e}): choose a writable "
                        f"output path") from None
    os.close(fd)
    os.unlink(probe)


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


