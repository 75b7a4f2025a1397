"""Per-step metrics: one rank-0 log line with a fixed key order, RUN_DIR/metrics.jsonl, TensorBoard.

FLOPs per iteration follow Narayanan et al. 2021 (eq. 3): model FLOPs (what MFU counts, no
recomputation) = 72 B s l h^2 (1 + s/(6h)) + 6 B s h V; activation checkpointing adds one more
forward of the transformer layers (hardware FLOPs, 96 instead of 72), which MFU does not credit.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger("training")

KEYS = ("iteration", "lr", "loss", "loss_scale", "grad_norm", "skipped", "tokens_per_s", "tflops_per_device", "mfu")


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                              ffn: int | None = None) -> float:
    """Forward + backward model FLOPs of one iteration over ``batch`` sequences (no recomputation)."""
    ffn = ffn or 4 * hidden
    # per layer forward: QKV 6bsh^2 + proj 2bsh^2 + MLP 4bsh*ffn + attention 4bs^2h ; x3 for fwd+bwd
    per_layer = 2 * batch * seq * hidden * (4 * hidden + 2 * ffn) + 4 * batch * seq * seq * hidden
    logits = 2 * batch * seq * hidden * vocab
    return 3.0 * (layers * per_layer + logits)


def format_line(m: dict, total_iters: int) -> str:
    def f(v, spec):
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    return (f"iter {m['iteration']:>6d}/{total_iters} | lr {f(m['lr'], '.3e')} | loss {f(m['loss'], '.4f')} | "
            f"loss scale {f(m['loss_scale'], '.0f')} | grad norm {f(m['grad_norm'], '.3f')} | "
            f"skipped {m['skipped']} | tokens/s {f(m['tokens_per_s'], ',.0f')} | "
            f"TFLOP/s/device {f(m['tflops_per_device'], '.3f')} | MFU {f(100 * m['mfu'] if m['mfu'] is not None else None, '.2f')}%")


class MetricsWriter:
    """Rank-0 sink: log line, JSON lines (flushed each step), optional DeepSpeed monitor."""

    def __init__(self, run_dir: Path, total_iters: int, enabled: bool, monitor=None, resume_iteration: int | None = None):
        """``resume_iteration``: continuing a run from a checkpoint at that iteration; rows logged
        after it by the interrupted run are dropped so the file reads as one uninterrupted run."""
        self.enabled, self.total, self.monitor = enabled, total_iters, monitor
        self.file = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if resume_iteration is not None and path.is_file():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["iteration"] <= resume_iteration]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(path)
            self.file = open(path, "a")
        else:
            self.file = open(path, "w")

    def step(self, m: dict) -> None:
        if not self.enabled:
            return
        logger.info(format_line(m, self.total))
        self.file.write(json.dumps({k: m[k] for k in KEYS} | {k: v for k, v in m.items() if k not in KEYS}) + "\n")
        self.file.flush()
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"train/{k}", m[k], m["iteration"]) for k in KEYS[1:]
                                       if isinstance(m[k], (int, float))])

    def event(self, tag: str, values: dict, iteration: int) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"event": tag, "iteration": iteration, **values}) + "\n")
        self.file.flush()
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"{tag}/{k}", v, iteration) for k, v in values.items()
                                       if isinstance(v, (int, float))])

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
