"""Megatron's scatter/gather of stage-to-stage traffic for the interleaved 1F1B schedule (Narayanan et al. 2021,
Sec. 4.1): without sequence parallelism every TP rank of a stage holds the same activation (and the same gradient of
it: the column-parallel layers all-reduce it in backward), so each TP rank sends only its 1/t of it, flattened, to
the same TP rank of the next stage, and the receiving stage all-gathers the t pieces over its TP group. Point-to-point
bytes per TP rank drop t-fold; the all-gather runs inside the stage's own TP group (the fast intra-node links).

Megatron does this in ``p2p_communication`` (``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor``,
``scatter_gather_tensors_in_pipeline``, on unless sequence parallelism is on); DeepSpeed's 1F1B engine does the same
with ``pipeline.pipe_partitioned`` / ``grad_partitioned``. With sequence parallelism each TP rank's tensor is already
its own 1/t (its sequence chunk), so :func:`scatter_group` gives no group and everything travels whole. Tensors that
are not floating point (BERT's int64 masks) or whose size t does not divide travel whole too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from training.parallel.mappings import group_rank, group_size


def scatter_group(tp_group: dist.ProcessGroup | None, sequence_parallel: bool) -> dist.ProcessGroup | None:
    """The TP group to scatter/gather stage-to-stage tensors over: ``tp_group`` when it has more than one rank and
    the activations are alike on its ranks (no sequence parallelism), else None (send whole)."""
    return tp_group if group_size(tp_group) > 1 and not sequence_parallel else None


def splits(shape: torch.Size | list[int], dtype: torch.dtype, group: dist.ProcessGroup | None) -> bool:
    """Whether a tensor of ``shape`` and ``dtype`` travels as 1/t pieces over ``group``."""
    return group is not None and dtype.is_floating_point and torch.Size(shape).numel() % group_size(group) == 0


def piece(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """What this TP rank sends of ``t``: its 1/t of the flattened tensor where :func:`splits`, else ``t`` whole."""
    if not splits(t.shape, t.dtype, group):
        return t.contiguous()
    n = t.numel() // group_size(group)
    at = group_rank(group) * n
    return t.reshape(-1)[at:at + n].contiguous()


def receive_buffer(shape, dtype: torch.dtype, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """An empty tensor for what arrives of a tensor of ``shape``: its piece where :func:`splits`, else whole."""
    if splits(shape, dtype, group):
        return torch.empty(torch.Size(shape).numel() // group_size(group), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def whole(received: torch.Tensor, shape, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The tensor of ``shape`` from what arrived: the TP ranks' pieces all-gathered over ``group`` where
    :func:`splits` (collective over the TP group), else ``received`` itself."""
    if not splits(shape, received.dtype, group):
        return received
    pieces = [torch.empty_like(received) for _ in range(group_size(group))]
    dist.all_gather(pieces, received, group=group)
    return torch.cat(pieces).view(shape)
