"""RACE accuracy from any multiple-choice scorer (Megatron ``tasks/eval_utils.py``).

``score_fn(batch) -> logits [n, 4]`` receives :func:`megatron_ds_suite.core.race.collate` batches
(``text``, ``types``, ``padding_mask`` int64 [n, 4, L]); prediction = argmax of the 4 logits;
accuracy = correct / total per level (middle, high) and overall, through the local
``race_accuracy`` metric.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from evaluation.metrics import load_metric
from megatron_ds_suite.core.race import NUM_CHOICES, collate

ScoreFn = Callable[[dict], torch.Tensor]


@torch.no_grad()
def race_predictions(samples: Sequence[dict], score_fn: ScoreFn, batch_size: int = 4, progress: bool = True) -> list[int]:
    preds: list[int] = []
    for b in tqdm(range(0, len(samples), batch_size), desc="race", unit="batch", disable=not progress):
        batch = collate(samples[b : b + batch_size])
        logits = score_fn(batch)
        if tuple(logits.shape) != (len(batch["label"]), NUM_CHOICES):
            raise ValueError(f"score_fn returned logits of shape {tuple(logits.shape)}, expected ({len(batch['label'])}, {NUM_CHOICES})")
        preds.extend(int(i) for i in logits.float().argmax(dim=-1).tolist())
    return preds


def race_accuracy(samples: Sequence[dict], score_fn: ScoreFn, batch_size: int = 4, progress: bool = True) -> dict:
    """Accuracy overall and per level (``middle/accuracy``, ``high/accuracy`` ...)."""
    preds = race_predictions(samples, score_fn, batch_size, progress)
    metric = load_metric("race_accuracy")
    return metric.compute(predictions=preds, references=[int(s["label"]) for s in samples],
                          groups=[str(s["level"]) for s in samples])
