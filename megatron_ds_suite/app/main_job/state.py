"""What the main job remembers between invocations: RUN/state.json, the stage fingerprints' inputs and
the outcome of each stage in this invocation."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ds_suite.core import atomic


class StageFailed(RuntimeError):
    """A stage's command failed; the message names the stage and its log."""


class Skipped(Exception):
    """A stage that cannot run here (no file and no network); not an error."""


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_id(path: str | Path) -> list[Any]:
    st = os.stat(path)
    return [str(Path(path).resolve()), st.st_size, int(st.st_mtime)]


def atomic_write(path: Path, text: str) -> None:
    atomic.write_text(path, text)


class State:
    """RUN/state.json: {stage: {fingerprint, status, seconds, summary, ...}}, rewritten atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, stage: str) -> dict[str, Any]:
        return self.data.get(stage, {})

    def set(self, stage: str, **rec: Any) -> None:
        self.data[stage] = rec
        atomic_write(self.path, json.dumps(self.data, indent=2, default=str) + "\n")

    def done(self, stage: str, fingerprint: str) -> bool:
        r = self.get(stage)
        return r.get("status") == "done" and r.get("fingerprint") == fingerprint



@dataclass
class Outcome:
    """What happened to a stage in this invocation (for the console and the report)."""

    name: str
    status: str  # ran | reused | skipped
    seconds: float
    summary: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def read_if_file(path: str) -> str:
    return Path(path).read_text() if Path(path).is_file() else ""


def tree_id(folder: str) -> list[Any]:
    p = Path(folder)
    return [file_id(f) for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else []


def latest_iteration(run_dir: Path) -> int | None:
    f = run_dir / "checkpoints" / "latest"
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    try:
        return int(tag.rsplit("_", 1)[-1])
    except ValueError:
        return None

