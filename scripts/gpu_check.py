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
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data"


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL, SKIP, DRY-RUN
    detail: str
    seconds: float = 0.0


@dataclass
class Context:
    args: argparse.Namespace
    gpus: int
    dry: bool
    out: Path
    data: Path
    planned: list[str] = field(default_factory=list)

    # ---- running ----------------------------------------------------------------------------------
    def run(self, name: str, cmd: list[str], nproc: int = 1) -> None:
        """Run ``cmd`` (a ``-m module ...`` tail when nproc > 0) under torchrun with ``nproc`` processes."""
        full = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + cmd
                if nproc else [sys.executable] + cmd)
        self.planned.append(shlex.join(full))
        if self.dry:
            self.validate(cmd, nproc)
            return
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(full)}\n")
            f.flush()
            rc = subprocess.run(full, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"exit {rc}: see {log}")

    def validate(self, cmd: list[str], nproc: int) -> None:
        """Dry run: a planned pretraining command's config must load and fit its process count (the
        same checks the entry point makes before any process group), and an evaluation command must
        parse with evaluation's own parser, so a bad plan fails on CPU."""
        if cmd[:2] == ["-m", "evaluation"]:
            from evaluation.cli import build_parser

            try:
                build_parser().parse_args(cmd[2:])
            except SystemExit as e:
                raise ValueError(f"planned evaluation command does not parse: {shlex.join(cmd)}") from e
            return
        if cmd[:2] != ["-m", "training.pretrain"]:
            return
        from training.config import load_config
        from training.layout import check_world

        cfg = load_config(cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:])
        check_world(cfg, nproc)

    # ---- data -------------------------------------------------------------------------------------
    def gpt_overrides(self, run: str, **extra) -> list[str]:
        g = self.data / "tokenizers" / "gpt2"
        ov = {"data.corpus": "null", "data.text_files": f"[{self.data / 'corpus' / 'tinyshakespeare.txt'}]",
              "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(g / "gpt2-vocab.json"),
                                            "merges_file": str(g / "gpt2-merges.txt")}),
              "run.dir": str(self.out / run), "train.iters": str(self.args.steps), "train.progress_bar": "false",
              "precision.initial_scale_power": "16", "optimizer.lr": "6.0e-4", "optimizer.warmup_iters": "3",
              "train.micro_batch_size": "8", "train.global_batch_size": "16", "model.seq_length": "128", **extra}
        return [f"{k}={v}" for k, v in ov.items()]


