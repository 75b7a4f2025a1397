"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Constructors take GLOBAL (unsharded) sizes plus the TP process group; local sizes are derived from
the group. Weights are initialised as a full fp32 *master* weight on CPU by ``init_method`` and then
sliced, so with the same seed a TP=k layer is exactly the TP=1 layer split k ways (Megatron's CPU
master init). At TP=1 each layer computes exactly what ``nn.Linear`` / ``nn.Embedding`` compute.

The forward functions are plain functions (``column_parallel_linear`` ...); the modules only own
parameters and call them.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.parallel.mappings import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    group_rank,
    group_size,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)
from training.parallel.sharding import shard
from training.parallel.utils import divide, set_tensor_parallel_attributes, vocab_range

InitMethod = Callable[[torch.Tensor], None]  # fills a full master weight in place




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
                           group: dist.ProcessGroup | None, gather_output: bool = False) -> torch.Tensor:
    """Y = X A + b with A = [A_1 ... A_p] split by output columns.

    x [..., in] (replicated) -> f -> Y_i = X A_i + b_i [..., out/p] -> optional all-gather [..., out].
    """
    x = copy_to_parallel_region(x, group)
    y = F.linear(x, weight, bias)
    return gather_from_parallel_region(y, group) if gather_output else y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group: dist.ProcessGroup | None, input_is_parallel: bool = True) -> torch.Tensor:
    """Y = X A + b with A split by input rows, X split on its last dim.

    x [..., in/p] -> X_i A_i [..., out] -> g (all-reduce) -> + b (full bias, added once).
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)  # serial: the bias folds into the GEMM (addmm), as nn.Linear
    if not input_is_parallel:
        x = scatter_to_parallel_region(x, group)
    y = reduce_from_parallel_region(F.linear(x, weight), group)
    return y if bias is None else y + bias


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                             vocab_start: int, vocab_end: int) -> torch.Tensor:
    """Look up ids in this rank's rows [vocab_start, vocab_end); foreign ids give zeros; g sums."""
    if group_size(group) == 1:
        return F.embedding(ids, weight)
    foreign = (ids < vocab_start) | (ids >= vocab_end)
    local = (ids - vocab_start).masked_fill(foreign, 0)
    out = F.embedding(local, weight)
    # Zeroing also blocks gradient from foreign ids into local row 0.
    out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
    return reduce_from_parallel_region(out, group)


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Linear layer with the weight split by output features: local weight [out/p, in]."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None, stride: int = 1):
        super().__init__()
        self.group, self.gather_output = group, gather_output
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
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.gather_output)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_partition}), "
                f"tp_rank={self.tp_rank}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Linear layer with the weight split by input features: local weight [out, in/p]; bias replicated."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod | None = None):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, world = group_rank(group), group_size(group)
        self.in_per_partition = divide(in_features, world)
        master = _master_weight((out_features, in_features), init_method)
        self.weight = nn.Parameter(shard(master, 1, self.tp_rank, world))
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        # The bias is added once after the all-reduce: replicated, untagged.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_partition}), out={self.out_features}, "
                f"tp_rank={self.tp_rank}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across TP ranks: local weight [V/p, h]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None = None,
                 init_method: InitMethod | None = None):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, world = group_rank(group), group_size(group)
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp_rank, world)
        master = _master_weight((num_embeddings, embedding_dim), init_method)
        self.weight = nn.Parameter(shard(master, 0, self.tp_rank, world))
        set_tensor_parallel_attributes(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.group, self.vocab_start, self.vocab_end)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp_rank={self.tp_rank}")
