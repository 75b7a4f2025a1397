"""Layer-order study: post-LN (original BERT) vs pre-LN (Megatron, Figure 7) BERT at increasing depth.

    python -m scripts.layer_order_study [--corpus runs/corpus-bert] [--depths 2,4,8,16] [--iters 150] ...

Every (order, depth) pair trains from the same seed on the same sample order with the same budget and
learning-rate schedule (single process, fp32, CPU; the model is ``training.models.bert.BertModel`` at
TP=1 with only ``model.layer_order`` switched). Reported: the training loss (MLM + SOP, mean of the last
10 % of steps), the held-out loss (MLM + SOP and MLM alone, on fixed validation samples) and whether the
run diverged (non-finite loss). Output in ``--out``: ``results.json``, ``results.md`` (the table) and
``layer_order.png`` (loss curves per depth, and final held-out loss against depth).

The paper's Figure 7 shows the original order becoming unstable / worse as BERT grows (336M -> 752M)
while the rearranged order keeps improving. At this scale the difference, if any, is whatever the
table says; the script reports it as found.

The corpus is a sentence-level BERT corpus (``python -m data_pipeline build --config
configs/data/default.yaml output_dir=runs/corpus-bert tokenizer.flavor=bert dataset.bert=true
dataset.gpt=false``); it is built into ``--corpus`` when missing.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron_ds_suite.core import atomic
from training.config import OptimizerConfig
from training.data.bert_data import BertDataset, BertVocab, MaskingConfig, collate
from training.models.bert import BertModel, bert_loss
from training.models.config import ModelConfig, padded_vocab_size
from training.optim.adamw import param_groups
from training.optim.lr_schedule import lr_at

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("layer_order_study")


def ensure_corpus(path: Path) -> None:
    if (path / "corpus.json").is_file():
        return
    logger.info("building the BERT corpus into %s", path)
    subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(ROOT / "configs/data/default.yaml"),
                    f"output_dir={path}", "tokenizer.flavor=bert", "dataset.bert=true", "dataset.gpt=false",
                    "progress=false"], check=True, cwd=ROOT)


def train_one(order: str, depth: int, args, train_ds, valid_batches, vocab_size: int) -> dict:
    cfg = ModelConfig(arch="bert", num_layers=depth, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=vocab_size, hidden_dropout=args.dropout,
                      attention_dropout=args.dropout, layer_order=order)
    torch.manual_seed(args.seed)
    model = BertModel(cfg, padded_vocab_size(vocab_size, 128, 1), None, seed=args.seed)
    ocfg = OptimizerConfig(lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01, warmup_iters=args.warmup,
                           decay_style="linear")
    opt = torch.optim.AdamW(param_groups(model, ocfg.weight_decay), lr=ocfg.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_at(it, ocfg, args.iters) / ocfg.lr)
    curve, diverged = [], False
    t0 = time.perf_counter()
    model.train()
    for it in range(args.iters):
        batch = collate([train_ds[it * args.batch + i] for i in range(args.batch)])
        lm, sop = model(batch["text"], batch["types"], batch["padding_mask"], batch["labels"], batch["loss_mask"])
        loss, parts = bert_loss(lm, sop, batch["is_random"])
        if not math.isfinite(loss.item()):
            diverged = True
            curve.append(float("nan"))
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append(loss.item())
    model.eval()
    tot = mlm = 0.0
    with torch.no_grad():
        for b in valid_batches:
            lm, sop = model(b["text"], b["types"], b["padding_mask"], b["labels"], b["loss_mask"])
            loss, parts = bert_loss(lm, sop, b["is_random"])
            tot += loss.item()
            mlm += parts["mlm_loss"]
    tail = max(1, len(curve) // 10)
    return {"order": order, "depth": depth, "parameters": model.num_parameters(exclude_padding=True),
            "train_loss": float(np.mean(curve[-tail:])) if not diverged else float("nan"),
            "valid_loss": tot / len(valid_batches) if not diverged else float("nan"),
            "valid_mlm_loss": mlm / len(valid_batches) if not diverged else float("nan"),
            "diverged": diverged, "seconds": time.perf_counter() - t0, "curve": curve}


def table(rows: list[dict]) -> str:
    by = {(r["order"], r["depth"]): r for r in rows}
    depths = sorted({r["depth"] for r in rows})
    lines = ["| layers | params | post-LN train | pre-LN train | post-LN held-out (MLM) | pre-LN held-out (MLM) "
             "| post - pre held-out | lower |",
             "|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for d in depths:
        a, b = by[("post_ln", d)], by[("pre_ln", d)]
        better = "-" if a["diverged"] and b["diverged"] else (
            "pre-LN" if (a["diverged"] or b["valid_loss"] < a["valid_loss"]) else "post-LN")
        lines.append(f"| {d} | {b['parameters']:,} | {a['train_loss']:.3f} | {b['train_loss']:.3f} | "
                     f"{a['valid_loss']:.3f} ({a['valid_mlm_loss']:.3f}) | {b['valid_loss']:.3f} ({b['valid_mlm_loss']:.3f}) "
                     f"| {a['valid_loss'] - b['valid_loss']:+.3f} | {better} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["depth"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(depths)))
    k = max(1, args.iters // 40)
    for r in rows:
        c = colors[depths.index(r["depth"])]
        y = np.convolve(np.asarray(r["curve"], dtype=float), np.ones(k) / k, mode="valid")
        ax1.plot(np.arange(len(y)) + k, y, color=c, ls="-" if r["order"] == "pre_ln" else "--",
                 label=f"{r['order'].replace('_', '-')} {r['depth']}L")
    ax1.set(xlabel="iteration", ylabel="train loss (MLM + SOP, smoothed)", title="training curves (-- post-LN, - pre-LN)")
    ax1.legend(fontsize=7, ncol=2)
    for order, ls in (("post_ln", "--o"), ("pre_ln", "-s")):
        rr = sorted((r for r in rows if r["order"] == order), key=lambda r: r["depth"])
        ax2.plot([r["depth"] for r in rr], [r["valid_loss"] for r in rr], ls, label=order.replace("_", "-"))
    ax2.set(xlabel="layers", ylabel="held-out loss (MLM + SOP)", xscale="log", title="final held-out loss vs depth")
    ax2.set_xticks(depths, [str(d) for d in depths])
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.legend()
    fig.suptitle(f"BERT layer order, hidden {args.hidden}, {args.iters} iterations x {args.batch} samples, lr {args.lr}")
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="runs/corpus-bert")
    ap.add_argument("--out", default="runs/layer_order_study")
    ap.add_argument("--depths", default="2,4,8,16")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--valid-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: small matrices, no contention)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    depths = [int(x) for x in args.depths.split(",")]
    if any(d < 1 for d in depths) or args.hidden % args.heads:
        ap.error("depths must be >= 1 and --hidden divisible by --heads")
    from tqdm import tqdm

    from megatron_ds_suite.core.corpus import load_corpus

    corpus_dir = (ROOT / args.corpus) if not Path(args.corpus).is_absolute() else Path(args.corpus)
    ensure_corpus(corpus_dir)
    corpus = load_corpus(corpus_dir)
    tok, indexed = corpus.tokenizer, corpus.bert_dataset()
    vocab = BertVocab.from_tokenizer(tok)
    n_docs = indexed.num_documents
    cut = int(n_docs * 0.9)
    train_ds = BertDataset(indexed, np.arange(cut), args.iters * args.batch, args.seq, vocab, MaskingConfig(), 0.1,
                           args.seed, "train")
    valid_ds = BertDataset(indexed, np.arange(cut, n_docs), args.valid_batches * args.batch, args.seq, vocab,
                           MaskingConfig(), 0.1, args.seed + 1, "valid")
    valid_batches = [collate([valid_ds[b * args.batch + i] for i in range(args.batch)])
                     for b in range(args.valid_batches)]
    # reference: MLM loss of the best context-free predictor (training-split unigram distribution)
    first, last = int(indexed.doc_idx[0]), int(indexed.doc_idx[cut])
    counts = np.bincount(np.concatenate([np.asarray(indexed[i]) for i in range(first, last)]).astype(np.int64),
                         minlength=tok.vocab_size).astype(np.float64) + 1e-3
    logp = np.log(counts / counts.sum())
    targets = np.concatenate([b["labels"][b["loss_mask"].bool()].numpy() for b in valid_batches])
    unigram = float(-logp[targets].mean())
    rows = []
    runs = [(o, d) for d in depths for o in ("post_ln", "pre_ln")]
    for order, depth in tqdm(runs, desc="runs", unit="run"):
        r = train_one(order, depth, args, train_ds, valid_batches, tok.vocab_size)
        logger.info("%s %2d layers: train %.3f | held-out %.3f (MLM %.3f)%s | %.0fs", order, depth, r["train_loss"],
                    r["valid_loss"], r["valid_mlm_loss"], " | DIVERGED" if r["diverged"] else "", r["seconds"])
        rows.append(r)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(rows)
    header = (f"BERT layer order at hidden {args.hidden}, {args.heads} heads, seq {args.seq}, {args.iters} iterations x "
              f"{args.batch} samples, lr {args.lr} (warmup {args.warmup}, linear decay), dropout {args.dropout}, "
              f"seed {args.seed}; losses = MLM + SOP (held-out MLM alone in brackets). Reference: a context-free "
              f"unigram predictor scores held-out MLM {unigram:.3f}, chance SOP = ln 2 = 0.693.\n\n")
    for name, text in (("results.md", header + md + "\n"),
                       ("results.json", json.dumps({"args": vars(args), "unigram_mlm_loss": unigram, "runs": rows}, indent=2))):
        atomic.write_text(out / name, text)
    plot(rows, out / "layer_order.png", args)
    print()
    print(header + md)
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}, {out / 'layer_order.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
