"""Resharding fp16 (ZeRO-0 and ZeRO-1) checkpoints keeps the fp32 master weights and Adam's moments exactly,
through a TP change and through one that changes the padded vocabulary; the converted fp16 run resumes with
the original losses and learning rates."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import metric_steps, needs_corpus, tiny_overrides, train_stages


def _state(run_dir: Path, tag: str) -> tuple[dict, dict]:
    """(merged fp32 masters and moments read by DeepSpeed in the run's own layout, checkpoint metadata)."""
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools import reshard_optim

    _, _, meta = load_merged_state_dict(run_dir, tag)
    return reshard_optim.extract(run_dir, tag, meta, run_dir.parent / f".extract_{run_dir.name}"), meta


@needs_corpus
@pytest.mark.parametrize("zero,divisible_by,padded", [(0, 128, (1024, 1024)), (1, 96, (1152, 1056)), (2, 96, (1152, 1152))],
                         ids=["fp16-same-vocab", "fp16-zero1-vocab-1152-repadded-to-1056", "fp16-zero2-vocab-1152-kept"])
def test_reshard_fp16_tp2_to_tp1_keeps_masters_and_moments(spm_model, tmp_path, zero, divisible_by, padded):
    from training.tools.reshard import reshard

    # vocabulary 1000: pads to 1024 at TP=2 and TP=1 (x128), or to 1152 (96 x 2), which TP=1 keeps unless repadded
    # to 1056 (96 x 1); the kept padding resumes with the same losses (the padding columns are in the softmax)
    common = {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.warmup_iters": 0, "train.global_batch_size": 4,
              "model.make_vocab_size_divisible_by": divisible_by, "precision.dtype": "fp16",
              "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 12,
              "parallel.zero_stage": zero}
    a, b = tmp_path / "a", tmp_path / "b"
    same_vocab = padded[0] == padded[1]  # dummy vocabulary rows take part in the softmax: only then same losses
    run_distributed(train_stages, 2, tiny_overrides(spm_model, a, **{"parallel.tensor": 2}, **common),
                    [["train.exit_at=2"], []] if same_vocab else [["train.exit_at=2"]])
    reshard(a, tp=1, pp=1, out=b, tag="iter_0000002", repad_vocab=padded[1] != padded[0])
    src, meta_a = _state(a, "iter_0000002")
    dst, meta_b = _state(b, "iter_0000002")
    assert (meta_a["padded_vocab_size"], meta_b["padded_vocab_size"]) == padded
    assert meta_b["dtype"] == "fp16" and meta_b["config"]["parallel"]["zero_stage"] == zero
    assert sorted(src) == sorted(dst)
    rounded = 0
    for name, s in src.items():
        d = dst[name]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            want = s[key][:padded[1]] if name.endswith("word_embeddings.weight") else s[key]
            torch.testing.assert_close(d[key], want, rtol=0, atol=0, msg=f"{name} {key}")
        assert float(d["step"]) == float(s["step"]) == 2.0
        assert s["exp_avg_sq"].abs().sum() > 0
        rounded += int(not torch.equal(s["master"], s["master"].half().float()))
    assert rounded > len(src) // 2  # the masters carry fp32 precision beyond the fp16 weights
    if not same_vocab:
        return
    # the converted run resumes from iteration 2 in fp16 with the original losses and learning rates
    divisible = meta_b["config"]["model"]["make_vocab_size_divisible_by"]
    if divisible != divisible_by:  # the kept padding: the new run's config records what it needs at TP=1
        assert divisible == padded[1] == 1152
        with pytest.raises(AssertionError, match="resume with model.make_vocab_size_divisible_by=1152"):
            run_distributed(train_stages, 1, tiny_overrides(spm_model, b, **{"parallel.tensor": 1}, **common), [[]])
    resumed = {**common, "model.make_vocab_size_divisible_by": divisible}
    run_distributed(train_stages, 1, tiny_overrides(spm_model, b, **{"parallel.tensor": 1}, **resumed), [[]])
    sa, sb = metric_steps(a), metric_steps(b)
    assert sorted(sb) == [1, 2, 3, 4]
    for it in (3, 4):
        assert sb[it][1] == sa[it][1]
        assert abs(sb[it][0] - sa[it][0]) < 2e-3, (it, sa[it], sb[it])
