"""``model.recompute: auto`` (issue 27): the planner recomputes only where the run does not fit,
and every rank of a run takes the same decision (the smallest device memory over the ranks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides


def _plan_cfg(name: str, *overrides: str):
    from training.plan.cli import load_plan_config

    return load_plan_config(str(ROOT / "configs" / name), None, list(overrides))


@pytest.mark.parametrize("config,gib,expected", [
    ("gpt2_1.2b.yaml", 31.7, "full"),   # the paper's V100 32 GB: 35.6 GiB without recomputation
    ("gpt2_1.2b.yaml", 79.2, "none"),   # an H100: fits
    ("gpt2_8.3b.yaml", 39.4, "full"),   # an A100 40 GB at TP 8: 37.8 GiB > 90 % (fused attention: selective
    ("gpt2_4.2b.yaml", 39.4, "none"),   # would save nothing) ... at TP 4: 34.2 GiB fits
])
def test_auto_recomputes_only_where_the_run_does_not_fit(config, gib, expected):
    from training.plan.recompute import HEADROOM, resolve

    cfg = _plan_cfg(config)
    assert cfg.model.recompute == "auto"
    choice = resolve(cfg, dp=1, dtype="fp16", device_gib=gib, on_gpu=True)
    assert choice.recompute == expected and choice.gib_selective is None
    assert (choice.gib_without > HEADROOM * gib) is (expected == "full") and choice.gib_with < choice.gib_without
    assert ("full recomputation" if expected == "full" else "no recomputation") in choice.describe()


@pytest.mark.parametrize("gib,expected", [(80.0, "none"), (50.0, "selective"), (40.0, "full")])
def test_auto_chooses_selective_where_the_scores_are_kept_and_that_fits(gib, expected):
    """With Megatron's fp16 attention core (the s^2 scores kept) the 8.3B model at TP 8 needs 49.1 GiB per device
    without recomputation, 37.8 with selective, 19.7 with full: auto takes the cheapest that fits 90 %."""
    from training.plan.recompute import resolve

    cfg = _plan_cfg("gpt2_8.3b.yaml", "model.attention_softmax_in_fp32=true")
    choice = resolve(cfg, dp=1, dtype="fp16", device_gib=gib, on_gpu=True)
    assert (round(choice.gib_without, 1), round(choice.gib_selective, 1), round(choice.gib_with, 1)) == (49.1, 37.8, 19.7)
    assert choice.recompute == expected, choice.describe()
    assert {"none": "no", "selective": "selective", "full": "full"}[expected] + " recomputation" in choice.describe()


def test_auto_counts_attention_scores_where_they_are_kept():
    """On CPU (and with Megatron's fp16 attention stabilisers) the s^2 scores are kept: more memory."""
    from training.plan.recompute import resolve

    cfg = _plan_cfg("gpt2_1.2b.yaml")
    gpu = resolve(cfg, 1, "fp16", 80.0, on_gpu=True)
    cpu = resolve(cfg, 1, "fp16", 80.0, on_gpu=False)
    assert cpu.gib_without > gpu.gib_without + 10
    assert resolve(_plan_cfg("gpt2_1.2b.yaml", "model.recompute=full"), 1, "fp16", 80.0, True) is None
    assert resolve(_plan_cfg("gpt2_1.2b.yaml", "model.activation_checkpointing=true"), 1, "fp16", 80.0, True) is None


def test_planner_report_names_the_choice():
    import contextlib
    import io

    from training.plan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--config", str(ROOT / "configs" / "gpt2_1.2b.yaml"), "--gpu", "v100", "--flash-attention"]) == 0
    assert "model.recompute: auto -> full on v100-32gb: full recomputation: 35.6 GiB" in out.getvalue()


def _auto_worker(rank, world, overrides, fake_gib):
    import training.resolve as resolve_mod
    from training.config import load_config
    from training.trainer import Trainer

    # this rank's device memory as a given number (the planner's input): rank r reads fake_gib[r]
    resolve_mod.device_memory_gib = lambda device: fake_gib[rank]
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides)
    t = Trainer(resolve_mod.resolve_run(cfg))
    t.train()
    saved = json.loads((Path(cfg.run.dir) / "config.json").read_text())["model"]["recompute"]
    return t.cfg.model.recompute, saved


def _auto_each(rank, world, runs):
    """Rank worker: ``_auto_worker`` for each (overrides, fake_gib) of ``runs``, one after the other (one launch)."""
    return [_auto_worker(rank, world, overrides, fake_gib) for overrides, fake_gib in runs]


@needs_corpus
def test_trainer_resolves_auto_alike_on_every_rank(spm_model, tmp_path):
    """Two TP ranks told 64 GiB and 10^-5 GiB: both recompute (the smaller memory decides), the run trains, and
    RUN_DIR/config.json keeps the decision; with room on both, neither recomputes."""
    common = {"parallel.tensor": 2, "train.iters": 2, "model.recompute": "auto"}
    ranks = run_distributed(_auto_each, 2, [(tiny_overrides(spm_model, tmp_path / "tight", **common), [64.0, 1e-5]),
                                            (tiny_overrides(spm_model, tmp_path / "roomy", **common), [64.0, 64.0])], timeout=600)
    tight, roomy = ([r[i] for r in ranks] for i in range(2))  # per rank, as two launches would return them
    assert tight == [("full", "full"), ("full", "full")]  # CPU: selective would not fit 10^-5 GiB either
    assert roomy == [("none", "none"), ("none", "none")]
