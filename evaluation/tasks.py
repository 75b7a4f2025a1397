"""The three evaluations as functions of (scorer, tokenizer, data): used by the CLI and the tests.

Each returns a JSON-able dict of numbers computed through the local `evaluate` metric modules.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from evaluation.detokenizer import get_detokenizer
from evaluation.lambada import build_examples, score_lambada
from evaluation.metrics import load_metric
from evaluation.scoring import LMScorer
from evaluation.wikitext import WindowPlan, count_original_tokens, score_stream

logger = logging.getLogger(__name__)


@dataclass
class DataParallel:
    """Where this process sits among data-parallel replicas (each example scored on one of them)."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None


def wikitext_eval(
    scorer: LMScorer,
    tokenizer,
    text: str,
    seq_len: int,
    stride: int = 32,
    batch_size: int = 8,
    detokenizer: str = "wikitext",
    dp: DataParallel | None = None,
    progress: bool = True,
) -> dict:
    """Megatron WikiText perplexity of the raw ``.tokens`` text (see :mod:`evaluation.wikitext`)."""
    dp = dp or DataParallel()
    num_original = count_original_tokens(text)
    detok = get_detokenizer(detokenizer)(text)
    t0 = time.perf_counter()
    tokens = np.asarray(tokenizer.encode(detok), dtype=np.int64)
    t_tok = time.perf_counter() - t0
    plan = WindowPlan(tokens, seq_len, stride, tokenizer.eod)
    t0 = time.perf_counter()
    res = score_stream(scorer, plan, batch_size, dp.rank, dp.world, dp.group, progress)
    elapsed = time.perf_counter() - t0
    metric = load_metric("perplexity_adjusted")
    out = metric.compute(nll=[res.total_nll], num_targets=[res.scored_tokens],
                         num_tokenized_tokens=len(tokens), num_original_tokens=num_original)
    # tokens through the model (windows x their length) per second, all DP ranks together
    model_tokens = sum(min(seq_len, len(tokens) - 1 - i * stride) for i in range(plan.num_windows))
    out.update(
        detokenizer=detokenizer,
        detokenized_chars=len(detok),
        seq_length=seq_len,
        stride=stride,
        windows=plan.num_windows,
        windows_megatron=plan.num_windows_megatron,
        scored_targets=res.scored_tokens,
        model_tokens_processed=model_tokens,
        tokenize_seconds=t_tok,
        score_seconds=elapsed,
        tokens_per_second=model_tokens / elapsed if elapsed > 0 else float("nan"),
    )
    return out


def lambada_eval(
    scorer: LMScorer,
    tokenizer,
    texts: list[str],
    strict: bool = True,
    batch_size: int = 16,
    dp: DataParallel | None = None,
    progress: bool = True,
) -> dict:
    """LAMBADA accuracy (strict = whole last word greedy; else last BPE token) and target perplexity."""
    dp = dp or DataParallel()
    examples = build_examples(texts, tokenizer, strict)
    t0 = time.perf_counter()
    sc = score_lambada(scorer, examples, tokenizer.eod, batch_size, dp.rank, dp.world, dp.group, progress)
    elapsed = time.perf_counter() - t0
    metric = load_metric("lambada_accuracy")
    out = metric.compute(correct=sc.correct.tolist(), target_logprob=sc.target_logprob.tolist(),
                         target_tokens=sc.target_tokens.tolist())
    hist = np.bincount([len(e.target) for e in examples]).tolist()
    model_tokens = sum(len(e.context) + len(e.target) - 1 for e in examples)
    out.update(
        mode="strict" if strict else "last-token",
        target_length_histogram={str(k): v for k, v in enumerate(hist) if v},
        truncated=sc.truncated,
        score_seconds=elapsed,
        tokens_per_second=model_tokens / elapsed if elapsed > 0 else float("nan"),
    )
    return out
