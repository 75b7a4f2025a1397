"""The GPU smoke suite's checks, each a real run through the project's own entry points: ``CHECKS`` holds
(name, GPUs needed, function(ctx) -> (ok, detail)), in the order they run.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable

from scripts.gpu_check.bench import (
    HF_MICRO_1P2B,
    describe_1p2b,
    describe_hf,
    hf_1p2b_command,
    llama_1b_overrides,
    load_llama_1b,
)
from scripts.gpu_check.context import ROOT, Context, loss_falls, metrics
from scripts.gpu_check.first_update import FIRST_UPDATE_TOL


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
