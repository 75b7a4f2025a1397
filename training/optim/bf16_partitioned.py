"""bf16 under pipeline parallelism: the step of DeepSpeed's ``BF16_Optimizer`` with no host read.

With a pipeline, DeepSpeed 0.19 wraps a bf16 model's optimizer in ``BF16_Optimizer`` (``_do_optimizer_sanity_check``:
bf16 weights, bf16 gradient accumulation, a pipeline): bf16 weights in one flat buffer per group, high-precision
gradients accumulated in another (``fp32_groups_gradients_flat``, in the accumulation dtype), and this data-parallel
rank's partition of an fp32 master copy (``fp32_groups_flat_partition``) that the client optimizer steps, the bf16
weights all-gathered from the partitions afterwards. Its ``step`` reads the host twice: the non-finite check of the
global norm (``is_invalid_grad_norm``) and the clip decision (``clip_coef < 1`` in ``clip_tensors_by_global_norm``).

:class:`PartitionedBf16Step` takes the same step on the wrapper's own buffers with the decisions on the device, as
:class:`~training.optim.mixed_precision.MixedPrecisionStep` does for the ZeRO-0 wrappers:

1. the global norm over the gradients DeepSpeed counts (``get_grads_for_norm``: tied pipeline copies never,
   replicated parameters on TP rank 0 only), one multi-tensor norm in fp32 as DeepSpeed's per-tensor ``float()``
   norms, the squares summed in float64 and all-reduced over the model-parallel group (TP x PP) as DeepSpeed sums
   them;
2. a non-finite norm is the fused AdamW's ``found_inf`` (torch's ``GradScaler`` protocol: weights, moments and
   step count untouched, DeepSpeed's skip), counted on the device and settled when the host reads;
3. DeepSpeed's clip, ``min(1, clip / (norm + 1e-6))``, as one device scalar multiplying this rank's gradient
   partitions (DeepSpeed multiplies them only when the factor is below 1; a factor of exactly 1 changes nothing);
4. the client optimizer's step on the partitions, then the wrapper's own ``update_lp_params`` (bf16 partitions
   copied and all-gathered over data parallelism) and ``clear_hp_grads``.

What is left to DeepSpeed: everything around the step (its gradient accumulation hooks, the data-parallel reduction
of the pipeline schedule, checkpoints of the wrapper's state). Not covered (DeepSpeed's own step runs): MoE layers,
Muon, and a client optimizer other than torch's fused Adam/AdamW (no ``found_inf``); :meth:`create` says which.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from training.optim.outcome import StepOutcome


class PartitionedBf16Step:
    """The optimizer step over one ``BF16_Optimizer`` (created by :meth:`create`); returns a device-decided
    :class:`~training.optim.outcome.StepOutcome`. The skip counters live here, not on the wrapper."""

    reads_on_host = False  # the step reads nothing: no host read for a log step's metrics to ride on
    loss_scale = 1.0

    def __init__(self, wrapper: BF16_Optimizer):
        self.wrapper = wrapper
        self.clip = float(wrapper.clip_grad)
        mp = wrapper.mpu.get_model_parallel_group() if wrapper.mpu is not None else None
        self.group = mp if mp is not None and dist.get_world_size(mp) > 1 else None
        device = wrapper.fp32_groups_flat_partition[0].device
        self.skipped = torch.zeros((), device=device)  # steps skipped since the last settle
        self.consecutive = torch.zeros((), device=device)  # skipped in a row up to the latest step
        self.worst = torch.zeros((), device=device)  # the longest such run since the last settle

    @classmethod
    def create(cls, wrapper) -> PartitionedBf16Step | None:
        """The step for ``wrapper``, or None where DeepSpeed's own step stays: another wrapper, MoE layers, Muon, a
        client optimizer without ``found_inf`` (torch's fused Adam/AdamW has it), or a wrapper without parameters."""
        if not isinstance(wrapper, BF16_Optimizer) or not wrapper.using_real_optimizer:
            return None
        if wrapper.has_moe_layers or getattr(wrapper, "_uses_muon", False) or not wrapper.fp32_groups_flat_partition:
            return None
        inner = wrapper.optimizer
        if not (isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups)):
            return None
        return cls(wrapper)

    def settle(self) -> None:
        """The host has read the device-side skip counters: start counting again."""
        self.worst.zero_()
        self.skipped.zero_()

    def global_norm(self) -> torch.Tensor:
        """The gradient norm of the model replica (a device float64 scalar; non-finite when any counted gradient
        holds an inf or NaN)."""
        grads, _ = self.wrapper.get_grads_for_norm()
        device = self.skipped.device
        if grads:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            total = torch.stack(norms).double().square().sum()
        else:  # a stage whose every gradient is a tied copy or absent: it adds nothing to the sum
            total = torch.zeros((), dtype=torch.float64, device=device)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return total.sqrt()

    def step(self) -> StepOutcome:
        """Check, clip and apply (or skip) the update; the wrapper's high-precision gradients are consumed."""
        w = self.wrapper
        norm = self.global_norm()
        found = (~torch.isfinite(norm)).float()
        w.optimizer.found_inf = found
        self.skipped.add_(found)
        self.consecutive.add_(1).mul_(found)  # reset to 0 by an applied step
        torch.maximum(self.worst, self.consecutive, out=self.worst)
        partitions = w.fp32_groups_gradient_flat_partition
        if self.clip > 0.0:
            factor = (self.clip / (norm.float() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(partitions, factor)
        for master, grad in zip(w.fp32_groups_flat_partition, partitions):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        w.optimizer.step()
        for master in w.fp32_groups_flat_partition:
            master.grad = None
        w._lazy_init_hp_params_optimizer_state()  # DeepSpeed links its hp params to the state after a first step
        w.update_lp_params()
        w.clear_hp_grads()
        return StepOutcome(applied=1 - found, grad_norm=norm, loss_scale=1.0, pending_skips=self.skipped,
                           longest_skip_run=self.worst)
