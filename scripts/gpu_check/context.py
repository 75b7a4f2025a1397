"""Where the GPU smoke suite runs and how: a check's result row, the context every check runs its commands
through (torchrun, logs, the dry run's validation), and reading a run's loss curve.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data"


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL, SKIP, DRY-RUN
    detail: str
    seconds: float = 0.0


@dataclass
class Context:
    args: argparse.Namespace
    gpus: int
    dry: bool
    out: Path
    data: Path
    planned: list[str] = field(default_factory=list)

    # ---- running ----------------------------------------------------------------------------------
    def run(self, name: str, cmd: list[str], nproc: int = 1) -> None:
        """Run ``cmd`` (a ``-m module ...`` tail when nproc > 0) under torchrun with ``nproc`` processes."""
        full = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + cmd
                if nproc else [sys.executable] + cmd)
        self.planned.append(shlex.join(full))
        if self.dry:
            self.validate(cmd, nproc)
            return
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(full)}\n")
            f.flush()
            rc = subprocess.run(full, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"exit {rc}: see {log}")

    def validate(self, cmd: list[str], nproc: int) -> None:
        """Dry run: a planned pretraining command's config must load and fit its process count (the
        same checks the entry point makes before any process group), and an evaluation command must
        parse with evaluation's own parser, so a bad plan fails on CPU."""
        if cmd[:2] == ["-m", "evaluation"]:
            from evaluation.cli import build_parser

            try:
                build_parser().parse_args(cmd[2:])
            except SystemExit as e:
                raise ValueError(f"planned evaluation command does not parse: {shlex.join(cmd)}") from e
            return
        if cmd[:2] != ["-m", "training.pretrain"]:
            return
        from training.config import load_config
        from training.layout import check_world

        cfg = load_config(cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:])
        check_world(cfg, nproc)

    # ---- data -------------------------------------------------------------------------------------
    def gpt_overrides(self, run: str, **extra) -> list[str]:
        g = self.data / "tokenizers" / "gpt2"
        ov = {"data.corpus": "null", "data.text_files": f"[{self.data / 'corpus' / 'tinyshakespeare.txt'}]",
              "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(g / "gpt2-vocab.json"),
                                            "merges_file": str(g / "gpt2-merges.txt")}),
              "run.dir": str(self.out / run), "train.iters": str(self.args.steps), "train.progress_bar": "false",
              "precision.initial_scale_power": "16", "optimizer.lr": "6.0e-4", "optimizer.warmup_iters": "3",
              "train.micro_batch_size": "8", "train.global_batch_size": "16", "model.seq_length": "128", **extra}
        return [f"{k}={v}" for k, v in ov.items()]


def metrics(run_dir: Path) -> list[dict]:
    """Step rows of RUN_DIR/metrics.jsonl (events excluded)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "event" not in r and "loss" in r]


def loss_falls(run_dir: Path, max_skipped: int) -> tuple[bool, str]:
    m = metrics(run_dir)
    first, last = m[0]["loss"], m[-1]["loss"]
    skipped = int(m[-1].get("skipped") or 0)
    ok = math.isfinite(last) and last < first - 0.5 and skipped <= max_skipped
    return ok, f"loss {first:.2f} -> {last:.2f} over {len(m)} steps, {skipped} skipped (max {max_skipped})"
