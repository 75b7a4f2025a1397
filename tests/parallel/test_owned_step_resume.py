"""A run stopped and resumed equals the run that never stopped, with the step deciding on the device (issue 40).

fp16 and bf16 decide a skip on the device and fp16 moves its loss scale there, so the host learns of a skip only
when it reads. Overflows are planted between log steps; the run stops at a checkpoint (``train.exit_at``) and a
second process resumes it. The checkpoint must hold the device loss scale, the settled skip count and the LR
schedule set back for the skipped steps: every logged loss, loss scale, learning rate and skip count, and the
final weights, are bitwise those of the uninterrupted run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS, STOP = 10, 6
OVERFLOW_AT = (2, 3, 5, 8)  # iterations (1-based) whose gradients get an inf: none of them a log step


def _run_worker(rank, world, spec, run_dir, dtype, exit_at):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "precision.dtype": dtype, "precision.allow_fp16_on_cpu": "true",
                                          "precision.initial_scale_power": 8, "precision.loss_scale_window": 2,
                                          "precision.max_consecutive_skipped": 0, "optimizer.warmup_iters": 4,
                                          "train.iters": STEPS, "train.exit_at": exit_at or "null", "train.log_interval": 4,
                                          "train.save_interval": STOP, "train.eval_interval": 0,
                                          "train.global_batch_size": 4})
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    planted = t.model.layers[0].mlp.fc.weight
    planted.register_hook(lambda g: g * float("inf") if t.state.iteration + 1 in OVERFLOW_AT else g)
    t.train()
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def _logged(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r["loss"], r["loss_scale"], r["lr"], r["skipped"], r["step_applied"])
            for r in rows if "event" not in r]


def _runs_worker(rank, world, spec, runs):
    """One-rank worker: ``_run_worker`` for each (run_dir, dtype, exit_at) of ``runs``, one after the other."""
    return [_run_worker(rank, world, spec, *run) for run in runs]


@pytest.fixture(scope="module")
def runs(spm_model, tmp_path_factory):
    """{dtype: (whole run dir, its final weights, split run dir, its final weights)}: one process makes both dtypes'
    uninterrupted runs and stops both split runs at STOP, a second process resumes the split runs."""
    root = tmp_path_factory.mktemp("owned_step_resume")
    dtypes = ("fp16", "bf16")
    first = [(str(root / f"whole_{d}"), d, 0) for d in dtypes] + [(str(root / f"split_{d}"), d, STOP) for d in dtypes]
    wholes = run_distributed(_runs_worker, 1, spm_model, first, timeout=300 * len(first))[0][:len(dtypes)]
    resumed = run_distributed(_runs_worker, 1, spm_model, [(str(root / f"split_{d}"), d, 0) for d in dtypes], timeout=600)[0]
    return {d: (root / f"whole_{d}", w, root / f"split_{d}", r) for d, w, r in zip(dtypes, wholes, resumed)}


@needs_corpus
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_stop_and_resume_equals_the_uninterrupted_run_with_device_decided_skips(runs, dtype):
    whole_dir, whole, split_dir, resumed = runs[dtype]
    a, b = _logged(whole_dir), _logged(split_dir)
    assert [r[0] for r in a] == [4, 8, 10]
    assert b == a
    assert a[-1][4] == len(OVERFLOW_AT)  # every planted overflow skipped, and counted once across the resume
    if dtype == "fp16":  # window 2: the scale halves at each overflow and doubles after 2 applied steps
        assert a[-1][2] != 2.0**8
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
