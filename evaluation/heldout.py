"""Perplexity of a GPT checkpoint on the held-out documents of its own corpus.

    python -m evaluation heldout --checkpoint RUN_DIR --corpus CORPUS_DIR --split 90,5,5 --part test \
        [--stride 0] [--batch-size 8] [--max-documents 0] [--json OUT] [--tp 1] [--no-progress]

Documents: the ``--part`` (test or valid) of Megatron's document split ``--split`` (by the run's
``data.split_convention``, ``--split-convention``) of the corpus's GPT
indexed dataset (``training.data.gpt_dataset.split_documents``, the split training used, so none of
these documents was trained on). Their tokens (each document ends with the EOD the corpus builder
appended) are concatenated in corpus order into one stream of N tokens and scored with the evaluation
package's overlapping windows (``evaluation.wikitext.WindowPlan`` / ``score_stream``): window length
L = the model's seq_length, stride s (``--stride 0`` = L: disjoint windows, the context training's
validation loss sees). Every target 1..N-1 is scored exactly once:

    loss = sum NLL / (N - 1)            ppl = exp(min(20, loss))        (per model token, natural log)

(``evaluation.wikitext.perplexity_numbers`` with original tokens = model tokens). Softmax over the real
vocabulary (padding rows excluded), as the evaluation CLI does.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np

from evaluation.errors import EvalError
from evaluation.report import format_table
from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.corpus import load_corpus

logger = logging.getLogger("heldout")
PARTS = {"train": 0, "valid": 1, "test": 2}


def heldout_tokens(corpus_dir: str | Path, split: str, part: str, max_documents: int = 0,
                   convention: str = "megatron_lm") -> tuple[np.ndarray, int, int]:
    """(token stream int64 [N], documents used, documents in the part) of one split part (``convention``: the
    run's ``data.split_convention``)."""
    from training.data.gpt_dataset import split_documents

    corpus = load_corpus(corpus_dir)
    ds = corpus.gpt_dataset()
    items = split_documents(ds, split, convention)[PARTS[part]]
    if len(items) == 0:
        raise EvalError(f"the {part} part of split {split!r} over the {ds.num_documents} documents of {corpus_dir} is "
                        f"empty: give it a larger share in the training config's data.split (e.g. '90,5,5')")
    used = items[:max_documents] if max_documents else items
    stream = np.concatenate([np.asarray(ds.get(int(i)), dtype=np.int64) for i in used])
    return stream, len(used), len(items)


def add_parser(sub) -> None:
    """The ``heldout`` subcommand of ``python -m evaluation``."""
    ap = sub.add_parser("heldout", help="perplexity on the held-out documents of the checkpoint's own corpus",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="training run directory")
    ap.add_argument("--corpus", required=True, help="corpus directory (corpus.json) the run trained on")
    ap.add_argument("--split", required=True, help="the run's data.split, e.g. 90,5,5")
    ap.add_argument("--split-convention", default="megatron_lm", choices=["megatron_lm", "megatron_core"],
                    help="the run's data.split_convention")
    ap.add_argument("--part", default="test", choices=["valid", "test"])
    ap.add_argument("--stride", type=int, default=0, help="0 = seq_length (disjoint windows)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-documents", type=int, default=0, help="0 = all documents of the part")
    ap.add_argument("--json", default=None, help="output JSON (default RUN_DIR/eval/heldout.json)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def run_heldout(args: argparse.Namespace) -> None:
    """Score the part; bad input raises :class:`EvalError` (one line, exit code 2 in the CLI)."""
    from evaluation.model import load_scorer, setup_runtime
    from evaluation.wikitext import WindowPlan, perplexity_numbers, score_stream
    if args.batch_size < 1 or args.stride < 0 or args.max_documents < 0:
        raise EvalError("--batch-size must be >= 1, --stride and --max-documents >= 0")
    if not Path(args.corpus, "corpus.json").is_file():
        raise EvalError(f"{args.corpus} is not a corpus directory (no corpus.json)")
    tokens, n_docs, part_docs = heldout_tokens(args.corpus, args.split, args.part, args.max_documents,
                                               args.split_convention)
    rt = setup_runtime(args.tp)
    scorer, cfg, tok = load_scorer(args.checkpoint, rt)
    corpus_vocab = load_corpus(args.corpus).tokenizer.vocab_size
    if corpus_vocab != tok.vocab_size:
        raise EvalError(f"corpus tokenizer ({corpus_vocab} ids) is not the checkpoint's ({tok.vocab_size} ids): "
                        "score the corpus the model was trained on")
    L = cfg.model.seq_length
    stride = args.stride or L
    plan = WindowPlan(tokens, L, stride, tok.eod)
    t0 = time.perf_counter()
    res = score_stream(scorer, plan, args.batch_size, rt.dp.rank, rt.dp.world, rt.dp.group,
                       progress=not args.no_progress and rt.is_main)
    elapsed = time.perf_counter() - t0
    if res.scored_tokens != len(tokens) - 1:
        raise RuntimeError(f"scored {res.scored_tokens} targets, expected {len(tokens) - 1}")
    nums = perplexity_numbers(res.total_nll, len(tokens), len(tokens))
    out = {"task": "heldout", "checkpoint": str(args.checkpoint), "corpus": str(args.corpus),
           "split": args.split, "split_convention": args.split_convention, "part": args.part, "documents": n_docs, "part_documents": part_docs,
           "tokens": int(len(tokens)), "scored_targets": res.scored_tokens, "total_nll": res.total_nll,
           "loss": nums["loss"], "ppl": nums["ppl"], "seq_length": L, "stride": stride,
           "windows": plan.num_windows, "score_seconds": elapsed}
    if rt.is_main:
        path = Path(args.json) if args.json else Path(args.checkpoint) / "eval" / "heldout.json"
        atomic.write_json(path, out)
        print(format_table(f"Held-out perplexity ({args.part} documents of the corpus)", [
            ("documents", n_docs), ("tokens N", int(len(tokens))), ("loss / token (nats)", nums["loss"]),
            ("perplexity", nums["ppl"]), ("windows (L, stride)", f"{plan.num_windows} ({L}, {stride})")]))
        print(f"wrote {path}")
