"""A run changes its data-parallel size and ZeRO stage through DeepSpeed's universal checkpoint (issue 42 item 3):
``training.tools.to_universal`` (DeepSpeed's ``ds_to_universal``) and ``train.load_universal`` (DeepSpeed's
``checkpoint.load_universal``).

A ZeRO-1 run at TP 2 x DP 2 stops at step 4 and continues at DP 2 to step 10 (the reference); its step-4 checkpoint,
converted, starts a ZeRO-2 run at TP 2 x DP 1 that goes on to step 10 with the reference's losses (fp32, within 1e-5
relative: the same global batches, only the gradient reduction order differs) and LR schedule: the weights, Adam
moments (a reset would change every loss after step 5), data position and schedule are carried.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS, STOP, TP = 10, 4, 2


def _train(spec, run_dir, zero, exit_at=None, load_universal=None):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": TP, "parallel.zero_stage": zero,
                                          "train.iters": STEPS, "train.exit_at": exit_at or "null",
                                          "train.log_interval": 1, "train.eval_interval": 0,
                                          "train.save_interval": exit_at or 0,
                                          "train.load_universal": load_universal or "null"})
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    t.train()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return ([(r["iteration"], r["loss"], r["lr"]) for r in rows if "event" not in r],
            type(t.engine.optimizer).__name__, t.ds_config.get("checkpoint"))


def _stop_then_continue(rank, world, spec, run_dir):
    _train(spec, run_dir, 1, exit_at=STOP)
    return _train(spec, run_dir, 1)


def _from_universal(rank, world, spec, run_dir, universal):
    return _train(spec, run_dir, 2, load_universal=universal)


@needs_corpus
def test_zero1_dp2_continues_at_zero2_dp1_through_the_universal_checkpoint(spm_model, tmp_path):
    from training.tools.to_universal import convert

    src, uni = tmp_path / "src", tmp_path / "universal"
    ref, opt, _ = run_distributed(_stop_then_continue, 2 * TP, spm_model, str(src), timeout=600)[0]
    assert opt == "DeepSpeedZeroOptimizer" and [r[0] for r in ref] == list(range(1, STEPS + 1))
    convert(src, uni, tag=f"iter_{STOP:07d}")
    assert (uni / "latest_universal").read_text() == f"iter_{STOP:07d}"
    assert (uni / f"iter_{STOP:07d}" / "zero" / "layers.0.attn.qkv.weight" / "exp_avg.pt").is_file()
    got, opt, ds_checkpoint = run_distributed(_from_universal, TP, spm_model, str(tmp_path / "dst"), str(uni),
                                              timeout=600)[0]
    assert opt == "DeepSpeedZeroOptimizer" and ds_checkpoint == {"load_universal": True}
    assert [r[0] for r in got] == list(range(STOP + 1, STEPS + 1))
    tail = ref[STOP:]
    torch.testing.assert_close(torch.tensor([r[1] for r in got]), torch.tensor([r[1] for r in tail]),
                               rtol=1e-5, atol=0)
    assert [r[2] for r in got] == [r[2] for r in tail]  # the LR schedule goes on where it was
    assert ref[-1][1] < ref[0][1]  # it learns
