"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Constructors take GLOBAL (unsharded) sizes plus the TP process group; local sizes are derived from
the group. Weights are initialised as a full fp32 *master* weight on CPU by ``init_method`` and then
sliced, so with the same seed a TP=k layer is exactly the TP=1 layer split k ways (Megatron's CPU
master init). At TP=1 each layer computes exactly what ``nn.Linear`` / ``nn.Embedding`` compute.

The forward functions are plain functions (``column_parallel_linear`` ...); the modules only own
parameters and call them.

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al. 2022): activations outside the TP regions
are split along the sequence, x_shard [b, s/p, h]. A column-parallel linear then all-gathers its input (g)
instead of entering through f, keeping only x_shard for backward and gathering it again there (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``: the full input is never stored); a row-parallel linear and
the vocab-parallel embedding reduce-scatter their partial sums (g-bar) instead of all-reducing them. A
parameter that acts on the sequence shard while replicated across TP (the row-parallel bias here, the norms in
the models) sees only its shard's tokens: :func:`mark_sequence_parallel` all-reduces its gradient over TP.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.parallel.mappings import (
    all_reduce,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)
from training.parallel.sharding import shard
from training.parallel.utils import divide, set_tensor_parallel_attributes, vocab_range

InitMethod = Callable[[torch.Tensor], None]  # fills a full master weight in place


def _all_reduce_grad(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_reduce(grad.clone(), group)


def mark_sequence_parallel(param: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Tag a TP-replicated parameter used on the sequence shard (``param.sequence_parallel``, Megatron's name) and
    all-reduce its gradient over ``group`` in the backward pass, before it accumulates into ``.grad``.

    Its gradient on one rank is a sum over that rank's s/p tokens; the sum over the TP ranks is the gradient
    of the whole sequence, the one every rank has without sequence parallelism. The all-reduce runs in the grad
    path (a tensor hook, one small collective per parameter and micro-batch) rather than as a separate pass
    before the optimizer step, so every engine path sees complete gradients: DeepSpeed's fp16/bf16 wrappers and
    our optimizer step, fp32 clipping, the pipeline engine, ZeRO-1 and activation checkpointing. Idempotent."""
    if group_size(group) == 1 or getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True
    param.register_hook(functools.partial(_all_reduce_grad, group=group))


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Y_i = gather(X_shard) A_i^T + b_i; backward: dX_shard = reduce-scatter(dY_i A_i), dA_i = dY_i^T X with X
    gathered again (only X_shard [b, s/p, in] is saved, as Megatron does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, group), weight, bias)         # [b, s, out/p]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_sequence(grad.matmul(weight), ctx.group)  # [b, s, in] partial -> [b, s/p, in]
        flat = grad.reshape(-1, grad.size(-1))                             # [b s, out/p]
        if ctx.needs_input_grad[1]:
            total = gather_sequence(x, ctx.group)                          # [b, s, in] again
            grad_w = flat.t().matmul(total.reshape(-1, total.size(-1)))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b, None



def _master_weight(shape: tuple[int, ...], init_method: InitMethod | None) -> torch.Tensor:
    w = torch.empty(shape, dtype=torch.get_default_dtype())
    if init_method is None:
        nn.init.zeros_(w)
    else:
        init_method(w)
    return w


# --------------------------------------------------------------------------------------------------
# Functional forms
# --------------------------------------------------------------------------------------------------
def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: dist.ProcessGroup | None, gather_output: bool = False,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """Y = X A + b with A = [A_1 ... A_p] split by output columns.

    x [..., in] (replicated) -> f -> Y_i = X A_i + b_i [..., out/p] -> optional all-gather [..., out].
    ``sequence_parallel``: x [b, s/p, in] (this rank's sequence chunk) -> g -> Y_i [b, s, out/p].
    """
    if sequence_parallel and group_size(group) > 1:
        y = _SequenceParallelColumnLinear.apply(x, weight, bias, group)
        return gather_from_parallel_region(y, group) if gather_output else y
    x = copy_to_parallel_region(x, group)
    y = F.linear(x, weight, bias)
    return gather_from_parallel_region(y, group) if gather_output else y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group: dist.ProcessGroup | None, input_is_parallel: bool = True,
                        sequence_parallel: bool = False) -> torch.Tensor:
    """Y = X A + b with A split by input rows, X split on its last dim.

    x [..., in/p] -> X_i A_i [..., out] -> g (all-reduce) -> + b (full bias, added once).
    ``sequence_parallel``: x [b, s, in/p] -> X_i A_i -> g-bar (reduce-scatter) -> [b, s/p, out] + b (the bias
    then sees this rank's tokens only: :class:`RowParallelLinear` marks it :func:`mark_sequence_parallel`).
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)  # serial: the bias folds into the GEMM (addmm), as nn.Linear
    if not input_is_parallel:
        x = scatter_to_parallel_region(x, group)
    reduce = reduce_scatter_to_sequence_parallel_region if sequence_parallel else reduce_from_parallel_region
    y = reduce(F.linear(x, weight), group)
    return y if bias is None else y + bias


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                             vocab_start: int, vocab_end: int, sequence_parallel: bool = False) -> torch.Tensor:
    """Look up ids in this rank's rows [vocab_start, vocab_end); foreign ids give zeros; g sums.

    ``sequence_parallel``: ids [b, s] -> this rank's sequence chunk [b, s/p, h] of the sum (g-bar, reduce-scatter)."""
    if group_size(group) == 1:
        return F.embedding(ids, weight)
    foreign = (ids < vocab_start) | (ids >= vocab_end)
    local = (ids - vocab_start).masked_fill(foreign, 0)
    out = F.embedding(local, weight)
    # Zeroing also blocks gradient from foreign ids into local row 0.
    out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(out, group)
    return reduce_from_parallel_region(out, group)


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Linear layer with the weight split by output features: local weight [out/p, in]."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None, stride: int = 1,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, world = group_rank(group), group_size(group)
        self.out_per_partition = divide(out_features, world)
        master = _master_weight((out_features, in_features), init_method)
        self.weight = nn.Parameter(shard(master, 0, self.tp_rank, world, stride))
        set_tensor_parallel_attributes(self.weight, partition_dim=0, stride=stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_partition))
            set_tensor_parallel_attributes(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.gather_output,
                                      self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_partition}), "
                f"tp_rank={self.tp_rank}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Linear layer with the weight split by input features: local weight [out, in/p]; bias replicated."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, world = group_rank(group), group_size(group)
        self.in_per_partition = divide(in_features, world)
        master = _master_weight((out_features, in_features), init_method)
        self.weight = nn.Parameter(shard(master, 1, self.tp_rank, world))
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        # The bias is added once after the all-reduce: replicated, untagged.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias, group)  # added on the sequence shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel,
                                   self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_partition}), out={self.out_features}, "
                f"tp_rank={self.tp_rank}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across TP ranks: local weight [V/p, h]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None = None,
                 init_method: InitMethod | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, world = group_rank(group), group_size(group)
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp_rank, world)
        master = _master_weight((num_embeddings, embedding_dim), init_method)
        self.weight = nn.Parameter(shard(master, 0, self.tp_rank, world))
        set_tensor_parallel_attributes(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.group, self.vocab_start, self.vocab_end,
                                        self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp_rank={self.tp_rank}")
