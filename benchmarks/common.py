"""Shared timing helpers for the benchmarks: interleaved repetitions, median and spread, machine info.

These machines are shared and noisy, so a comparison is never two separate runs: every candidate is
timed once per repetition, in a rotating order (A B, B A, A B, ...), and the report gives the median
and the min-max spread over repetitions, plus the load average before and after the run.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Samples:
    """Values of one measured quantity over repetitions (e.g. seconds per step)."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, spec: str = ".3f", scale: float = 1.0) -> str:
        """'median [min-max]' with each value multiplied by ``scale``."""
        return (f"{format(self.median * scale, spec)} [{format(self.lo * scale, spec)}"
                f"-{format(self.hi * scale, spec)}]")


def interleaved(candidates: dict[str, Callable[[], float]], reps: int, progress: bool = True) -> dict[str, Samples]:
    """Run each candidate ``reps`` times, rotating the order every repetition.

    Each callable returns its own measurement (seconds, or any number); the rotation spreads slow
    drifts of the machine (another job starting, thermal state) over all candidates alike.
    """
    from tqdm import tqdm

    names = list(candidates)
    out = {n: Samples() for n in names}
    for r in tqdm(range(reps), desc="repetitions", leave=False, disable=not progress):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].values.append(candidates[n]())
    return out


def ratio_samples(num: Samples, den: Samples) -> Samples:
    """Per-repetition ratios num[i] / den[i] (same repetition = same machine conditions)."""
    return Samples([a / b for a, b in zip(num.values, den.values)])


def timed(fn: Callable[[], object], n: int = 1) -> float:
    """Seconds per call of ``fn`` over ``n`` back-to-back calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


class CpuClock:
    """Wraps a timed callable to also record this process's CPU seconds (user + system, all threads)
    per call: on an oversubscribed machine wall time includes waiting for a core, CPU time does not
    (though it does include OpenMP threads spinning at barriers)."""

    def __init__(self, fn: Callable[[], float], n: int = 1):
        self.fn, self.n, self.cpu = fn, n, Samples()

    def __call__(self) -> float:
        c = time.process_time()
        wall = self.fn()
        self.cpu.values.append((time.process_time() - c) / self.n)
        return wall


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return "n/a"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, str]:
    """Facts that go next to every figure: date, machine, software, load."""
    import torch

    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{cpu_model()}, {os.cpu_count()} logical cores",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} intra-op threads",
        "python": platform.python_version(),
        "git": git_revision(),
        "load average (1/5/15 min)": load_average(),
    }


def command_line() -> str:
    """The command that produced the figures, as it can be pasted back (repo-relative python path)."""
    return ".venv/bin/python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])


def markdown_header(info: dict[str, str], load_after: str | None = None) -> str:
    lines = [f"Command: `{command_line()}`", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    if load_after is not None:
        lines.append(f"- load average after the run: {load_after}")
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
