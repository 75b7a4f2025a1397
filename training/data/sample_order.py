"""Megatron's sample order, shared by every task (GPT-2, BERT, RACE).

For the optimizer step that starts at ``consumed_samples``, micro-batch m of DP rank d holds the samples
at positions ``consumed_samples + m*(mb*dp) + d*mb + [0, mb)`` of the task's (shuffled) sample sequence.
All TP (and PP) ranks of a DP replica read the same positions; resuming from ``consumed_samples``
continues the same order.
"""
from __future__ import annotations

from training.layout import grad_accumulation


def micro_batch_positions(consumed_samples: int, micro_batch: int, dp_size: int, dp_rank: int,
                          global_batch: int) -> list[range]:
    """The sample positions of this DP rank's micro-batches (``gas`` ranges of ``micro_batch``)."""
    gas = grad_accumulation(global_batch, micro_batch, dp_size)
    out = []
    for m in range(gas):
        start = consumed_samples + m * micro_batch * dp_size + dp_rank * micro_batch
        out.append(range(start, start + micro_batch))
    return out
