"""Training under DeepSpeed: TP x DP equivalence, learning on real text, fp16 overflow handling,
bad configs, and the deepspeed launcher end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, resume_worker, tiny_overrides, train_worker

TP1DP1 = {"train.iters": 6, "optimizer.lr": 3e-3, "optimizer.decay_style": "constant", "optimizer.warmup_iters": 0}
PIPE = {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.decay_style": "constant"}
FP16 = {"precision.dtype": "fp16", "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 8,
        "precision.max_consecutive_skipped": 3, "train.iters": 10, "parallel.tensor": 1, "train.global_batch_size": 2}


def _logits_worker(rank, world, run_dirs):
    from training.checkpoint_reader import load_model_for_eval

    tokens = torch.arange(32).view(1, 32) * 7 % 1000
    return [load_model_for_eval(d)[0](tokens).detach() for d in run_dirs]


def _two_ranks(rank, world, resume, pp2):
    """Two-rank worker: ``resume_worker`` for the (overrides, base) of ``resume``, then ``train_worker(pp2)``."""
    return resume_worker(rank, world, *resume), train_worker(rank, world, pp2)


def _four_ranks(rank, world, runs):
    """Four-rank worker: ``train_worker`` for each overrides list of ``runs``, one after the other."""
    return [train_worker(rank, world, overrides) for overrides in runs]


def _one_rank(rank, world, serial, logits_of, fp32_runs, fp16_runs):
    """One-rank worker: ``train_worker`` for each of ``fp32_runs`` and ``serial`` (overrides), the logits of the
    ``logits_of`` checkpoints (``serial``'s among them), then ``train_worker`` for each (overrides, inject) of
    ``fp16_runs`` (last: they allow fp16 on the CPU accelerator for the rest of the process)."""
    fp32 = [train_worker(rank, world, overrides) for overrides in fp32_runs]
    ref = train_worker(rank, world, serial)
    return fp32, ref, _logits_worker(rank, world, logits_of), [train_worker(rank, world, *r) for r in fp16_runs]


@pytest.fixture(scope="module")
def runs(spm_model, tmp_path_factory):
    """Every training run of the tests below, in three launches (one per world size: the launches, not the tiny
    runs, are what costs). {run name: rank 0's result}, and the tests' folders under ``root``."""
    root = tmp_path_factory.mktemp("training")
    over = lambda name, **kw: tiny_overrides(spm_model, root / name, **kw)  # noqa: E731
    # TP=2 with dropout on: the tracker and default RNG streams, the data position and the
    # LR schedule all have to be restored for the numbers to repeat exactly
    resume = over("resume", **{"train.iters": 4, "parallel.tensor": 2, "model.hidden_dropout": 0.1,
                               "model.attention_dropout": 0.1, "train.global_batch_size": 4})
    resumed, pp2 = run_distributed(_two_ranks, 2, (resume, str(root / "resume")),
                                   over("pp2", **{"parallel.tensor": 1}, **{"parallel.pipeline": 2}, **PIPE))[0]
    big, zero, tp2pp2 = run_distributed(_four_ranks, 4, [
        over("tp2dp2", **{"parallel.tensor": 2}, **TP1DP1),
        over("zero1", **{"parallel.tensor": 2}, **{"parallel.zero_stage": 1}, **TP1DP1),
        over("tp2pp2", **{"parallel.tensor": 2}, **{"parallel.pipeline": 2}, **{"model.activation_checkpointing": "true"},
             **PIPE)], timeout=900)[0]
    (tp1,), pp1, logits, (fp16, fp16b) = run_distributed(
        _one_rank, 1, over("pp1", **{"parallel.tensor": 1}, **PIPE), [str(root / d) for d in ("pp1", "pp2", "tp2pp2")],
        [over("tp1", **{"parallel.tensor": 1}, **TP1DP1)],
        [(over("fp16", **FP16), {"steps": 4, "overflow_at": [2]}),
         (over("fp16b", **FP16), {"steps": 10, "overflow_at": list(range(10))})], timeout=900)[0]
    return {"resume": resume, "resumed": resumed, "pp2": pp2, "tp2dp2": big, "zero1": zero, "tp2pp2": tp2pp2,
            "tp1": tp1, "pp1": pp1, "logits": logits, "fp16": fp16, "fp16b": fp16b, "root": root}


@needs_corpus
def test_tp2_dp2_and_zero1_match_tp1_dp1_and_loss_decreases(runs):
    # vocab 1000 pads to 1024 at TP=1 (x128) and at TP=2 (x256): identical initial weights
    # (no warmup: with Megatron's schedule a warmup's first update runs at lr 0)
    root = runs["root"]
    l1, l4, lz = runs["tp1"]["losses"], runs["tp2dp2"]["losses"], runs["zero1"]["losses"]
    assert len(l1) == len(l4) == len(lz) == 6
    torch.testing.assert_close(torch.tensor(l4), torch.tensor(l1), rtol=2e-4, atol=2e-4)
    # ZeRO-1 (optimizer states sharded over the 2 DP ranks) changes no loss
    torch.testing.assert_close(torch.tensor(lz), torch.tensor(l4), rtol=2e-5, atol=2e-5)
    assert json.loads((root / "zero1" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 1
    assert l1[-1] < l1[0] - 0.5, l1  # learning on real text (ln(1000) = 6.9 at the start)
    config = json.loads((root / "tp2dp2" / "ds_config.json").read_text())
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    assert json.loads((root / "tp1" / "ds_config.json").read_text())["gradient_accumulation_steps"] == 4


@needs_corpus
def test_pipeline_parallel_matches_serial(runs):
    """PP=2 and TP=2 x PP=2 (4 ranks, with activation checkpointing) give the TP=1 x PP=1 losses; their
    checkpoints merge into the same TP=1 model."""
    a, b, c = runs["logits"]
    l1, lp, ltp = (torch.tensor(runs[name]["losses"]) for name in ("pp1", "pp2", "tp2pp2"))
    assert len(l1) == 4
    torch.testing.assert_close(lp, l1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ltp, l1, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c, a, rtol=1e-3, atol=1e-3)


@needs_corpus
def test_fp16_overflow_skips_step_halves_scale_and_aborts(runs):
    out = runs["fp16"]
    r = out["records"]
    assert out["aborted"] is None
    assert [x["applied"] for x in r] == [True, True, False, True]
    assert r[2]["changed"] is False and r[1]["changed"] and r[3]["changed"]  # weights untouched on overflow
    assert r[2]["scale"] == r[1]["scale"] / 2 == 2.0 ** 7
    assert [x["skipped"] for x in r] == [0, 0, 1, 1]
    assert r[3]["lr"] == r[2]["lr"]  # the scheduler does not advance on a skipped step
    out = runs["fp16b"]
    assert len(out["records"]) == 2 and out["aborted"] and "3 consecutive steps skipped" in out["aborted"]


@needs_corpus
def test_stop_and_resume_is_bitwise_identical(runs):
    full, part = runs["resumed"]
    steps = lambda rows: [(r["iteration"], r["loss"], r["lr"]) for r in rows if "event" not in r]  # noqa: E731
    assert steps(full) == steps(part) and len(steps(full)) == 4
    # the engine runs Megatron's schedule: update 1 at lr 0 (warmup 1), then the cosine decay
    from tests.helpers.megatron_reference import megatron_lrs
    from training.config import load_config

    ocfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", runs["resume"]).optimizer
    assert [lr for _, _, lr in steps(full)] == pytest.approx(megatron_lrs(ocfg, 4), rel=1e-12, abs=0)
    assert [r["iteration"] for r in part if r.get("event") == "valid"] == [2, 4]


def _cli(*args, env_extra=None, timeout=120):
    env = dict(os.environ, DS_ACCELERATOR="cpu", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "training.pretrain", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override,env,message", [
    ("model.hiden_size=64", {}, "unknown config key 'model.hiden_size' (did you mean 'hidden_size'?)"),
    ("train.iters=ten", {}, "train.iters: expected an integer, got 'ten'"),
    ("model.num_attention_heads=3", {}, "model.hidden_size=64 is not divisible by model.num_attention_heads=3"),
    ("parallel.tensor=8", {}, "parallel.tensor=8 does not divide model.num_attention_heads=4"),
    ("parallel.tensor=2", {"WORLD_SIZE": "3"}, "world size 3 is not divisible by TP x PP = 2 x 1"),
    ("precision.dtype=fp8", {}, "precision.dtype: 'fp8' is not one of"),
    ("deepspeed.train_batch_size=16", {}, "deepspeed.train_batch_size is derived from train.global_batch_size"),
    # a negative interval saved/validated at every step (`it % -1 == 0`; issue 30 item 8)
    ("train.save_interval=-1", {}, "train.save_interval must be >= 0 (0 = save only at the end), got -1"),
    ("train.eval_interval=-5", {}, "train.eval_interval must be >= 0 (0 = validate only at the end), got -5"),
    ("train.keep_last=0", {}, "train.keep_last must be >= 1 (the newest checkpoint is always kept), got 0"),
])
def test_bad_config_fails_with_one_clear_line(override, env, message):
    res = _cli("--config", "configs/gpt2_tiny.yaml", override, env_extra=env)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], res.stderr


@needs_corpus
@pytest.mark.slow
def test_deepspeed_launcher_tp2_run(spm_model, tmp_path):
    run_dir = tmp_path / "launch"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_port()),
           "--module", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
           *tiny_overrides(spm_model, run_dir, **{"train.iters": 3, "parallel.tensor": 2})]
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert list(steps[0])[:9] == ["iteration", "lr", "loss", "loss_scale", "grad_norm", "skipped", "tokens_per_s",
                                  "tflops_per_device", "mfu"]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000003"
    assert len(list((run_dir / "checkpoints" / "iter_0000003").glob("mp_rank_*_model_states.pt"))) == 2
    assert "iter      3/3" in res.stdout


def _port():
    from tests.helpers.distributed import free_port

    return free_port()
