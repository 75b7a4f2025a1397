"""GPU smoke suite: the product's main paths on NVIDIA GPUs, one table at the end.

    bash scripts/gpu_check.sh [--gpus N] [--only NAME ...] [--steps 30] [--out runs/gpu_check]
    python -m scripts.gpu_check --cpu-dry-run      # CPU: parse arguments, list the plan, render the table

Checks (each a real run through the project's own entry points, ``torchrun`` for several GPUs):

    gpt2_tp1_fp16 / gpt2_tp1_bf16 / gpt2_tp2_fp16 / gpt2_tp2_bf16   tiny GPT-2, ``--steps`` steps: the loss
        falls and fp16 skips at most a few steps (no skipped-step storm)
    gpt2_pp2         PP=2 (DeepSpeed PipelineEngine), fp16
    bert_20          tiny BERT (MLM + SOP), 20 steps, on a sentence-level corpus built here
    race_finetune    RACE fine-tuning of that BERT (1 epoch), dev/test accuracy
    wikitext103      WikiText-103 test perplexity of the TP=1 fp16 GPT-2 (``--limit`` lines)
    lambada          LAMBADA accuracy of the same model (``--limit`` examples)
    resume_equal     stop at half-way and resume: the losses after it equal the uninterrupted run's
    hf_export        Hugging Face export: ``GPT2LMHeadModel`` logits equal ours (fp32)
    cuda_graph       ``model.cuda_graph=true`` (TP=2 with 2 GPUs): fp32 losses equal eager's without dropout;
        fp16 with dropout and activation checkpointing, the loss falls
    fused_adam_step1 DeepSpeed's FusedAdam under the trainer's fp16 wrapper (``FP16_Optimizer``,
        ``training.optim.engine.undo_initial_zero_step``, the O(1) step): the first update equals Megatron's step-1 update
        ``p (1 - lr wd) - lr g / (|g| + eps)``; without the undo it does not
    gpt2_1.2b        the paper's 1.2B config (fp16): the trainer's step time, TFLOP/s, MFU, memory at micro-batch 4
        (full recompute), 8 and 16 (none), and HF ``GPT2LMHeadModel`` at micro-batch 8 under the same engine
    llama_1b         the Llama-style 1B config (configs/llama_1b.yaml: GQA, SwiGLU, RoPE, RMSNorm; bf16, seq
        4096, ``model.recompute: auto``): step time, TFLOP/s and MFU by the Llama FLOP count
        (``training.plan.accounting``: gated MLP, grouped key/values), peak memory

Data comes from ``--data`` (default ``../shared/data`` beside the checkout: GPT-2 BPE files, Botchan,
Tiny Shakespeare, WikiText-103, LAMBADA, RACE). Logs go to OUT/logs/NAME.log, the table to stdout and
OUT/gpu_check.md, the rows to OUT/gpu_check.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.gpu_check.bench import bench_1p2b, bench_llama_1b
from scripts.gpu_check.checks import CHECKS, NAMES, NEEDS, RUN_DIRS
from scripts.gpu_check.context import DEFAULT_DATA, ROOT, Context, Row
from scripts.gpu_check.first_update import first_update
from scripts.gpu_check.steps import compare_hf, prepare_bert_corpus


def render(rows: list[Row], header: str) -> str:
    """A Markdown table (readable as plain text too)."""
    lines = [header, "", "| check | status | detail | s |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.status} | {r.detail.replace('|', '/')} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--only", nargs="+", choices=NAMES, default=None, metavar="NAME", help="run only these checks")
    p.add_argument("--steps", type=int, default=30, help="training steps of the GPT-2 checks (default 30)")
    p.add_argument("--eval-limit", type=int, default=500, help="WikiText lines / LAMBADA examples (default 500)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data folder (default ../shared/data)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="work folder (default runs/gpu_check)")
    p.add_argument("--cpu-dry-run", action="store_true", help="no GPU: list the plan and render the table")
    p.add_argument("--prepare-bert-corpus", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--compare-hf", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--bench-1p2b", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--bench-llama-1b", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--first-update", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error(f"--steps must be >= 4 (the loss must have room to fall), got {args.steps}")
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.eval_limit < 1:
        p.error(f"--eval-limit must be >= 1, got {args.eval_limit}")
    return args


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    args = parse_args(argv)
    if args.prepare_bert_corpus:
        prepare_bert_corpus(args.prepare_bert_corpus, args.data)
        return 0
    if args.compare_hf:
        compare_hf(*args.compare_hf, args.data)
        return 0
    if args.bench_1p2b:
        bench_1p2b(args.bench_1p2b, args.data)
        return 0
    if args.first_update:
        from training.runtime.distributed import init_distributed

        init_distributed()  # the O(1) step all-reduces its norm over the (one-process) group
        args.first_update.write_text(json.dumps(first_update()))
        return 0
    if args.bench_llama_1b:
        bench_llama_1b(args.bench_llama_1b, args.data)
        return 0
    if args.cpu_dry_run:
        gpus, device = args.gpus or 2, f"dry run (plan for {args.gpus or 2} GPUs, nothing executed)"
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible: run on an NVIDIA machine, or use --cpu-dry-run", file=sys.stderr)
            return 2
        visible = torch.cuda.device_count()
        gpus = min(args.gpus or visible, visible)
        device = f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    missing = [p for p in ("tokenizers/gpt2/gpt2-vocab.json", "corpus/tinyshakespeare.txt", "eval/RACE")
               if not (args.data / p).exists()]
    if missing and not args.cpu_dry_run:
        print(f"gpu_check: --data {args.data} lacks {missing[0]} (the shared data folder)", file=sys.stderr)
        return 2
    ctx = Context(args, gpus, args.cpu_dry_run, args.out, args.data)
    selected = args.only or NAMES
    rows: list[Row] = []
    passed: set[str] = set()
    for name, need, fn in CHECKS:
        if name not in selected:
            continue
        if need > gpus:
            rows.append(Row(name, "SKIP", f"needs {need} GPUs, {gpus} available"))
            continue
        dep = NEEDS.get(name)
        if not ctx.dry and dep and dep not in passed and not (args.out / RUN_DIRS[dep]).is_dir():
            rows.append(Row(name, "SKIP", f"needs the run of {dep} (add it to --only)"))
            continue
        t0 = time.perf_counter()
        start = len(ctx.planned)
        try:
            ok, detail = fn(ctx)
            status = "DRY-RUN" if ctx.dry else ("PASS" if ok else "FAIL")
            if ctx.dry:
                detail = " ; ".join(c.replace(str(ROOT) + "/", "") for c in ctx.planned[start:])
        except Exception as e:  # noqa: BLE001 - one failing check does not stop the suite
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
        if status == "PASS":
            passed.add(name)
        rows.append(Row(name, status, detail, time.perf_counter() - t0))
        print(f"gpu_check: {name}: {status}", file=sys.stderr, flush=True)
    table = render(rows, f"GPU check: {device}")
    print(table)
    if not ctx.dry:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(table + "\n")
        (args.out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.status in ("PASS", "SKIP", "DRY-RUN") for r in rows) else 1
