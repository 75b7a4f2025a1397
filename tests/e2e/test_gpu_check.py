"""scripts/gpu_check/'s CPU-safe parts: argument parsing, the plan (configs validated), the table."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_check.bench import describe_1p2b, describe_hf, llama_1b_overrides, load_llama_1b
from scripts.gpu_check.checks import NAMES
from scripts.gpu_check.cli import main, parse_args, render
from scripts.gpu_check.context import Context, Row
from scripts.gpu_check.first_update import FIRST_UPDATE_TOL, first_update
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _rows(out: str) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return {r[0][2:]: r[1:] for r in rows[1:]}


def test_dry_run_plans_every_check_and_renders_the_table(capsys, tmp_path):
    assert main(["--cpu-dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPU check: dry run (plan for 2 GPUs, nothing executed)")
    rows = _rows(out)
    assert list(rows) == NAMES
    assert all(r[0] == "DRY-RUN" for r in rows.values())
    assert "--nproc_per_node=2 -m training.pretrain" in rows["gpt2_tp2_bf16"][1]
    assert "parallel.pipeline=2" in rows["gpt2_pp2"][1] and "precision.dtype=fp16" in rows["gpt2_pp2"][1]
    assert rows["resume_equal"][1].count("training.pretrain") == 3 and "train.exit_at=15" in rows["resume_equal"][1]
    assert "-m evaluation wikitext103 " in rows["wikitext103"][1] and "--limit 500" in rows["wikitext103"][1]
    assert "-m scripts.gpu_check --bench-llama-1b " in rows["llama_1b"][1]
    hf = ("-m benchmarks.bench_train_step --device cuda --dtype fp16 --only hf --layers 40 --hidden 1536 --heads 16 "
          "--seq 1024 --vocab 51200 --dropout 0.1 --batch 8")  # the 1.2B config's shape and padded vocabulary
    assert "-m scripts.gpu_check --bench-1p2b " in rows["gpt2_1.2b"][1] and hf in rows["gpt2_1.2b"][1]
    assert rows["fused_adam_step1"][1].endswith("-m scripts.gpu_check --first-update "
                                                 f"{tmp_path}/fused_adam_step1.json".replace(str(ROOT) + "/", ""))
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_on_one_gpu_skips_the_two_gpu_checks(capsys):
    assert main(["--cpu-dry-run", "--gpus", "1", "--only", "gpt2_tp1_fp16", "gpt2_tp2_fp16", "gpt2_pp2",
                           "resume_equal"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [rows[k][0] for k in rows] == ["DRY-RUN", "SKIP", "SKIP", "DRY-RUN"]
    assert rows["gpt2_tp2_fp16"][1] == "needs 2 GPUs, 1 available"
    assert "--nproc_per_node=1" in rows["resume_equal"][1]  # resume check falls back to TP=1


@pytest.mark.parametrize("argv,message", [
    (["--steps", "2"], "--steps must be >= 4"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--only", "gpt3"], "invalid choice: 'gpt3'"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--cpu-dry-run", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_plan_fails_on_cpu(tmp_path):
    from training.config import ConfigError

    ctx = Context(parse_args(["--cpu-dry-run"]), 2, True, tmp_path, tmp_path)
    with pytest.raises(ConfigError, match="parallel.tensor=3"):
        ctx.run("x", ["-m", "training.pretrain", "--config", str(ROOT / "configs" / "gpt2_tiny.yaml"),
                      "parallel.tensor=3"], nproc=3)


def test_a_planned_evaluation_command_must_parse(tmp_path):
    # the GPU run of 2026-11-26 found the plan calling `evaluation wikitext` (the task is `wikitext103`):
    # the dry run now parses every evaluation command with evaluation's own parser
    ctx = Context(parse_args(["--cpu-dry-run"]), 1, True, tmp_path, tmp_path)
    with pytest.raises(ValueError, match="does not parse: -m evaluation wikitext --checkpoint"):
        ctx.run("x", ["-m", "evaluation", "wikitext", "--checkpoint", "c", "--data", "d"], nproc=1)
    ctx.run("x", ["-m", "evaluation", "wikitext103", "--checkpoint", "c", "--data", "d"], nproc=1)


def test_the_llama_1b_row_plans_the_1b_config_with_llama_flops(tmp_path):
    """The Llama-style 1B row trains configs/llama_1b.yaml itself (GQA 32/8, SwiGLU 8192, vocabulary 128,256 kept
    under the GPT-2 BPE data, seq 4096, bf16, recompute auto); its MFU is the trainer's, by the Llama FLOP count."""
    from training.models.config import padded_vocab_size
    from training.plan.accounting import flops_per_iteration, model_flops_per_iteration

    plans = llama_1b_overrides(tmp_path, str(tmp_path / "run"))
    assert [(p["train.micro_batch_size"], p["model.recompute"]) for p in plans] == [("2", "auto"), ("4", "auto")]
    cfg = load_llama_1b(plans[0])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.query_groups, m.ffn_size, m.seq_length, m.vocab_size, cfg.precision.dtype) \
        == (16, 2048, 8, 8192, 4096, 128256, "bf16")
    v = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    flops = flops_per_iteration(cfg, v)
    assert flops == model_flops_per_iteration(2, 4096, 16, 2048, v, ffn=8192, kv_hidden=512, gated=True)
    assert flops > 1.1 * model_flops_per_iteration(2, 4096, 16, 2048, v, ffn=8192)  # gated MLP, not GPT-2's count
    assert describe_1p2b({"micro_batch": 2, "recompute": "auto", "recompute_chosen": "selective",
                                    "step_time_s": 0.2, "tflops_per_device": 370.0, "mfu": 0.374,
                                    "peak_memory_gib": 40.0}) == \
        "micro-batch 2, recompute auto -> selective: step 0.200 s, 370.0 TFLOP/s, MFU 37.4%, peak 40.0 GiB"