def metrics(run_dir: Path) -> list[dict]:
    """Step rows of RUN_DIR/metrics.jsonl (events excluded)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "event" not in r and "loss" in r]


def loss_falls(run_dir: Path, max_skipped: int) -> tuple[bool, str]:
    m = metrics(run_dir)
    first, last = m[0]["loss"], m[-1]["loss"]
    skipped = int(m[-1].get("skipped") or 0)
    ok = math.isfinite(last) and last < first - 0.5 and skipped <= max_skipped
    return ok, f"loss {first:.2f} -> {last:.2f} over {len(m)} steps, {skipped} skipped (max {max_skipped})"


# --------------------------------------------------------------------------------------------------
# the checks: (name, GPUs needed, function(ctx) -> detail; raises or returns (ok, detail))
# --------------------------------------------------------------------------------------------------
def gpt2(tp: int, dtype: str, pp: int = 1) -> Callable[[Context], tuple[bool, str]]:
    def check(ctx: Context) -> tuple[bool, str]:
        run = f"gpt2_tp{tp}_pp{pp}_{dtype}"
        ctx.run(run, ["-m", "training.pretrain", "--config", str(ROOT / "configs" / "gpt2_tiny.yaml"),
                      *ctx.gpt_overrides(run, **{"parallel.tensor": tp, "parallel.pipeline": pp,
                                                 "precision.dtype": dtype})], nproc=tp * pp)
        return (True, "planned") if ctx.dry else loss_falls(ctx.out / run, max_skipped=5)
    return check


def bert_20(ctx: Context) -> tuple[bool, str]:
    corpus = ctx.out / "bert_corpus"
    ctx.run("bert_corpus", ["-m", "scripts.gpu_check", "--prepare-bert-corpus", str(corpus), "--data",
                            str(ctx.data)], nproc=0)
    ov = {"data.corpus": str(corpus), "run.dir": str(ctx.out / "bert"), "train.iters": "20", "parallel.tensor": "1",
          "train.progress_bar": "false", "precision.initial_scale_power": "16", "train.eval_interval": "10"}
    ctx.run("bert_20", ["-m", "training.pretrain", "--config", str(ROOT / "configs" / "bert_tiny.yaml"),
                        *[f"{k}={v}" for k, v in ov.items()]], nproc=1)
    return (True, "planned") if ctx.dry else loss_falls(ctx.out / "bert", max_skipped=5)


def race_finetune(ctx: Context) -> tuple[bool, str]:
    ov = {"finetune.pretrained": str(ctx.out / "bert"), "finetune.race_dir": str(ctx.data / "eval" / "RACE"),
          "finetune.epochs": "1", "run.dir": str(ctx.out / "race"), "parallel.tensor": "1",
          "train.progress_bar": "false"}
    ctx.run("race_finetune", ["-m", "training.finetune_race", "--config", str(ROOT / "configs" / "race.yaml"),
                              *[f"{k}={v}" for k, v in ov.items()]], nproc=1)
    if ctx.dry:
        return True, "planned"
    res = json.loads((ctx.out / "race" / "race_results.json").read_text())["best"]
    return all(0.0 <= v["accuracy"] <= 1.0 for v in res.values()), " | ".join(
        f"{s} accuracy {v['accuracy']:.3f} ({v['count']} q)" for s, v in res.items())


def evaluation(task: str) -> Callable[[Context], tuple[bool, str]]:
    def check(ctx: Context) -> tuple[bool, str]:
        data = (ctx.data / "eval" / "wikitext-103" / "wiki.test.tokens" if task == "wikitext103"
                else ctx.data / "eval" / "lambada" / "lambada_test.jsonl")
        out = ctx.out / "eval" / f"{task}.json"
        limit = str(ctx.args.eval_limit)
        ctx.run(task, ["-m", "evaluation", task, "--checkpoint", str(ctx.out / "gpt2_tp1_pp1_fp16"), "--data", str(data),
                       "--limit", limit, "--json", str(out), "--no-progress"], nproc=1)
        if ctx.dry:
            return True, "planned"
        r = json.loads(out.read_text())
        if task == "wikitext103":
            return math.isfinite(r["ppl"]), f"ppl {r['ppl']:.1f} (adjusted {r['adjusted_ppl']:.1f}), {limit} lines, " \
                                            f"{r['tokens_per_second']:.0f} tok/s"
        return 0.0 <= r["accuracy"] <= 1.0, f"accuracy {r['accuracy']:.4f} on {r['count']} examples"
    return check


def resume_equal(ctx: Context) -> tuple[bool, str]:
    steps, half = ctx.args.steps, ctx.args.steps // 2
    # fp32: the comparison is about the restored state (weights, Adam, schedule, RNG, data position), not
    # about low-precision rounding of non-deterministic kernels (embedding backward uses atomics)
    common = {"precision.dtype": "fp32", "parallel.tensor": min(2, ctx.gpus), "train.save_interval": half}
    full, part = "resume_full", "resume_part"
    cfg = str(ROOT / "configs" / "gpt2_tiny.yaml")
    ctx.run(full, ["-m", "training.pretrain", "--config", cfg, *ctx.gpt_overrides(full, **common)],
            nproc=common["parallel.tensor"])
    ctx.run(part, ["-m", "training.pretrain", "--config", cfg, *ctx.gpt_overrides(part, **common,
                                                                                  **{"train.exit_at": half})],
            nproc=common["parallel.tensor"])
    ctx.run(part, ["-m", "training.pretrain", "--config", cfg, *ctx.gpt_overrides(part, **common)],
            nproc=common["parallel.tensor"])
    if ctx.dry:
        return True, "planned"
    a = {r["iteration"]: r["loss"] for r in metrics(ctx.out / full)}
    b = {r["iteration"]: r["loss"] for r in metrics(ctx.out / part)}
    after = [i for i in sorted(a) if i > half]
    diff = max(abs(a[i] - b[i]) for i in after)
    return diff <= 1e-4 and len(after) == steps - half, f"max |loss diff| {diff:.2e} over iterations {half + 1}..{steps}"


def cuda_graph(ctx: Context) -> tuple[bool, str]:
    """``model.cuda_graph=true`` (compiled layers replayed as CUDA graphs; never run on a GPU before this check):
    fp32 without dropout its losses equal eager's; with dropout and activation checkpointing the loss falls."""
    tp = min(2, ctx.gpus)
    cfg = str(ROOT / "configs" / "gpt2_tiny.yaml")
    exact = {"precision.dtype": "fp32", "parallel.tensor": tp, "model.hidden_dropout": 0.0,
             "model.attention_dropout": 0.0}
    runs = {"cuda_graph_eager": exact, "cuda_graph_fp32": {**exact, "model.cuda_graph": "true"},
            "cuda_graph_dropout": {"parallel.tensor": tp, "precision.dtype": "fp16", "model.cuda_graph": "true",
                                   "model.activation_checkpointing": "true"}}
    for run, over in runs.items():
        ctx.run(run, ["-m", "training.pretrain", "--config", cfg, *ctx.gpt_overrides(run, **over)], nproc=tp)
    if ctx.dry:
        return True, "planned"
    a, b = metrics(ctx.out / "cuda_graph_eager"), metrics(ctx.out / "cuda_graph_fp32")
    diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    ok, detail = loss_falls(ctx.out / "cuda_graph_dropout", max_skipped=5)
    return (ok and diff <= 1e-4 and len(a) == len(b),
            f"TP {tp}: fp32 max |loss diff| vs eager {diff:.2e}; fp16, dropout, recompute: {detail}")


