"""LAMBADA accuracy and target-word perplexity (an `evaluate` module).

Inputs, one row per example:
    correct          int    1 when every target token is the greedy argmax under teacher forcing
    target_logprob   float  Σ natural-log probability of the target's tokens
    target_tokens    int    number of target tokens
Output:
    accuracy   = Σ correct / count                        (Megatron: correct / 5,153)
    perplexity = exp(-mean_examples target_logprob)       (per-example word perplexity, as lm-eval's
                                                            lambada_openai `perplexity`)
    token_perplexity = exp(-Σ target_logprob / Σ target_tokens)
"""
import math

import datasets
import evaluate

_CITATION = """@inproceedings{paperno2016lambada, title={The LAMBADA dataset: Word prediction requiring a broad
discourse context}, author={Paperno, Denis and others}, booktitle={ACL}, year={2016}}"""


class LambadaAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=__doc__,
            features=datasets.Features({
                "correct": datasets.Value("int64"),
                "target_logprob": datasets.Value("float64"),
                "target_tokens": datasets.Value("int64"),
            }),
        )

    def _compute(self, correct, target_logprob, target_tokens):
        n = len(correct)
        if n == 0:
            raise ValueError("lambada_accuracy needs at least one example")
        lp = math.fsum(target_logprob)
        return {
            "accuracy": sum(int(c) for c in correct) / n,
            "correct": int(sum(int(c) for c in correct)),
            "count": n,
            "perplexity": math.exp(-lp / n),
            "token_perplexity": math.exp(-lp / max(1, int(sum(target_tokens)))),
        }
