"""The GPU smoke suite's benchmarks (``--bench-1p2b``, ``--bench-llama-1b``): the trainer's step time, TFLOP/s, MFU
and memory per variant of a config, HF ``GPT2LMHeadModel`` beside the 1.2B one, and the lines that describe them.
"""
from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from scripts.gpu_check.context import ROOT

# (micro-batch, activation recompute): full recompute at micro-batch 4 (what the config held before its
# recompute became `auto`, and the first GPU run's 17.5 % MFU), then none at 8 and 16 (auto's choice on 80 GB)
VARIANTS_1P2B = ((4, True), (8, False), (16, False))


def _bench_data_overrides(data: Path, run_dir: str, steps: int, micro: int) -> dict[str, str]:
    """Tiny Shakespeare in GPT-2 BPE, ``steps`` steps of one micro-batch each, no evaluation."""
    g = data / "tokenizers" / "gpt2"
    return {"data.corpus": "null", "data.text_files": f"[{data / 'corpus' / 'tinyshakespeare.txt'}]",
            "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(g / "gpt2-vocab.json"),
                                          "merges_file": str(g / "gpt2-merges.txt")}),
            "run.dir": run_dir, "train.iters": str(steps), "train.micro_batch_size": str(micro),
            "train.global_batch_size": str(micro), "optimizer.warmup_iters": "1", "train.eval_interval": "0"}


def bench_1p2b(out: Path, data: Path, steps: int = 8) -> None:
    """configs/gpt2_1.2b.yaml on one GPU, trained by the trainer itself for ``steps`` steps in each of
    :data:`VARIANTS_1P2B` (one after another in one process): the mean step time, TFLOP/s and MFU of the last
    half, and the peak memory. Each step reads its metrics (log interval 1)."""
    variants = []
    for micro, recompute in VARIANTS_1P2B:
        def overrides(tmp: str, micro=micro, recompute=recompute) -> dict[str, str]:
            return {**_bench_data_overrides(data, tmp, steps, micro), "precision.initial_scale_power": "16",
                    "model.activation_checkpointing": str(recompute).lower()}
        variants.append(({"micro_batch": micro, "recompute": recompute}, overrides))
    bench_trainer(ROOT / "configs" / "gpt2_1.2b.yaml", variants, out, steps)


HF_MICRO_1P2B = 8  # the micro-batch of HF's row in the 1.2B check (the paper config's, and the A/B's)


def hf_1p2b_command(out: Path) -> list[str]:
    """``benchmarks.bench_train_step`` for HF ``GPT2LMHeadModel`` of configs/gpt2_1.2b.yaml's shape at micro-batch
    :data:`HF_MICRO_1P2B` (fp16, the config's dropout, its padded vocabulary as the unpadded one so both count
    the same FLOPs) under the same engine as ours (the trainer's DeepSpeed config, its AdamW choice, the O(1)
    step); medians to ``out`` (JSON). A separate process: scripts do not import benchmarks."""
    from training.config import load_config
    from training.models.config import padded_vocab_size

    m = load_config(ROOT / "configs" / "gpt2_1.2b.yaml").model
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    return ["-m", "benchmarks.bench_train_step", "--device", "cuda", "--dtype", "fp16", "--only", "hf",
            "--layers", str(m.num_layers), "--hidden", str(m.hidden_size), "--heads", str(m.num_attention_heads),
            "--seq", str(m.seq_length), "--vocab", str(padded), "--dropout", str(m.hidden_dropout),
            "--batch", str(HF_MICRO_1P2B), "--reps", "3", "--steps", "4", "--warmup", "2", "--json", str(out)]


# (micro-batch, model.recompute) of the Llama-style 1B: the config's own (micro-batch 2, `auto`: the planner picks
# none / selective / full for the GPU's memory), then micro-batch 4 with `auto`
VARIANTS_LLAMA_1B = ((2, "auto"), (4, "auto"))
LLAMA_1B_STEPS = 8


def llama_1b_overrides(data: Path, run_dir: str, steps: int = LLAMA_1B_STEPS) -> list[dict[str, str]]:
    """configs/llama_1b.yaml's overrides for each of :data:`VARIANTS_LLAMA_1B`: Tiny Shakespeare in GPT-2 BPE (ids
    below the config's 128,256-entry vocabulary, which is kept: the FLOPs are the 1B model's), all of it for
    training (at seq 4096 the default split's test share holds no sequence)."""
    return [{**_bench_data_overrides(data, run_dir, steps, micro), "model.recompute": recompute,
             "data.split": "100,0,0"} for micro, recompute in VARIANTS_LLAMA_1B]


def load_llama_1b(overrides: dict[str, str]):
    from training.config import load_config

    return load_config(ROOT / "configs" / "llama_1b.yaml", [f"{k}={v}" for k, v in overrides.items()])


