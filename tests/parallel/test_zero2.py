"""ZeRO-2 and ZeRO-3 beside tensor and data parallelism (issue 42): DeepSpeed's own stage-2 optimizer (gradients and
optimizer states sharded over the DP ranks) and stage-3 optimizer (each TP shard's parameters too) train the
TP 2 x DP 2 model as ZeRO-0 does, and a stopped ZeRO-2 or ZeRO-3 run resumes exactly.

One 4-rank launch runs, in turn: ZeRO-0, ZeRO-2 and ZeRO-3 in fp32 for ten steps (losses within 1e-5 relative;
ZeRO-3 saves at step 10: each TP rank's shard whole in its own file, which the offline readers merge), the ZeRO-2
and ZeRO-3 runs stopped at step 4 and resumed to step 10 (every loss and the final weights bitwise those of the run
that never stopped), and fp16 at ZeRO-0, ZeRO-2 and ZeRO-3 with overflows planted at steps 3 and 4 (the same steps
skipped, the same loss scales with ``precision.hysteresis: 1``; ZeRO's scalers honour hysteresis, the ZeRO-0
wrappers do not; the applied steps' losses within 2e-3 relative: fp16 weights and activations, a different
reduction order).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS = 10
OVERFLOW_AT = (3, 4)


def _train(spec, run_dir, zero, dtype, exit_at=None, plant=False, save=0):
    from training.checkpoint import gathered_state_dict
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 2, "parallel.zero_stage": zero, "precision.dtype": dtype,
                                          "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 8,
                                          "precision.hysteresis": 1, "precision.max_consecutive_skipped": 0,
                                          "train.iters": STEPS, "train.exit_at": exit_at or "null",
                                          "train.log_interval": 1, "train.eval_interval": 0,
                                          "train.save_interval": exit_at or save})
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    if plant:
        weight = t.model.layers[0].mlp.fc.weight
        weight.register_hook(lambda g: g * float("inf") if t.state.iteration + 1 in OVERFLOW_AT else g)
    t.train()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["iteration"], r["loss"], r["loss_scale"], r["step_applied"]) for r in rows if "event" not in r]
    # this rank's TP shard of every weight (ZeRO-3: gathered over the DP ranks)
    return logged, type(t.engine.optimizer).__name__, gathered_state_dict(t.model, to_rank0_only=False)


def _worker(rank, world, spec, tmp):
    out = {}
    for name, zero, dtype, exit_at, plant in (("zero0", 0, "fp32", None, False), ("zero2", 2, "fp32", None, False),
                                              ("zero3", 3, "fp32", None, False), ("z3stopped", 3, "fp32", 4, False),
                                              ("z3resumed", 3, "fp32", None, False),
                                              ("stopped", 2, "fp32", 4, False), ("resumed", 2, "fp32", None, False),
                                              ("zero0_fp16", 0, "fp16", None, True), ("zero2_fp16", 2, "fp16", None, True),
                                              ("zero3_fp16", 3, "fp16", None, True)):
        run_dir = f"{tmp}/{name.replace('resumed', 'stopped')}"
        out[name] = _train(spec, run_dir, zero, dtype, exit_at, plant, STEPS if zero == 3 and dtype == "fp32" else 0)
    return out


@needs_corpus
def test_zero2_and_zero3_with_tp2_dp2_train_as_zero0_and_resume_exactly(spm_model, tmp_path):
    from training import safe_load
    from training.checkpoint_reader import GATHERED_WEIGHTS, load_merged_state_dict

    ranks = run_distributed(_worker, 4, spm_model, str(tmp_path), timeout=900)
    r = ranks[0]
    assert r["zero0"][1] == "AdamW" and r["zero2"][1] == "DeepSpeedZeroOptimizer"
    a, b = r["zero0"][0], r["zero2"][0]
    assert [x[0] for x in a] == [x[0] for x in b] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([x[1] for x in b]), torch.tensor([x[1] for x in a]), rtol=1e-5, atol=0)
    assert a[-1][1] < a[0][1]  # it learns
    # ZeRO-3 at TP 2 x DP 2 (DeepSpeed's stage 3 partitions each TP shard over its DP group)
    z3 = r["zero3"][0]
    assert r["zero3"][1] == "DeepSpeedZeroOptimizer_Stage3" and [x[0] for x in z3] == [x[0] for x in a]
    torch.testing.assert_close(torch.tensor([x[1] for x in z3]), torch.tensor([x[1] for x in a]), rtol=1e-5, atol=0)
    folder = tmp_path / "zero3" / "checkpoints" / f"iter_{STEPS:07d}"
    for tp_rank in range(2):  # DP rank 0 of TP rank t (global rank t) wrote TP shard t whole
        saved = safe_load.load(folder / GATHERED_WEIGHTS.format(tp_rank))
        assert saved["tp_rank"] == tp_rank
        assert all(torch.equal(saved["module"][k], v) for k, v in ranks[tp_rank]["zero3"][2].items())
    merged, _, _ = load_merged_state_dict(tmp_path / "zero3")  # what evaluation and export read
    assert merged["layers.0.attn.qkv.weight"].shape == (3 * 64, 64)
    # ZeRO-3 stopped at 4 and resumed from DeepSpeed's per-TP-rank files: every step and weight bitwise
    assert r["z3resumed"][0] == z3
    assert all(torch.equal(r["z3resumed"][2][k], v) for k, v in r["zero3"][2].items())
    # stopped at 4 and resumed: the same metrics file, every step bitwise the uninterrupted run's, the same weights
    assert r["resumed"][0] == b
    assert all(torch.equal(r["resumed"][2][k], r["zero2"][2][k]) for k in r["zero2"][2])
    # the two DP replicas of each TP shard (ranks 0 and 2, 1 and 3) hold the same weights after ZeRO-2's gather
    for first, second in ((0, 2), (1, 3)):
        w1, w2 = ranks[first]["zero2"][2], ranks[second]["zero2"][2]
        assert all(torch.equal(w1[k], w2[k]) for k in w1)
    # fp16 with overflows planted at steps 3 and 4: ZeRO-2 and ZeRO-3 (TP 2 x DP 2) skip the steps ZeRO-0 skips,
    # with the same loss scales, and the applied steps' losses agree within 2e-3 relative
    f0 = r["zero0_fp16"][0]
    assert r["zero3_fp16"][1] == "DeepSpeedZeroOptimizer_Stage3"
    applied = [i for i, x in enumerate(f0) if x[3]]
    for name in ("zero2_fp16", "zero3_fp16"):
        f = r[name][0]
        assert [x[3] for x in f0] == [x[3] for x in f] == [k not in OVERFLOW_AT for k in range(1, STEPS + 1)], name
        assert [x[2] for x in f0] == [x[2] for x in f], name
        torch.testing.assert_close(torch.tensor([f[i][1] for i in applied]), torch.tensor([f0[i][1] for i in applied]),
                                   rtol=2e-3, atol=0, msg=name)


def test_zero2_with_pipeline_parallelism_is_one_line():
    from megatron_ds_suite.core.errors import ConfigError
    from training.config import load_config

    with pytest.raises(ConfigError, match=r"^parallel.zero_stage=2 with parallel.pipeline=2: DeepSpeed's pipeline "
                                          r"engine runs ZeRO stage 0 or 1 only; set") as e:
        load_config(ROOT / "configs" / "gpt2_tiny.yaml", ["parallel.zero_stage=2", "parallel.pipeline=2"])
    assert "\n" not in str(e.value)
