"""Which activation recomputation a run needs: none where everything fits, selective or full only where needed.

``model.recompute: auto`` is resolved here when the trainer starts (and shown by
``python -m training.plan``): the planner's per-device memory of the most loaded stage
(:func:`training.plan.memory.memory`: weights, gradients, optimizer states, activations, with ZeRO-1 when the
run uses it) without recomputation against ``HEADROOM`` of the device's memory. It fits: no recomputation
(full recompute costs a third more FLOPs per step and DeepSpeed's checkpoint bookkeeping: on one H200 the
1.2B model ran at 38.7 % MFU without and 25.0 % with it, benchmarks/RESULTS.md). It does not: selective
recomputation of the attention core where the core keeps its s x s matrices (``scores_stored``) and that fits
(a few % more FLOPs: :func:`training.plan.accounting.step_flops`); else full recomputation (Megatron's
``--checkpoint-activations``), also when that does not fit either (the run then fails the way it would have
with ``full``; the one-line reason says so). With fused attention (no scores kept) selective saves nothing
and is never chosen.
"""
from __future__ import annotations

from dataclasses import dataclass

from training.layout import Layout, runs_dualpipev, virtual_chunks
from training.plan.accounting import ModelShape
from training.plan.memory import GIB, memory

#: the share of a device's memory a plan may fill (the rest: the allocator's fragmentation, the CUDA
#: context, NCCL buffers, the transient fp32 gradient copy of the optimizer step)
HEADROOM = 0.9


@dataclass(frozen=True)
class RecomputeChoice:
    recompute: str
    """``model.recompute`` chosen: 'none', 'selective' (the attention core) or 'full' (every layer)."""
    gib_without: float
    gib_with: float
    """GiB per device with full recomputation."""
    device_gib: float
    gib_selective: float | None = None
    """GiB per device with selective recomputation (None: the attention core keeps no scores, nothing to save)."""

    def describe(self) -> str:
        budget = HEADROOM * self.device_gib
        if self.recompute == "none":
            return (f"no recomputation: {self.gib_without:.1f} GiB per device without it fits {budget:.1f} GiB "
                    f"({HEADROOM:.0%} of {self.device_gib:.1f})")
        over = (f"{self.gib_without:.1f} GiB per device without it exceeds {budget:.1f} GiB "
                f"({HEADROOM:.0%} of {self.device_gib:.1f})")
        if self.recompute == "selective":
            return f"selective recomputation (attention core): {over}; with it {self.gib_selective:.1f} GiB fits"
        fits = "fits" if self.gib_with <= budget else "does not fit either: lower train.micro_batch_size or raise TP/PP"
        sel = "" if self.gib_selective is None else f", with selective {self.gib_selective:.1f} GiB"
        return f"full recomputation: {over}{sel}; with it {self.gib_with:.1f} GiB {fits}"


def choose_recompute(shape: ModelShape, lay: Layout, dtype: str, device_gib: float, zero1: bool = False,
                     scores_stored: bool = True, cpu: bool = False, zero_stage: int = 0,
                     offload: bool = False) -> RecomputeChoice:
    """None when the run fits ``HEADROOM`` of ``device_gib`` without recomputation, else selective when the
    attention core keeps its scores (``scores_stored``) and that fits, else full. The model state is the ZeRO
    paper's at ``zero_stage`` (at least 1 with ``zero1``), the optimizer part off the device with ``offload``."""
    stage = max(zero_stage, 1 if zero1 else 0)
    mem = memory(shape, lay, dtype, scores_stored, cpu=cpu, zero_stage=stage, offload=offload)
    budget = HEADROOM * device_gib
    without, with_ = mem.total_at_stage("none") / GIB, mem.total_at_stage("full") / GIB
    selective = mem.total_at_stage("selective") / GIB if scores_stored else None
    if without <= budget:
        mode = "none"
    elif selective is not None and selective <= budget:
        mode = "selective"
    else:
        mode = "full"
    return RecomputeChoice(recompute=mode, gib_without=without, gib_with=with_, device_gib=device_gib,
                           gib_selective=selective)


def resolve(cfg, dp: int, dtype: str, device_gib: float, on_gpu: bool) -> RecomputeChoice | None:
    """For a run config whose ``model.recompute`` is ``auto``: the choice for ``device_gib`` per device (None
    otherwise). GPT-2 and BERT on a GPU keep no attention scores (SDPA's fused kernels), unless Megatron's fp16
    attention stabilisers are on; the CPU paths keep them."""
    m = cfg.model
    if m.recompute != "auto":
        return None
    shape = ModelShape.from_config(m, cfg.parallel.tensor, cfg.bert)
    lay = Layout(tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, dp=dp, micro_batch=cfg.train.micro_batch_size,
                 global_batch=cfg.train.global_batch_size, sequence_parallel=cfg.parallel.sequence_parallel,
                 virtual_pipeline=virtual_chunks(cfg), dualpipev=runs_dualpipev(cfg),
                 context=cfg.parallel.context, context_impl=cfg.parallel.context_impl)
    scores_stored = not on_gpu or m.apply_query_key_layer_scaling or m.attention_softmax_in_fp32
    return choose_recompute(shape, lay, dtype, device_gib, zero_stage=cfg.parallel.zero_stage,
                            offload=cfg.parallel.offload_optimizer != "none", scores_stored=scores_stored,
                            cpu=not on_gpu)
