"""A run changes its data-parallel size, ZeRO stage and TP degree through DeepSpeed's universal checkpoint (issue 42
item 3): ``training.tools.to_universal`` (DeepSpeed's ``ds_to_universal``) and ``train.load_universal`` (DeepSpeed's
``checkpoint.load_universal``).

A ZeRO-1 run at TP 1 x DP 2 trains 10 steps, saving at step 4 (the reference: a resume continues bitwise,
test_zero2.py). Its step-4 checkpoint, converted, starts a ZeRO-2 run at TP 2 x DP 2 that saves at step 7; that one,
converted (its TP slices merged), starts a ZeRO-1 run at TP 1 x DP 4 (the issue's DP 2 -> 4). Each continues with
the reference's losses (fp32, within 1e-5 relative: the same global batches, only the reduction order differs) and
learning rates: the weights and Adam moments, cut for the new TP rank and DP partition (a reset of the moments would
change every loss after the first step), data position and schedule are carried. 2 + 4 + 4 processes of a 2-layer
model; DeepSpeed's cut of every parameter kind (GPT-2, Llama with GQA, BERT) is checked bitwise in
tests/unit/test_universal.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS = 10


def _train(rank, world, spec, run_dir, zero, save_interval, load_universal=None, tp=1):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": tp, "parallel.zero_stage": zero,
                                          "train.iters": STEPS, "train.log_interval": 1, "train.eval_interval": 0,
                                          "train.save_interval": save_interval, "train.keep_last": 3,
                                          "train.load_universal": load_universal or "null"})
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    t.train()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return ([(r["iteration"], r["loss"], r["lr"]) for r in rows if "event" not in r],
            type(t.engine.optimizer).__name__, t.ds_config.get("checkpoint"))


def _continues(got, ref, start):
    """``got`` (a run started from the step-``start`` checkpoint) has ``ref``'s iterations, losses and rates after it."""
    tail = ref[start:]
    assert [r[0] for r in got] == [r[0] for r in tail] == list(range(start + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r[1] for r in got]), torch.tensor([r[1] for r in tail]),
                               rtol=1e-5, atol=0)
    assert [r[2] for r in got] == [r[2] for r in tail]  # the LR schedule goes on where it was


@needs_corpus
def test_tp_dp_and_zero_stage_change_through_the_universal_checkpoint(spm_model, tmp_path):
    from megatron_ds_suite.core.errors import ConfigError
    from training.config import load_config
    from training.tools.to_universal import convert
    from training.universal import check_source

    ref, opt, ds = run_distributed(_train, 2, spm_model, str(tmp_path / "dp2"), 1, 4, timeout=600)[0]
    assert opt == "DeepSpeedZeroOptimizer" and ds is None and ref[-1][1] < ref[0][1]  # ZeRO-1, and it learns
    convert(tmp_path / "dp2", tmp_path / "u4", tag="iter_0000004")
    assert (tmp_path / "u4" / "latest_universal").read_text() == "iter_0000004"
    assert not list(tmp_path.glob(".u4.converting-*"))  # the temporary folder was renamed into place
    with pytest.raises(ConfigError, match=r"^--out .*u4 exists and is not empty: choose a new directory$"):
        convert(tmp_path / "dp2", tmp_path / "u4", tag="iter_0000004")
    moments = torch.load(tmp_path / "u4" / "iter_0000004" / "zero" / "layers.0.attn.qkv.weight" / "exp_avg_sq.pt",
                         weights_only=False)["param"]
    assert moments.shape == (3 * 64, 64) and moments.min() >= 0 and moments.max() > 0  # the whole tensor, trained
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"train.load_universal={tmp_path / 'u4'}",
                                                            "parallel.zero_stage=2"])
    with pytest.raises(ConfigError, match=r"has a padded vocabulary of 1024 rows but this run pads to 1200 at TP=2: "
                                          r"set model.make_vocab_size_divisible_by=512 to keep them$"):
        check_source(cfg, 2, 1, "", 1200)
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"train.load_universal={tmp_path / 'u4'}",
                                                            "parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"comes from a ZeRO-1 run and this run is ZeRO-3: DeepSpeed's universal load "
                                          r"reads the model files of its own stage .*; set parallel.zero_stage=1 or 2"):
        check_source(cfg, 1, 1, "", 1024)
    # TP 1 x DP 2 ZeRO-1 -> TP 2 x DP 2 ZeRO-2 (the 1000-piece vocabulary pads to 1024 rows at TP 1 and 2)
    tp2, opt, ds = run_distributed(_train, 4, spm_model, str(tmp_path / "tp2"), 2, 7, str(tmp_path / "u4"), 2,
                                   timeout=600)[0]
    assert opt == "DeepSpeedZeroOptimizer" and ds == {"load_universal": True}
    _continues(tp2, ref, 4)
    # TP 2 x DP 2 ZeRO-2 -> TP 1 x DP 4 ZeRO-1
    convert(tmp_path / "tp2", tmp_path / "u7", tag="iter_0000007")
    merged = torch.load(tmp_path / "u7" / "iter_0000007" / "zero" / "layers.0.attn.qkv.weight" / "exp_avg_sq.pt",
                        weights_only=False)["param"]
    assert merged.shape == moments.shape and not torch.equal(merged, moments)  # TP 2's slices merged, trained on
    dp4, _, _ = run_distributed(_train, 4, spm_model, str(tmp_path / "dp4"), 1, 0, str(tmp_path / "u7"),
                                timeout=600)[0]
    _continues(dp4, ref, 7)
