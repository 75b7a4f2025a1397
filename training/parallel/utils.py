"""Small helpers shared by the tensor-parallel layers: divisibility, vocab ranges, parameter tags."""
from __future__ import annotations

import torch


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def vocab_range(global_vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, end) of a vocabulary of ``global_vocab`` owned by ``rank`` of ``world``."""
    per = divide(global_vocab, world)
    return rank * per, (rank + 1) * per


def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    """Tag a TP-partitioned parameter so DeepSpeed's grad-norm/overflow checks count each element once.

    DeepSpeed (``is_model_parallel_parameter``) reads ``model_parallel`` or ``tensor_model_parallel``;
    ``partition_dim``/``partition_stride`` tell merge/reshard tools how the shards concatenate.
    Replicated parameters stay untagged and are counted on TP rank 0 only.
    """
    param.model_parallel = True
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))
