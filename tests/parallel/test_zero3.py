"""ZeRO-3 and ZeRO-Offload beside data parallelism (issue 42): DeepSpeed's own stage-3 optimizer (parameters,
gradients and optimizer states partitioned over the DP ranks) trains the TP 1 x DP 2 model as ZeRO-0 does, a stopped
ZeRO-3 run resumes exactly, and its checkpoint holds the whole weights that evaluation and the Hugging Face export
read.

One 2-rank launch runs, in turn: ZeRO-0 and ZeRO-3 in fp32 for ten steps (losses within 1e-5 relative), the ZeRO-3
run stopped at step 4 and resumed to step 10 (every loss and the final weights bitwise those of the run that never
stopped), ZeRO-3 with the optimizer offloaded to the CPU (losses within 1e-5 of ZeRO-0), and fp16 at ZeRO-0 and
ZeRO-3 with overflows planted at steps 3 and 4 (the same steps skipped, the same loss scales with
``precision.hysteresis: 1``).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS = 10
OVERFLOW_AT = (3, 4)


def _train(spec, run_dir, zero, dtype, exit_at=None, plant=False, offload="none", universal=None):
    from training.checkpoint import gathered_state_dict
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer, count_parameters

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "parallel.zero_stage": zero, "precision.dtype": dtype,
                                          "parallel.offload_optimizer": offload,
                                          "precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 8,
                                          "precision.hysteresis": 1, "precision.max_consecutive_skipped": 0,
                                          "train.iters": STEPS, "train.exit_at": exit_at or "null",
                                          "train.log_interval": 1, "train.eval_interval": 0,
                                          "train.save_interval": exit_at or 0,
                                          "train.load_universal": universal or "null"})
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    if plant:
        weight = t.model.layers[0].mlp.fc.weight
        weight.register_hook(lambda g: g * float("inf") if t.state.iteration + 1 in OVERFLOW_AT else g)
    t.train()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["iteration"], r["loss"], r["loss_scale"], r["step_applied"]) for r in rows if "event" not in r]
    weights = gathered_state_dict(t.model, to_rank0_only=False)  # ZeRO-3: each parameter whole, on every rank
    local = sum(p.numel() for p in t.model.parameters())  # this rank's elements (ZeRO-3: none outside a gather)
    return logged, type(t.engine.optimizer).__name__, weights, count_parameters(t.model, t.ps), local


def _worker(rank, world, spec, tmp):
    out = {}
    for name, zero, dtype, exit_at, plant, offload in (
            ("zero0", 0, "fp32", None, False, "none"), ("zero3", 3, "fp32", None, False, "none"),
            ("stopped", 3, "fp32", 4, False, "none"), ("resumed", 3, "fp32", None, False, "none"),
            ("offload", 3, "fp32", None, False, "cpu"),
            ("zero0_fp16", 0, "fp16", None, True, "none"), ("zero3_fp16", 3, "fp16", None, True, "none")):
        run_dir = f"{tmp}/{'stopped' if name == 'resumed' else name}"
        out[name] = _train(spec, run_dir, zero, dtype, exit_at, plant, offload)
    return out


@needs_corpus
def test_zero3_dp2_trains_as_zero0_resumes_exactly_and_saves_whole_weights(spm_model, tmp_path):
    from training.checkpoint_reader import load_merged_state_dict, load_model_for_eval

    ranks = run_distributed(_worker, 2, spm_model, str(tmp_path), timeout=900)
    r = ranks[0]
    assert r["zero0"][1] == "AdamW" and r["zero3"][1] == r["offload"][1] == "DeepSpeedZeroOptimizer_Stage3"
    a, b = r["zero0"][0], r["zero3"][0]
    assert [x[0] for x in a] == [x[0] for x in b] == list(range(1, STEPS + 1))
    losses = lambda rows: torch.tensor([x[1] for x in rows])  # noqa: E731
    torch.testing.assert_close(losses(b), losses(a), rtol=1e-5, atol=0)
    torch.testing.assert_close(losses(r["offload"][0]), losses(a), rtol=1e-5, atol=0)
    assert a[-1][1] < a[0][1]  # it learns
    # the parameter count reads each partitioned parameter's whole size; locally ZeRO-3 holds no element of it
    assert r["zero3"][3] == r["zero0"][3] and r["zero3"][4] == 0 < r["zero0"][4]
    # the final weights of ZeRO-3 and ZeRO-0 agree (within 1e-5: the key bias's gradient is zero up to rounding,
    # softmax ignores it, and Adam normalises that rounding to steps of ~1e-6; every other tensor within ~6e-8),
    # the same on both ranks once gathered
    w0, w3 = r["zero0"][2], r["zero3"][2]
    assert set(w0) == set(w3) and all(w3[k].shape == w0[k].shape for k in w0)
    assert all(torch.allclose(w3[k], w0[k], rtol=0, atol=1e-5) for k in w0)
    assert all(torch.equal(ranks[1]["zero3"][2][k], w3[k]) for k in w3)
    # stopped at 4 and resumed: every step bitwise the uninterrupted run's, the same weights
    assert r["resumed"][0] == b
    assert all(torch.equal(r["resumed"][2][k], w3[k]) for k in w3)
    # the checkpoint's model file holds the gathered weights: what evaluation and export read
    saved, _, meta = load_merged_state_dict(tmp_path / "zero3")
    assert meta["zero3_gathered"] and all(torch.equal(saved[k], w3[k].float()) for k in w3)
    model, _, _ = load_model_for_eval(tmp_path / "zero3")
    assert all(torch.equal(p, w3[n]) for n, p in model.named_parameters())
    # DeepSpeed's own converter still reads the folder (the gathered file is not one of its *_model_states.pt)
    tag = next((tmp_path / "zero3" / "checkpoints").glob("iter_*"))
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                    "--output_folder", str(tmp_path / "universal")], check=True, capture_output=True)
    assert (tmp_path / "universal" / "zero").is_dir()
    # fp16: the same steps skipped, the same loss scales, the applied steps' losses close
    f0, f3 = r["zero0_fp16"][0], r["zero3_fp16"][0]
    assert [x[3] for x in f0] == [x[3] for x in f3] == [k not in OVERFLOW_AT for k in range(1, STEPS + 1)]
    assert [x[2] for x in f0] == [x[2] for x in f3]
    applied = [i for i, x in enumerate(f0) if x[3]]
    torch.testing.assert_close(torch.tensor([f3[i][1] for i in applied]), torch.tensor([f0[i][1] for i in applied]),
                               rtol=2e-3, atol=0)


@needs_corpus
def test_zero3_checkpoint_exports_to_hugging_face(spm_model, tmp_path):
    """A ZeRO-3 run's checkpoint exports (the whole weights the save gathered), here from a 2-step run."""
    pytest.importorskip("transformers")
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools.export_hf import export

    run_distributed(_export_worker, 2, spm_model, str(tmp_path / "run"), timeout=600)
    out = export(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    saved, _, meta = load_merged_state_dict(tmp_path / "run")
    wte = hf.get_input_embeddings().weight.detach()
    assert meta["zero3_gathered"]
    assert torch.equal(wte, saved["embedding.word_embeddings.weight"][: wte.shape[0]])


def _export_worker(rank, world, spec, run_dir):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "parallel.zero_stage": 3, "train.iters": 2,
                                          "train.eval_interval": 0})
    Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov))).train()


