"""Evaluation speed: batched window scoring vs one window at a time (WikiText-103 test, GPT-2 BPE).

    python benchmarks/bench_eval.py [--layers 4 --hidden 256 --seq 512 --stride 32 --windows 96 --batch 8]

A randomly initialised GPT-2 of the given size (speed does not depend on the weights) scores the first
``--windows`` overlapping windows of the real detokenized WikiText-103 test stream, once with
``--batch`` windows per forward and once with one window per forward. Prints model tokens/s (window
tokens through the model) and checks both runs give the same total NLL.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import training  # noqa: F401  (THP_MEM_ALLOC_ENABLE before torch loads, as every entry point)
import numpy as np
import torch

from data_pipeline.tokenizer import GPT2BPETokenizer
from evaluation.detokenizer import wikitext_detokenizer
from evaluation.scoring import LMScorer, gpt2_scorer
from evaluation.wikitext import WindowPlan, read_tokens_file, score_stream
from training.config import ModelConfig
from training.models.gpt2 import GPT2Model

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--stride", type=int, default=32)
    ap.add_argument("--windows", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = GPT2BPETokenizer(DATA / "tokenizers/gpt2/gpt2-vocab.json", DATA / "tokenizers/gpt2/gpt2-merges.txt")
    ids = tok.encode(wikitext_detokenizer(read_tokens_file(DATA / "eval/wikitext-103/wiki.test.tokens")))
    n_tokens = args.seq + 1 + (args.windows - 1) * args.stride
    plan = WindowPlan(np.asarray(ids[:n_tokens]), args.seq, args.stride, tok.eod)
    assert plan.num_windows == args.windows
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=tok.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT2Model(cfg, 50304).eval()
    scorers = {"full_logits": LMScorer(model, tok.vocab_size, args.seq),
               "scored_positions_only": gpt2_scorer(model, tok.vocab_size, args.seq)}
    scorer = scorers["scored_positions_only"]
    score_stream(scorer, WindowPlan(np.asarray(ids[: args.seq + 1]), args.seq, args.stride, tok.eod), 1, progress=False)  # warm-up
    out = {"config": vars(args), "torch_threads": torch.get_num_threads()}
    runs = (("batched", "scored_positions_only", args.batch), ("one_window", "scored_positions_only", 1),
            ("batched_full_logits", "full_logits", args.batch), ("one_window_full_logits", "full_logits", 1))
    for name, head, bs in runs:
        t0 = time.perf_counter()
        res = score_stream(scorers[head], plan, bs, progress=False)
        dt = time.perf_counter() - t0
        out[name] = {"batch": bs, "head": head, "seconds": round(dt, 3), "windows_per_s": round(args.windows / dt, 2),
                     "model_tokens_per_s": round(args.windows * args.seq / dt, 1), "total_nll": res.total_nll}
    for name, *_ in runs:
        assert abs(out[name]["total_nll"] - out["one_window"]["total_nll"]) <= 1e-5 * abs(out["one_window"]["total_nll"])
    out["speedup"] = round(out["one_window"]["seconds"] / out["batched"]["seconds"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