def hf_export(ctx: Context) -> tuple[bool, str]:
    out = ctx.out / "hf_export"
    ctx.run("hf_export", ["-m", "training.tools.export_hf", "--checkpoint", str(ctx.out / "gpt2_tp1_pp1_fp16"), "--out",
                          str(out), "--overwrite"], nproc=0)
    ctx.run("hf_export", ["-m", "scripts.gpu_check", "--compare-hf", str(ctx.out / "gpt2_tp1_pp1_fp16"), str(out),
                          "--data", str(ctx.data)], nproc=0)
    if ctx.dry:
        return True, "planned"
    r = json.loads((out / "compare.json").read_text())
    return r["max_abs_diff"] <= 1e-3, f"max |logit diff| {r['max_abs_diff']:.2e} over {r['tokens']} tokens (fp32)"


def fused_adam_step1(ctx: Context) -> tuple[bool, str]:
    out = ctx.out / "fused_adam_step1.json"
    ctx.run("fused_adam_step1", ["-m", "scripts.gpu_check", "--first-update", str(out)], nproc=0)
    if ctx.dry:
        return True, "planned"
    r = json.loads(out.read_text())
    ok = r["undo"]["max_abs_diff"] <= FIRST_UPDATE_TOL and r["no_undo"]["max_abs_diff"] > 100 * FIRST_UPDATE_TOL
    return ok, (f"{r['optimizer']}, {r['params']} weights: max |update - Megatron's step 1| {r['undo']['max_abs_diff']:.1e} "
                f"with the undo (Adam step {r['undo']['adam_step']}), {r['no_undo']['max_abs_diff']:.1e} without "
                f"(Adam step {r['no_undo']['adam_step']})")


def gpt2_1p2b(ctx: Context) -> tuple[bool, str]:
    out = ctx.out / "gpt2_1.2b.json"
    ctx.run("gpt2_1.2b", ["-m", "scripts.gpu_check", "--bench-1p2b", str(out), "--data", str(ctx.data)], nproc=0)
    if ctx.dry:
        ctx.run("gpt2_1.2b", hf_1p2b_command(ctx.out / "gpt2_1.2b_hf.json"), nproc=0)
        return True, "planned"
    r = json.loads(out.read_text())
    first = r["variants"][0]
    ok = not first.get("oom") and first["skipped_last"] == 0
    hf_out = ctx.out / "gpt2_1.2b_hf.json"
    try:  # the trainer's rows stand without HF's
        ctx.run("gpt2_1.2b", hf_1p2b_command(hf_out), nproc=0)
        hf = json.loads(hf_out.read_text())
        r["hf"] = {"micro_batch": hf["batch"], **hf["rows"]["hf"]}
    except (RuntimeError, OSError, KeyError) as e:
        r["hf"] = {"micro_batch": HF_MICRO_1P2B, "error": f"{type(e).__name__}: {e}"}
    return ok, f"{r['device']}, seq 1024, fp16; " + "; ".join(describe_1p2b(v) for v in r["variants"]) + describe_hf(r)


