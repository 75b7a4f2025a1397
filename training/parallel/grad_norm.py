"""Global gradient norm over a TP x PP model replica, each element counted once, and clipping.

Counted: tensor-parallel (tagged) parameters on every TP rank, replicated ones on TP rank 0 only,
pipeline-tied copies (``ds_pipe_replicated``) never; squares summed over the TP group and then the
PP group. DP replicas hold identical (all-reduced) gradients, so nothing is summed over DP.

DeepSpeed's fp32 path (``engine.clip_fp32_gradients`` -> ``runtime.utils.clip_grad_norm_``) discards
the norm, and under its PipelineEngine it counts replicated parameters only on the first stage's
first rank (the grid's pipe x model rank); the trainer installs this function in its place.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from training.parallel.utils import is_tensor_parallel


def _empty_device(groups: tuple[dist.ProcessGroup | None, ...]) -> torch.device:
    """Where a rank without parameters keeps its (zero) partial sum: the device its collectives use
    (the current CUDA device under NCCL, the host under gloo or without groups)."""
    for group in groups:
        if group is not None and dist.get_backend(group) == dist.Backend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def grad_norm(params: Iterable[torch.Tensor], tp_rank: int, tp_group: dist.ProcessGroup | None = None,
              pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """sqrt of the summed squares (float64), on the parameters' device: it is all-reduced (NCCL on GPU).
    One multi-tensor norm (float64 accumulation) over the counted gradients, not a kernel chain per tensor."""
    params = list(params)
    device = params[0].device if params else _empty_device((tp_group, pp_group))
    grads = [p.grad.detach() for p in params
             if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
             and (is_tensor_parallel(p) or tp_rank == 0)]
    if grads:
        total = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
    for group in (tp_group, pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, tp_rank: int,
                   tp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0 = no clipping); returns the norm
    before clipping as a device tensor. No host read: the factor min(1, max_norm / (norm + 1e-6)) is applied
    on the device to every gradient in one multi-tensor multiply (x 1.0 leaves a gradient bitwise as is)."""
    params = list(params)
    norm = grad_norm(params, tp_rank, tp_group, pp_group)
    if max_norm > 0:
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if grads:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
