"""Resharding fp16 (ZeRO-0 and ZeRO-1) checkpoints keeps the fp32 master weights and Adam's moments exactly,
through a TP change and through one that changes the padded vocabulary; the converted fp16 run resumes with
the original losses and learning rates.

The three cases' runs are made by one module fixture: one two-rank launch trains every TP=2 source, one
one-rank launch resumes every converted run (the launches, not the 4-step runs, are what costs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ds_suite.core.errors import ConfigError
from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import metric_steps, needs_corpus, tiny_overrides, train_stages

# id: (ZeRO stage, make_vocab_size_divisible_by, (padded vocabulary at TP=2, after the reshard to TP=1))
# vocabulary 1000: pads to 1024 at TP=2 and TP=1 (x128), or to 1152 (96 x 2), which TP=1 keeps unless repadded
# to 1056 (96 x 1); the kept padding resumes with the same losses (the padding columns are in the softmax)
CASES = {"fp16-same-vocab": (0, 128, (1024, 1024)),
         "fp16-zero1-vocab-1152-repadded-to-1056": (1, 96, (1152, 1056)),
         "fp16-zero2-vocab-1152-kept": (2, 96, (1152, 1152))}
TAG = "iter_0000002"


def _common(zero: int, divisible_by: int) -> dict:
    return {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.warmup_iters": 0, "train.global_batch_size": 4,
            "model.make_vocab_size_divisible_by": divisible_by, "precision.dtype": "fp16",
            "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 12,
            "parallel.zero_stage": zero}


def _train_all(rank, world, runs):
    """Rank worker: ``train_stages`` for each (overrides, stages) of ``runs``, one after the other."""
    for overrides, stages in runs:
        train_stages(rank, world, overrides, stages)


def _resume_all(rank, world, runs):
    """One-rank worker: for each (refused overrides or None, overrides) of ``runs``, the ConfigError the first
    raises (None if it trains), then a run with the second; returns the messages."""
    refusals = []
    for refused, overrides in runs:
        message = None
        if refused is not None:
            try:
                train_stages(rank, world, refused, [[]])
            except ConfigError as e:
                message = str(e)
        refusals.append(message)
        train_stages(rank, world, overrides, [[]])
    return refusals


@pytest.fixture(scope="module")
def converted(spm_model, tmp_path_factory):
    """{case id: (source run at TP=2, its TP=1 reshard, the refusal of a resume without the recorded padding)}."""
    from training.checkpoint_reader import read_client_state
    from training.tools.reshard import reshard

    root = tmp_path_factory.mktemp("reshard_fp16")
    dirs = {case: (root / case / "a", root / case / "b") for case in CASES}
    sources = []
    for case, (zero, divisible_by, padded) in CASES.items():
        same_vocab = padded[0] == padded[1]  # dummy vocabulary rows take part in the softmax: only then same losses
        over = tiny_overrides(spm_model, dirs[case][0], **{"parallel.tensor": 2}, **_common(zero, divisible_by))
        sources.append((over, [["train.exit_at=2"], []] if same_vocab else [["train.exit_at=2"]]))
    run_distributed(_train_all, 2, sources, timeout=300 * len(sources))
    resumes, resumed_cases = [], []
    for case, (zero, divisible_by, padded) in CASES.items():
        a, b = dirs[case]
        reshard(a, tp=1, pp=1, out=b, tag=TAG, repad_vocab=padded[1] != padded[0])
        if padded[0] != padded[1]:
            continue
        # the converted run resumes from iteration 2 in fp16; kept padding: its config records what it needs at TP=1
        divisible = read_client_state(b, TAG)["config"]["model"]["make_vocab_size_divisible_by"]
        common = _common(zero, divisible_by)
        refused = None if divisible == divisible_by else \
            tiny_overrides(spm_model, b, **{"parallel.tensor": 1}, **common)
        resumed = {**common, "model.make_vocab_size_divisible_by": divisible}
        resumes.append((refused, tiny_overrides(spm_model, b, **{"parallel.tensor": 1}, **resumed)))
        resumed_cases.append(case)
    refusals = dict(zip(resumed_cases, run_distributed(_resume_all, 1, resumes, timeout=300 * len(resumes))[0]))
    return {case: (*dirs[case], refusals.get(case)) for case in CASES}


def _state(run_dir: Path, tag: str) -> tuple[dict, dict]:
    """(merged fp32 masters and moments read by DeepSpeed in the run's own layout, checkpoint metadata)."""
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools import reshard_optim

    _, _, meta = load_merged_state_dict(run_dir, tag)
    return reshard_optim.extract(run_dir, tag, meta, run_dir.parent / f".extract_{run_dir.name}"), meta


@needs_corpus
@pytest.mark.parametrize("case", list(CASES))
def test_reshard_fp16_tp2_to_tp1_keeps_masters_and_moments(converted, case):
    zero, divisible_by, padded = CASES[case]
    a, b, refused = converted[case]
    same_vocab = padded[0] == padded[1]
    src, meta_a = _state(a, TAG)
    dst, meta_b = _state(b, TAG)
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
    # the converted run resumed from iteration 2 in fp16 with the original losses and learning rates
    divisible = meta_b["config"]["model"]["make_vocab_size_divisible_by"]
    if divisible != divisible_by:  # the kept padding: a resume with the old setting was refused in one line
        assert divisible == padded[1] == 1152
        assert refused is not None and "resume with model.make_vocab_size_divisible_by=1152" in refused
    else:
        assert refused is None
    sa, sb = metric_steps(a), metric_steps(b)
    assert sorted(sb) == [1, 2, 3, 4]
    for it in (3, 4):
        assert sb[it][1] == sa[it][1]
        assert abs(sb[it][0] - sa[it][0]) < 2e-3, (it, sa[it], sb[it])