def llama_1b(ctx: Context) -> tuple[bool, str]:
    out = ctx.out / "llama_1b.json"
    if ctx.dry:  # each variant's config must load (the same checks the trainer makes) and fit one process
        from training.layout import check_world

        for ov in llama_1b_overrides(ctx.data, "DRY"):
            check_world(load_llama_1b(ov), 1)
    ctx.run("llama_1b", ["-m", "scripts.gpu_check", "--bench-llama-1b", str(out), "--data", str(ctx.data)], nproc=0)
    if ctx.dry:
        return True, "planned"
    r = json.loads(out.read_text())
    first = r["variants"][0]
    ok = not first.get("oom") and first["skipped_last"] == 0
    return ok, f"{r['device']}, seq 4096, bf16; " + "; ".join(describe_1p2b(v) for v in r["variants"])


CHECKS: list[tuple[str, int, Callable[[Context], tuple[bool, str]]]] = [
    ("gpt2_tp1_fp16", 1, gpt2(1, "fp16")),
    ("gpt2_tp1_bf16", 1, gpt2(1, "bf16")),
    ("gpt2_tp2_fp16", 2, gpt2(2, "fp16")),
    ("gpt2_tp2_bf16", 2, gpt2(2, "bf16")),
    ("gpt2_pp2", 2, gpt2(1, "fp16", pp=2)),
    ("bert_20", 1, bert_20),
    ("race_finetune", 1, race_finetune),
    ("wikitext103", 1, evaluation("wikitext103")),
    ("lambada", 1, evaluation("lambada")),
    ("resume_equal", 1, resume_equal),
    ("hf_export", 1, hf_export),
    ("cuda_graph", 1, cuda_graph),
    ("fused_adam_step1", 1, fused_adam_step1),
    ("gpt2_1.2b", 1, gpt2_1p2b),
    ("llama_1b", 1, llama_1b),
]
NAMES = [c[0] for c in CHECKS]
# a check that reads another's run directory runs only when that one ran in this invocation
NEEDS = {"race_finetune": "bert_20", "wikitext103": "gpt2_tp1_fp16", "lambada": "gpt2_tp1_fp16",
         "hf_export": "gpt2_tp1_fp16"}
RUN_DIRS = {"bert_20": "bert", "gpt2_tp1_fp16": "gpt2_tp1_pp1_fp16"}


# --------------------------------------------------------------------------------------------------
# internal steps (run as their own processes by the checks above)
# --------------------------------------------------------------------------------------------------
def prepare_bert_corpus(root: Path, data: Path) -> None:
    """A sentence-level BERT corpus (like ``python -m data_pipeline build ... dataset.bert=true``) from
    Botchan and Tiny Shakespeare, with an 8,000-piece BERT-flavoured sentencepiece vocabulary."""
    import numpy as np

    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
    from data_pipeline.sentences import split_sentences
    from data_pipeline.tokenizer_train import train_sentencepiece

    docs = []
    for name in ("botchan.txt", "tinyshakespeare.txt"):
        lines = (data / "corpus" / name).read_text(encoding="utf-8").lstrip("\ufeff").splitlines()
        docs += [split_sentences(" ".join(x.strip() for x in lines[i:i + 30])) for i in range(0, len(lines), 30)]
    docs = [d for d in docs if len(d) >= 2]
    tok = train_sentencepiece([" ".join(d) for d in docs], root / "tokenizer" / "spm", 8000, flavor="bert",
                              lowercase=True)
    with MMapIndexedDatasetBuilder(root / "sent", best_dtype(tok.vocab_size)) as b:
        for d in docs:
            b.add_document([np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(d) if ids])
    write_manifest(root, tok.spec(), None, "sent", {"source": "gpu_check: botchan + tinyshakespeare"})


