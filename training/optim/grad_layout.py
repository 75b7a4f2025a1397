"""The gradients of DeepSpeed's ZeRO-0 fp16/bf16 wrappers as flat fp32 groups, and the global norm over them.

Computed once per engine (:class:`GradLayout`): each group's parameter sizes, and a 0/1 weight per parameter so
every element of the TP x PP model counts once in the norm: TP-partitioned parameters on every TP rank, replicated
ones on TP rank 0, pipeline-tied copies never (DeepSpeed's own mask, ``_require_avoid_recompute_norm`` inverted).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from training.parallel.state import ParallelState


def counted(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``p``'s gradient enters the global norm on this rank."""
    if getattr(p, "ds_pipe_replicated", False):
        return False
    tp = getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False)
    return bool(tp) or tp_rank == 0


def views_of(group: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether the parameters are still consecutive views of ``flat`` (as ``FP16_Optimizer`` made them)."""
    ptr, step = flat.data_ptr(), flat.element_size()
    for p in group:
        if p.data_ptr() != ptr or not p.is_contiguous():
            return False
        ptr += p.numel() * step
    return True


class GradLayout:
    """What the step needs to know of a wrapper's parameter groups."""

    sizes: list[list[int]]  # numel per parameter, per group
    weights: torch.Tensor  # float64 0/1 per parameter (all groups): counted in the norm on this rank or not
    group: dist.ProcessGroup | None  # the model-parallel group the norm is summed over (None: one rank)

    def __init__(self, groups: list[list[torch.Tensor]], mpu: ParallelState | None):
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

        tp_rank = bwc_tensor_model_parallel_rank(mpu) if mpu is not None else 0
        params = [p for g in groups for p in g]
        device = params[0].device if params else torch.device("cpu")
        self.sizes = [[p.numel() for p in g] for g in groups]
        self.weights = torch.tensor([1.0 if counted(p, tp_rank) else 0.0 for p in params], dtype=torch.float64,
                                    device=device)
        group = mpu.get_model_parallel_group() if mpu is not None else None
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._zeros: torch.Tensor | None = None  # stands in for a missing gradient (sliced, never written)
        # a gradient buffer's (training.optim.grad_buffer): id(group) -> the group's gradients as one of its slices
        self.spans: dict[int, torch.Tensor] = {}
        self.in_buffer = False  # the gradients are a buffer's views: kept after the step reads them

    def use_buffer(self, groups: list[list[torch.Tensor]], span_of) -> None:
        """The gradients live in a gradient buffer: read each group that is one slice of it (``span_of(group)``,
        else None) as that slice, and keep the gradients after reading them (the engine zeroes the buffer)."""
        self.spans = {id(g): span for g in groups if (span := span_of(g)) is not None}
        self.in_buffer = True

    def grad_views(self, group: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's gradient as a 1-D view (zeros for a parameter without one)."""
        out = []
        for p in group:
            if p.grad is not None:
                out.append(p.grad.reshape(-1))
                continue
            if self._zeros is None or self._zeros.numel() < p.numel() or self._zeros.dtype != p.dtype:
                self._zeros = torch.zeros(max(q.numel() for q in group), dtype=p.dtype, device=p.device)
            out.append(self._zeros[:p.numel()])
        return out

    def flat_fp32(self, group: list[torch.Tensor]) -> torch.Tensor:
        """The group's gradients, concatenated (one batched cat) and cast to fp32 (one kernel); one cast of the
        buffer's slice where the group is one (:meth:`use_buffer`). Always a new tensor: the step scales it."""
        span = self.spans.get(id(group))
        if span is not None:
            return span.clone() if span.dtype == torch.float32 else span.float()
        return torch.cat(self.grad_views(group)).float()

    def norm_sq(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squared gradient elements of the model replica (device tensor, float64), all-reduced over
        the model-parallel group; non-finite when any gradient holds an inf or NaN (0 x inf = NaN: masked
        tensors carry the overflow flag too)."""
        slices = [s for flat, sizes in zip(flats, self.sizes) for s in flat.split(sizes)]
        norms = torch._foreach_norm(slices, 2)
        total = (torch.stack(norms).double().square() * self.weights).sum()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return total
