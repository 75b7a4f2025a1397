"""Evaluation speed: WikiText-103 window scoring, batched vs one window at a time (GPT-2 BPE).

    .venv/bin/python -m benchmarks.bench_eval --windows 48 --reps 5 [--batches 1,2,4,8,16]

A randomly initialised GPT-2 of the given size (speed does not depend on the weights) scores the first
``--windows`` overlapping windows (length ``--seq``, stride ``--stride``) of the real detokenized
WikiText-103 test stream with ``evaluation.wikitext.score_stream``, the code `python -m evaluation
wikitext103` runs. Candidates: each batch size of ``--batches`` with the output layer only at the scored
positions (``evaluation.scoring.gpt2_scorer``, what the CLI uses), and the smallest and largest batch
with full ``[b, s, V]`` logits (``LMScorer``). Repetitions are interleaved (``benchmarks/common.py``);
every candidate must give the same total NLL. Prints a Markdown block for ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from evaluation.detokenizer import wikitext_detokenizer
from evaluation.scoring import LMScorer, gpt2_scorer
from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = Path(ROOT) / ".." / "shared" / "data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--stride", type=int, default=32)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--batches", default="1,2,4,8,16", help="comma-separated windows per forward pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(args.batches) < 1 or min(args.layers, args.hidden, args.heads, args.seq, args.stride, args.windows,
                                    args.reps) < 1:
        ap.error("sizes, --batches, --windows and --reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab_json, tokens = DATA / "tokenizers/gpt2/gpt2-vocab.json", DATA / "eval/wikitext-103/wiki.test.tokens"
    if not (vocab_json.is_file() and tokens.is_file()):
        raise SystemExit(f"error: needs {vocab_json} and {tokens} (../shared/data beside the repository)")

    from evaluation.wikitext import WindowPlan, read_tokens_file, score_stream
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel

    tok = GPT2BPETokenizer(vocab_json, DATA / "tokenizers/gpt2/gpt2-merges.txt")
    ids = tok.encode(wikitext_detokenizer(read_tokens_file(tokens)))
    n_tokens = args.seq + 1 + (args.windows - 1) * args.stride
    plan = WindowPlan(np.asarray(ids[:n_tokens]), args.seq, args.stride, tok.eod)
    assert plan.num_windows == args.windows
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=tok.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, 50304).eval()
    heads = {"scored positions": gpt2_scorer(model, tok.vocab_size, args.seq),
             "full logits": LMScorer(model, tok.vocab_size, args.seq)}
    runs = [("scored positions", b) for b in args.batches]
    runs += [("full logits", b) for b in sorted({args.batches[0], args.batches[-1]})]
    nll: dict[str, float] = {}

    def candidate(head: str, batch: int):
        def run() -> float:
            with torch.inference_mode():
                seconds = common.timed(lambda: nll.__setitem__(f"{head}, batch {batch}",
                                                               score_stream(heads[head], plan, batch,
                                                                            progress=False).total_nll))
            return seconds
        return run

    cands = {f"{h}, batch {b}": candidate(h, b) for h, b in runs}
    for c in cands.values():  # warm-up (allocations, kernel choice)
        c()
    info = common.machine_info()
    res = common.interleaved(cands, args.reps)
    ref = nll[f"scored positions, batch {args.batches[0]}"]
    for name, v in nll.items():
        assert abs(v - ref) <= 1e-5 * abs(ref), (name, v, ref)
    model_tokens = args.windows * args.seq
    print(common.markdown_header(info, common.load_average()))
    print(f"- GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, random weights; {args.windows} "
          f"windows of {args.seq} tokens, stride {args.stride}, of the detokenized WikiText-103 test stream; "
          f"{args.reps} interleaved repetitions; total NLL {ref:.2f} for every candidate\n")
    one = res[f"scored positions, batch {args.batches[0]}"]
    rows = [[name, v.fmt(".2f"), common.Samples([model_tokens / x for x in v.values]).fmt(",.0f"),
             common.ratio_samples(one, v).fmt(".2f")] for name, v in res.items()]
    print(common.markdown_table(["output layer, windows per forward", "seconds median [min-max]",
                                 "model tokens/s", f"speed-up vs scored positions, batch {args.batches[0]}"], rows))


if __name__ == "__main__":
    main()