def compare_hf(run_dir: Path, hf_dir: Path, data: Path) -> None:
    """Logits of the exported HF model and of ours (fp32, TF32 off) on 512 Tiny Shakespeare tokens."""
    import torch
    from transformers import GPT2LMHeadModel

    from training.checkpoint_reader import load_model_for_eval

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours, cfg, tok = load_model_for_eval(run_dir, device="cuda")
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).cuda().eval()
    text = (data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:4000]
    ids = torch.tensor([tok.encode(text)[:cfg.model.seq_length]], device="cuda")
    with torch.no_grad():
        a = ours(ids)[..., :tok.vocab_size].float()
        b = hf(ids).logits.float()
    res = {"max_abs_diff": float((a - b).abs().max()), "tokens": int(ids.numel())}
    (hf_dir / "compare.json").write_text(json.dumps(res))


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
    TFLOP/s and MFU (``training.metrics.flops_per_iteration``: Llama's gated MLP and grouped key/values) over the
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
    import gc
    import tempfile

    import torch

    from training.config import load_config
    from training.runtime.distributed import init_distributed
    from training.resolve import resolve_run
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


FIRST_UPDATE_TOL = 1e-5  # fp32 masters, |update| ~ lr = 1e-2: Adam's sqrt and division round at ~1e-7 relative


def first_update(device: str = "cuda", adam: str = "fused") -> dict:
    """The first update of the trainer's fp16 optimizer against Megatron's step 1, with and without
    ``training.optim.engine.undo_initial_zero_step``: DeepSpeed's ``FP16_Optimizer`` (the wrapper it gives FusedAdam) around
    ``adam`` ('fused': DeepSpeed's FusedAdam, CUDA; 'torch': torch's AdamW, for a CPU test of this function), the
    O(1) step installed, lr 1e-2, weight decay 0.1, one step of random gradients (scaled by the loss scale, as
    backward leaves them). Megatron's step 1: bias corrections 1 - beta^1 give m = g, v = g^2, so the update is
    ``p (1 - lr wd) - lr g / (|g| + eps)``. FusedAdam seeds each new state's step from its group's ``step``:
    the undo must set it to 0, or the first real step is Adam's step 2 (the bug of issue 27)."""
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from training.optim.engine import undo_initial_zero_step
    from training.optim.mixed_precision import MixedPrecisionStep

    lr, wd, eps = 1e-2, 0.1, 1e-8
    res: dict = {"optimizer": "DeepSpeed FusedAdam" if adam == "fused" else "torch AdamW", "device": device}
    for undo in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128),
                                    torch.nn.Linear(128, 32)).to(device).half()
        if adam == "fused":
            from deepspeed.ops.adam import FusedAdam

            from training.runtime.gpu_settings import deepspeed_buildable_arch_list

            with deepspeed_buildable_arch_list():
                inner = FusedAdam(model.parameters(), lr=lr, weight_decay=wd, eps=eps, adam_w_mode=True)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, eps=eps)
        opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False, clip_grad=0.0,
                             dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 1000, "delayed_shift": 1,
                                                "consecutive_hysteresis": False, "min_scale": 1})
        if undo:
            undo_initial_zero_step(opt)
        step = MixedPrecisionStep.create(opt)
        before = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        gen = torch.Generator().manual_seed(3)
        grads = [torch.randn(p.shape, generator=gen).half().to(device) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g * opt.loss_scale_config.cur_scale
        outcome = step.step()
        g = torch.cat([x.float().reshape(-1) for x in grads])
        expected = before * (1 - lr * wd) - lr * g / (g.abs() + eps)
        after = opt.fp32_groups_flat[0].detach().float()
        state = next(iter(inner.state.values()), {})
        step = state.get("step", inner.param_groups[0].get("step"))
        res["undo" if undo else "no_undo"] = {"max_abs_diff": (after - expected).abs().max().item(),
                                              "adam_step": int(step) if step is not None else None,
                                              "o1_step": step is not None, "overflow": not outcome.applied}
        res["params"] = before.numel()
    return res


# --------------------------------------------------------------------------------------------------
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


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