def _stop_and_continue(rank, world, spec, run_dir, exit_at, universal=None):
    return _train(spec, run_dir, 3, "fp32", exit_at=exit_at, universal=universal)[0]


def _refused_then_continue(rank, world, spec, source, run_dir):
    """The DP 2 run resumed as it is on one rank (refused: its ZeRO-3 partitions are DP 2's), then ``run_dir``."""
    from megatron_ds_suite.core.errors import ConfigError

    try:
        _train(spec, source, 3, "fp32")
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    return refusal, _stop_and_continue(rank, world, spec, run_dir, None)


@needs_corpus
def test_zero3_reshard_dp2_to_dp1_continues_the_loss_curve(spm_model, tmp_path):
    """``training.tools.reshard`` reads a ZeRO-3 checkpoint's fp32 partitions and Adam moments through DeepSpeed
    (gathered per parameter) and writes them for one data-parallel rank: the ZeRO-3 run stopped at step 4 at DP 2
    continues at DP 1 with the losses of the DP 2 run that continued (within 1e-5 relative; the reduction order
    differs), and the LR schedule goes on where it was; resumed as it is on one rank, it is refused in one line that
    names the conversion. The same change through DeepSpeed's universal checkpoint
    (``to_universal``, then a ZeRO-3 run at DP 1 with ``train.load_universal``) continues the curve as closely: its
    load gave every parameter group the first group's hyperparameters (biases and norms decayed: 2e-4 apart by step
    8), which the engine puts back (training.optim.engine)."""
    from training.tools.reshard import reshard
    from training.tools.to_universal import convert

    src = tmp_path / "src"
    run_distributed(_stop_and_continue, 2, spm_model, str(src), 4, timeout=600)
    reshard(src, 1, 1, tmp_path / "dp1", dp=1)
    convert(src, tmp_path / "u4", tag="iter_0000004")
    dp2 = run_distributed(_stop_and_continue, 2, spm_model, str(src), None, timeout=600)[0]
    refusal, dp1 = run_distributed(_refused_then_continue, 1, spm_model, str(src), str(tmp_path / "dp1"),
                                   timeout=600)[0]
    assert refusal is not None and "\n" not in refusal
    assert refusal.endswith(f"was saved with 2 data-parallel ranks and this run has 1: its optimizer state is "
                            f"partitioned over them (ZeRO-3); resume with 2, or convert it with python -m "
                            f"training.tools.reshard --checkpoint {src} --tp 1 --pp 1 --dp 1 --out NEW_RUN_DIR")
    assert [x[0] for x in dp1] == [x[0] for x in dp2] == list(range(1, STEPS + 1))  # the metrics file carried over
    torch.testing.assert_close(torch.tensor([x[1] for x in dp1[4:]]), torch.tensor([x[1] for x in dp2[4:]]),
                               rtol=1e-5, atol=0)
    via = run_distributed(_stop_and_continue, 1, spm_model, str(tmp_path / "universal"), None, str(tmp_path / "u4"),
                          timeout=600)[0]
    assert [x[0] for x in via] == list(range(5, STEPS + 1))  # a new run, from the universal checkpoint's step 4
    torch.testing.assert_close(torch.tensor([x[1] for x in via]), torch.tensor([x[1] for x in dp2[4:]]),
                               rtol=1e-5, atol=0)
