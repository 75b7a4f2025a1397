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


def _train_each(rank, world, runs):
    """Rank worker: ``train_worker`` for each overrides list of ``runs``, one after the other."""
    return [train_worker(rank, world, overrides) for overrides in runs]


@needs_corpus
def test_tp2_dp2_and_zero1_match_tp1_dp1_and_loss_decreases(spm_model, tmp_path):
    # vocab 1000 pads to 1024 at TP=1 (x128) and at TP=2 (x256): identical initial weights
    # (no warmup: with Megatron's schedule a warmup's first update runs at lr 0)
    common = {"train.iters": 6, "optimizer.lr": 3e-3, "optimizer.decay_style": "constant", "optimizer.warmup_iters": 0}
    ref = run_distributed(train_worker, 1, tiny_overrides(spm_model, tmp_path / "tp1", **{"parallel.tensor": 1}, **common))
    big, zero = run_distributed(_train_each, 4, [  # both 4-rank runs in one launch
        tiny_overrides(spm_model, tmp_path / "tp2dp2", **{"parallel.tensor": 2}, **common),
        tiny_overrides(spm_model, tmp_path / "zero1", **{"parallel.tensor": 2}, **{"parallel.zero_stage": 1}, **common)],
        timeout=600)[0]
    l1, l4, lz = ref[0]["losses"], big["losses"], zero["losses"]
    assert len(l1) == len(l4) == len(lz) == 6
    torch.testing.assert_close(torch.tensor(l4), torch.tensor(l1), rtol=2e-4, atol=2e-4)
    # ZeRO-1 (optimizer states sharded over the 2 DP ranks) changes no loss
    torch.testing.assert_close(torch.tensor(lz), torch.tensor(l4), rtol=2e-5, atol=2e-5)
    assert json.loads((tmp_path / "zero1" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 1
    assert l1[-1] < l1[0] - 0.5, l1  # learning on real text (ln(1000) = 6.9 at the start)
    config = json.loads((tmp_path / "tp2dp2" / "ds_config.json").read_text())
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    assert json.loads((tmp_path / "tp1" / "ds_config.json").read_text())["gradient_accumulation_steps"] == 4


def _logits_worker(rank, world, run_dirs):
    from training.checkpoint_reader import load_model_for_eval

    tokens = torch.arange(32).view(1, 32) * 7 % 1000
    return [load_model_for_eval(d)[0](tokens).detach() for d in run_dirs]


def _serial_and_logits(rank, world, overrides, run_dirs):
    """One-rank worker: train the serial run (``overrides``), then the logits of ``run_dirs`` (that run among them)."""
    return train_worker(rank, world, overrides), _logits_worker(rank, world, run_dirs)


@needs_corpus
def test_pipeline_parallel_matches_serial(spm_model, tmp_path):
    """PP=2 and TP=2 x PP=2 (4 ranks, with activation checkpointing) give the TP=1 x PP=1 losses; their
    checkpoints merge into the same TP=1 model."""
    common = {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.decay_style": "constant"}
    pp2 = run_distributed(train_worker, 2, tiny_overrides(spm_model, tmp_path / "pp2", **{"parallel.tensor": 1},
                                                       **{"parallel.pipeline": 2}, **common))
    tp2pp2 = run_distributed(train_worker, 4, tiny_overrides(spm_model, tmp_path / "tp2pp2", **{"parallel.tensor": 2},
                                                          **{"parallel.pipeline": 2},
                                                          **{"model.activation_checkpointing": "true"}, **common))
    # the serial reference and the three checkpoints' logits in one launch
    ref, (a, b, c) = run_distributed(_serial_and_logits, 1, tiny_overrides(spm_model, tmp_path / "pp1", **{"parallel.tensor": 1}, **common),
                                     [str(tmp_path / d) for d in ("pp1", "pp2", "tp2pp2")], timeout=600)[0]
    l1, lp, ltp = torch.tensor(ref["losses"]), torch.tensor(pp2[0]["losses"]), torch.tensor(tp2pp2[0]["losses"])
    assert len(l1) == 4
    torch.testing.assert_close(lp, l1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ltp, l1, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c, a, rtol=1e-3, atol=1e-3)


@needs_corpus
def test_fp16_overflow_skips_step_halves_scale_and_aborts(spm_model, tmp_path):
    fp16 = {"precision.dtype": "fp16", "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 8,
            "precision.max_consecutive_skipped": 3, "train.iters": 10, "parallel.tensor": 1,
            "train.global_batch_size": 2}
    out = run_distributed(train_worker, 1, tiny_overrides(spm_model, tmp_path / "fp16", **fp16),
                          {"steps": 4, "overflow_at": [2]})[0]
    r = out["records"]
    assert out["aborted"] is None
    assert [x["applied"] for x in r] == [True, True, False, True]
    assert r[2]["changed"] is False and r[1]["changed"] and r[3]["changed"]  # weights untouched on overflow
    assert r[2]["scale"] == r[1]["scale"] / 2 == 2.0 ** 7
    assert [x["skipped"] for x in r] == [0, 0, 1, 1]
    assert r[3]["lr"] == r[2]["lr"]  # the scheduler does not advance on a skipped step
    out = run_distributed(train_worker, 1, tiny_overrides(spm_model, tmp_path / "fp16b", **fp16),
                          {"steps": 10, "overflow_at": list(range(10))})[0]
    assert len(out["records"]) == 2 and out["aborted"] and "3 consecutive steps skipped" in out["aborted"]


@needs_corpus
def test_stop_and_resume_is_bitwise_identical(spm_model, tmp_path):
    # TP=2 with dropout on: the tracker and default RNG streams, the data position and the
    # LR schedule all have to be restored for the numbers to repeat exactly
    over = tiny_overrides(spm_model, tmp_path, **{"train.iters": 4, "parallel.tensor": 2, "model.hidden_dropout": 0.1,
                                              "model.attention_dropout": 0.1, "train.global_batch_size": 4})
    full, part = run_distributed(resume_worker, 2, over, str(tmp_path))[0]
    steps = lambda rows: [(r["iteration"], r["loss"], r["lr"]) for r in rows if "event" not in r]  # noqa: E731
    assert steps(full) == steps(part) and len(steps(full)) == 4
    # the engine runs Megatron's schedule: update 1 at lr 0 (warmup 1), then the cosine decay
    from tests.helpers.megatron_reference import megatron_lrs
    from training.config import load_config

    ocfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", over).optimizer
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