def test_render_escapes_pipes():
    table = render([Row("a", "PASS", "x | y", 1.4)], "head")
    assert table.splitlines() == ["head", "", "| check | status | detail | s |", "|---|---|---|---|",
                                  "| a | PASS | x / y | 1 |"]


def test_the_shell_wrapper_dry_run():
    env = {**os.environ, "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-dry-run", "--only", "bert_20"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _rows(proc.stdout)["bert_20"][0] == "DRY-RUN"


def _first_update_worker(rank, world):
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    return first_update("cpu", "torch")


def test_first_update_check_measures_megatrons_step_one():
    """The fused_adam_step1 check's measurement, run on CPU with torch's AdamW in place of FusedAdam (a CUDA
    kernel): through the trainer's fp16 wrapper and O(1) step, with the undo the first update is Megatron's
    step 1 (Adam step 1) to ~1 ulp of the fp32 masters; without it Adam is at step 2 and the update is off by
    3.6e-3 at lr 1e-2 (bias correction 0.744 and one extra weight decay), far above the check's tolerance."""
    r = run_distributed(_first_update_worker, 1)[0]
    assert r["params"] == 64 * 128 + 128 + 2 * 128 + 128 * 32 + 32
    assert r["undo"]["o1_step"] and r["no_undo"]["o1_step"] and not r["undo"]["overflow"]
    assert (r["undo"]["adam_step"], r["no_undo"]["adam_step"]) == (1, 2)
    assert r["undo"]["max_abs_diff"] <= FIRST_UPDATE_TOL / 100
    assert r["no_undo"]["max_abs_diff"] > 100 * FIRST_UPDATE_TOL


def test_the_1p2b_row_reports_ours_against_hf():
    r = {"variants": [{"micro_batch": 4, "step_time_s": 0.133}, {"micro_batch": 8, "step_time_s": 0.172}],
         "hf": {"micro_batch": 8, "step_time_s": 0.170, "tflops": 386.7, "mfu": 0.391}}
    assert describe_hf(r) == ("; HF GPT2LMHeadModel micro-batch 8 (same engine): step 0.170 s, 386.7 TFLOP/s, "
                                        "MFU 39.1%; ours/HF 0.988x (HF step time / ours)")
    assert describe_hf({"variants": [], "hf": {"micro_batch": 8, "error": "OutOfMemoryError: x"}}) == \
        "; HF GPT2LMHeadModel micro-batch 8: OutOfMemoryError: x"