def bench_llama_1b(out: Path, data: Path, steps: int = LLAMA_1B_STEPS) -> None:
    """configs/llama_1b.yaml on one GPU (bf16, seq 4096), as :func:`bench_1p2b`: the trainer's own step time,
    TFLOP/s and MFU (``training.plan.accounting.flops_per_iteration``: Llama's gated MLP and grouped key/values) over the
    last half of ``steps`` steps of each of :data:`VARIANTS_LLAMA_1B`, and the recompute mode ``auto`` chose."""
    variants = []
    for i, (micro, recompute) in enumerate(VARIANTS_LLAMA_1B):
        variants.append(({"micro_batch": micro, "recompute": recompute},
                         lambda tmp, i=i: llama_1b_overrides(data, tmp, steps)[i]))
    bench_trainer(ROOT / "configs" / "llama_1b.yaml", variants, out, steps)


def bench_trainer(config: Path, variants: list[tuple[dict, Callable[[str], dict[str, str]]]], out: Path,
                  steps: int) -> None:
    """Train ``config`` for ``steps`` steps per variant (its description, and its overrides for a run folder),
    one after another in this process; write the device and each variant's figures to ``out`` (JSON)."""
    import torch

    from training.config import load_config
    from training.resolve import resolve_run
    from training.runtime.distributed import init_distributed
    from training.trainer import Trainer

    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    init_distributed()
    results = []
    for what, overrides in variants:
        with tempfile.TemporaryDirectory() as tmp:
            ov = overrides(tmp)
            torch.cuda.reset_peak_memory_stats()
            try:
                trainer = Trainer(resolve_run(load_config(config, [f"{k}={v}" for k, v in ov.items()])))
                rows = [trainer.train_step() for _ in range(steps)]
            except torch.cuda.OutOfMemoryError:
                rows, trainer = None, None
            peak = torch.cuda.max_memory_allocated() / 2**30
            if trainer is not None:
                o1, mfu_peak = trainer.o1_step, trainer.peak
                # model.recompute as the trainer resolved it (auto -> none / selective / full), for a string variant
                chosen = trainer.cfg.model.recompute if isinstance(what["recompute"], str) else None
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
        if rows is None:
            results.append({**what, "oom": True, "peak_memory_gib": peak})
            continue
        tail = rows[steps // 2:]
        step = sum(r["step_time_s"] for r in tail) / len(tail)
        tflops = sum(r["tflops_per_device"] for r in tail) / len(tail)
        results.append({**what, **({"recompute_chosen": chosen} if chosen else {}), "step_time_s": step, "tflops_per_device": tflops,
                        "tokens_per_s": sum(r["tokens_per_s"] for r in tail) / len(tail),
                        "mfu": tflops / mfu_peak if mfu_peak else None, "peak_memory_gib": peak, "o1_step": o1,
                        "skipped_last": sum(0 if r["step_applied"] else 1 for r in tail)})
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "variants": results}))


def describe_1p2b(r: dict) -> str:
    """One variant of :func:`bench_1p2b` or :func:`bench_llama_1b` in words."""
    rec = r["recompute"]
    rec = ("full" if rec else "none") if isinstance(rec, bool) else rec
    if r.get("recompute_chosen") not in (None, rec):
        rec += f" -> {r['recompute_chosen']}"
    what = f"micro-batch {r['micro_batch']}, recompute {rec}"
    if r.get("oom"):
        return f"{what}: out of memory ({r['peak_memory_gib']:.1f} GiB)"
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else ""
    return (f"{what}: step {r['step_time_s']:.3f} s, {r['tflops_per_device']:.1f} TFLOP/s{mfu}, peak "
            f"{r['peak_memory_gib']:.1f} GiB")


def describe_hf(r: dict) -> str:
    """HF's row of :func:`bench_1p2b` in words, with ours/HF at its micro-batch (empty if it has none)."""
    hf = r.get("hf")
    if not hf:
        return ""
    if "error" in hf:
        return f"; HF GPT2LMHeadModel micro-batch {hf['micro_batch']}: {hf['error']}"
    mfu = f", MFU {100 * hf['mfu']:.1f}%" if hf.get("mfu") else ""
    text = (f"; HF GPT2LMHeadModel micro-batch {hf['micro_batch']} (same engine): step {hf['step_time_s']:.3f} s, "
            f"{hf['tflops']:.1f} TFLOP/s{mfu}")
    ours = [v for v in r["variants"] if v["micro_batch"] == hf["micro_batch"] and not v.get("oom")]
    if ours:
        text += f"; ours/HF {hf['step_time_s'] / ours[0]['step_time_s']:.3f}x (HF step time / ours)"
    return text
