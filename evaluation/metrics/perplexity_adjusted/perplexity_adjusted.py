"""Megatron's WikiText perplexity and word-level *adjusted* perplexity (an `evaluate` module).

Inputs, one row per scored window (or any partition of the targets):
    nll          float  sum of the natural-log NLL of the window's scored targets
    num_targets  int    number of targets scored in that window
Arguments of ``compute``:
    num_tokenized_tokens  N, length of the model-token stream (Σ num_targets must equal N - 1)
    num_original_tokens   pieces of the original text split on single spaces (newlines included)
Output:
    loss = Σnll / (N-1);  ppl = exp(min(20, loss));  token_ratio = (N-1) / (num_original_tokens-1);
    adjusted_ppl = exp(min(20, loss * token_ratio)) = exp(min(20, Σnll / (num_original_tokens-1)))
"""
import math

import datasets
import evaluate

_DESCRIPTION = __doc__
_CITATION = """@article{shoeybi2019megatron, title={Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism}, author={Shoeybi, Mohammad and others}, journal={arXiv:1909.08053}, year={2019}}"""


class PerplexityAdjusted(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_DESCRIPTION,
            features=datasets.Features({"nll": datasets.Value("float64"), "num_targets": datasets.Value("int64")}),
        )

    def _compute(self, nll, num_targets, num_tokenized_tokens=None, num_original_tokens=None):
        if num_tokenized_tokens is None or num_original_tokens is None:
            raise ValueError("perplexity_adjusted needs num_tokenized_tokens and num_original_tokens")
        if num_tokenized_tokens < 2 or num_original_tokens < 2:
            raise ValueError("perplexity_adjusted needs at least 2 model tokens and 2 original tokens")
        scored = int(sum(num_targets))
        if scored != num_tokenized_tokens - 1:
            raise ValueError(f"{scored} targets were scored but the stream has {num_tokenized_tokens - 1}: "
                             "every target must be scored exactly once")
        total = math.fsum(nll)
        loss = total / (num_tokenized_tokens - 1)
        ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
        return {
            "total_nll": total,
            "loss": loss,
            "ppl": math.exp(min(20.0, loss)),
            "token_ratio": ratio,
            "adjusted_ppl": math.exp(min(20.0, loss * ratio)),
            "num_tokenized_tokens": int(num_tokenized_tokens),
            "num_original_tokens": int(num_original_tokens),
        }
