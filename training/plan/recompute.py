"""Which activation recomputation a run needs: none where everything fits, full only where it must.

``model.activation_checkpointing: auto`` is resolved here when the trainer starts (and shown by
``python -m training.plan``): the planner's per-device memory of the most loaded stage
(:func:`training.plan.memory.memory`: weights, gradients, optimizer states, activations, with ZeRO-1 when the
run uses it) without recomputation against ``HEADROOM`` of the device's memory. It fits: no recomputation
(full recompute costs a third more FLOPs per step and DeepSpeed's checkpoint bookkeeping: on one H200 the
1.2B model ran at 38.7 % MFU without and 25.0 % with it, benchmarks/RESULTS.md). It does not: full
recomputation (Megatron's ``--checkpoint-activations``), also when that does not fit either (the
run then fails the way it would have with ``true``; the one-line reason says so).
"""
from __future__ import annotations

from dataclasses import dataclass

from training.plan.accounting import ModelShape
from training.plan.layout import Layout
from training.plan.memory import GIB, memory

#: the share of a device's memory a plan may fill (the rest: the allocator's fragmentation, the CUDA
#: context, NCCL buffers, the transient fp32 gradient copy of the optimizer step)
HEADROOM = 0.9


@dataclass(frozen=True)
class RecomputeChoice:
    recompute: bool
    """True: recompute every layer in backward (full activation checkpointing)."""
    gib_without: float
    gib_with: float
    device_gib: float

    def describe(self) -> str:
        budget = HEADROOM * self.device_gib
        if not self.recompute:
            return (f"no recomputation: {self.gib_without:.1f} GiB per device without it fits {budget:.1f} GiB "
                    f"({HEADROOM:.0%} of {self.device_gib:.1f})")
        fits = "fits" if self.gib_with <= budget else "does not fit either: lower train.micro_batch_size or raise TP/PP"
        return (f"full recomputation: {self.gib_without:.1f} GiB per device without it exceeds {budget:.1f} GiB "
                f"({HEADROOM:.0%} of {self.device_gib:.1f}); with it {self.gib_with:.1f} GiB {fits}")


def choose_recompute(shape: ModelShape, lay: Layout, dtype: str, device_gib: float, zero1: bool = False,
                     scores_stored: bool = True, cpu: bool = False) -> RecomputeChoice:
    """None when the run fits ``HEADROOM`` of ``device_gib`` without recomputation, else full."""
    mem = memory(shape, lay, dtype, scores_stored, cpu=cpu)
    without, with_ = mem.total(zero1, False) / GIB, mem.total(zero1, True) / GIB
    return RecomputeChoice(recompute=without > HEADROOM * device_gib, gib_without=without, gib_with=with_,
                           device_gib=device_gib)


def resolve(cfg, dp: int, dtype: str, device_gib: float, on_gpu: bool) -> RecomputeChoice | None:
    """For a run config whose ``model.activation_checkpointing`` is ``auto``: the choice for ``device_gib`` per
    device (None for true/false). GPT-2 and BERT on a GPU keep no attention scores (SDPA's fused kernels),
    unless Megatron's fp16 attention stabilisers are on; the CPU paths keep them."""
    m = cfg.model
    if m.activation_checkpointing != "auto":
        return None
    shape = ModelShape.from_config(m, cfg.parallel.tensor, cfg.bert)
    lay = Layout(tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, dp=dp, micro_batch=cfg.train.micro_batch_size,
                 global_batch=cfg.train.global_batch_size, sequence_parallel=cfg.parallel.sequence_parallel)
    scores_stored = not on_gpu or m.apply_query_key_layer_scaling or m.attention_softmax_in_fp32
    return choose_recompute(shape, lay, dtype, device_gib, zero1=cfg.parallel.zero_stage >= 1,
                            scores_stored=scores_stored, cpu=not on_gpu)
