"""Per-step metrics: one rank-0 log line with a fixed key order, RUN_DIR/metrics.jsonl, TensorBoard.

The FLOPs behind tokens/s, TFLOP/s and MFU are counted by :mod:`training.plan.accounting`, the formulas
the planner uses too (import them from there): model FLOPs (what MFU counts, no recomputation) =
72 B s l h^2 (1 + s/(6h)) + 6 B s h V (Narayanan et al. 2021, eq. 3); activation checkpointing adds one
more forward of the transformer layers (hardware FLOPs, 96 instead of 72), which MFU does not credit.
BERT (:func:`~training.plan.accounting.bert_flops_per_iteration`) has the same transformer layers but projects to the
vocabulary only at its masked positions, plus a pooler and the sentence-order head;
:func:`~training.plan.accounting.flops_per_iteration` picks the count for ``cfg.model.arch``.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import IO, Any

from megatron_ds_suite.core.program import stderr_is_terminal

__all__ = ["KEYS", "MetricsWriter", "format_line", "kept_metric_lines", "progress_enabled"]

logger = logging.getLogger("training")

KEYS = ("iteration", "lr", "loss", "loss_scale", "grad_norm", "skipped", "tokens_per_s", "tflops_per_device", "mfu")


def progress_enabled(setting: bool | None, stream: IO[str] | None = None) -> bool:
    """Whether to draw a progress bar: ``train.progress_bar`` when set, else only when ``stream`` (stderr)
    is a terminal (a bar redrawn with carriage returns is noise in a Slurm or CI log file)."""
    if setting is not None:
        return setting
    return stderr_is_terminal(stream)


def format_line(m: dict[str, Any], total_iters: int) -> str:
    def f(v: Any, spec: str) -> str:
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    # consumed samples and ms/iteration: the fields Megatron users grep for (optional for other callers)
    samples = f" | consumed samples {m['consumed_samples']:,}" if m.get("consumed_samples") is not None else ""
    ms = f" | ms/iter {f(1000 * m['step_time_s'], '.1f')}" if m.get("step_time_s") is not None else ""
    return (f"iter {m['iteration']:>6d}/{total_iters}{samples}{ms} | lr {f(m['lr'], '.3e')} | loss {f(m['loss'], '.4f')} | "
            f"loss scale {f(m['loss_scale'], '.0f')} | grad norm {f(m['grad_norm'], '.3f')} | "
            f"skipped {m['skipped']} | tokens/s {f(m['tokens_per_s'], ',.0f')} | "
            f"TFLOP/s/device {f(m['tflops_per_device'], '.3f')} | MFU {f(100 * m['mfu'] if m['mfu'] is not None else None, '.2f')}%"
            + (f" | mem {f(m['memory_gib'], '.2f')} GiB" if m.get("memory_gib") is not None else ""))


def kept_metric_lines(path: Path, resume_iteration: int) -> list[str]:
    """The rows of ``path`` up to ``resume_iteration``. A line that is not a complete JSON row (a write
    cut short by a kill or a full disk, typically the last one) is dropped with a warning instead of
    making every resume crash."""
    keep: list[str] = []
    bad: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                it = int(row["iteration"])
            except (ValueError, TypeError, KeyError):
                bad.append(lineno)
                continue
            if it <= resume_iteration:
                keep.append(line.rstrip("\n"))
    if bad:
        logger.warning("%s: dropped %d damaged line(s) (line %s%s: an interrupted write) while resuming", path,
                       len(bad), bad[0], " ..." if len(bad) > 1 else "")
    return keep


class MetricsWriter:
    """Rank-0 sink: log line, JSON lines (flushed each step), optional DeepSpeed monitor.

    The monitor (W&B, TensorBoard, CSV) gets one step axis for everything: consumed samples, Megatron's and
    the one DeepSpeed's engine logs its own ``Train/Samples/*`` on; the iteration is a logged value
    (``train/iteration``). W&B drops any value logged at a step below its current one, so logging ours by
    iteration while DeepSpeed logged by samples lost every one of ours."""

    def __init__(self, run_dir: Path, total_iters: int, enabled: bool, monitor: Any = None,
                 resume_iteration: int | None = None, samples: int = 0) -> None:
        """``resume_iteration``: continuing a run from a checkpoint at that iteration; rows logged
        after it by the interrupted run are dropped so the file reads as one uninterrupted run.
        ``samples``: consumed samples so far (the monitor's step for events before the first step)."""
        self.enabled, self.total, self.monitor = enabled, total_iters, monitor
        self.samples = samples
        self.file: IO[str] | None = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if resume_iteration is not None and path.is_file():
            keep = kept_metric_lines(path, resume_iteration)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(path)
            self.file = open(path, "a")
        else:
            self.file = open(path, "w")

    def step(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        logger.info(format_line(m, self.total))
        self.file.write(json.dumps({k: m[k] for k in KEYS} | {k: v for k, v in m.items() if k not in KEYS}) + "\n")
        self.file.flush()
        self.samples = int(m.get("consumed_samples", self.samples))
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"train/{k}", m[k], self.samples) for k in (*KEYS, "memory_gib")
                                       if isinstance(m.get(k), (int, float)) and not isinstance(m[k], bool)])

    def event(self, tag: str, values: dict[str, Any], iteration: int) -> None:
        """A non-step record (validation, the CPU peak, a RACE epoch) at ``iteration``; the monitor logs it at
        the consumed samples of the last step written (or those given at construction)."""
        if not self.enabled:
            return
        self.file.write(json.dumps({"event": tag, "iteration": iteration, **values}) + "\n")
        self.file.flush()
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"{tag}/{k}", v, self.samples) for k, v in values.items()
                                       if isinstance(v, (int, float)) and not isinstance(v, bool)])

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
