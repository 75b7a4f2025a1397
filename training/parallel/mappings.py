"""The four tensor-parallel region maps as autograd Functions (Megatron's f/g pair and scatter/gather).

| function                   | forward                     | backward                    | paper |
|----------------------------|-----------------------------|-----------------------------|-------|
| copy_to_parallel_region    | identity                    | all-reduce (sum)            | f     |
| reduce_from_parallel_region| all-reduce (sum)            | identity                    | g     |
| scatter_to_parallel_region | split last dim, keep own    | all-gather last dim         |       |
| gather_from_parallel_region| all-gather last dim         | split last dim, keep own    |       |

Sequence parallelism (Korthikanti et al. 2022) adds three maps on the **sequence** dim, dim 1 of the models'
[b, s, h] activations (Megatron works in [s, b, h] and splits dim 0; the collectives are the same):

| function                                   | forward                      | backward                     | paper |
|--------------------------------------------|------------------------------|------------------------------|-------|
| scatter_to_sequence_parallel_region        | split seq dim, keep own      | all-gather seq dim           |       |
| gather_from_sequence_parallel_region       | all-gather seq dim           | reduce-scatter seq dim       | g     |
| ... (``grad_is_partial=False``)            | all-gather seq dim           | split seq dim, keep own      |       |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter seq dim       | all-gather seq dim           | g-bar |

g replaces f before a column-parallel linear and g-bar replaces g after a row-parallel one: an all-reduce is
a reduce-scatter followed by an all-gather, so the pair moves the same bytes as the all-reduce it replaces.

Each backward is its forward's dual. With ``group`` None or of size 1 every map is the identity and
no collective is issued. Module-level counters record every collective run eagerly (calls, and payload
bytes: the bytes of the tensor each rank hands in) so tests can assert the number of all-reduces per layer
and benchmarks can compare traffic with the design (benchmarks/bench_tp_overhead.py); compiled code
(``model.compile``) skips the counting, which would otherwise break its graph.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

#: collective name -> number of calls (tests reset and read it; costs one dict update per collective)
COLLECTIVE_CALLS: Counter[str] = Counter()
#: collective name -> payload bytes handed in by this rank (a ring all-reduce of P bytes over p ranks
#: sends 2 (p-1)/p P bytes per rank; an all-gather of P bytes per rank sends (p-1) P)
COLLECTIVE_BYTES: Counter[str] = Counter()


def _count(name: str, x: torch.Tensor) -> None:
    """Record one collective in the counters, in eager mode only: under ``torch.compile`` a Python side effect
    inside these autograd Functions would break the graph (compiled code is counted by its tests' eager twin)."""
    if torch.compiler.is_compiling():
        return
    COLLECTIVE_CALLS[name] += 1
    COLLECTIVE_BYTES[name] += x.numel() * x.element_size()


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``x`` (counted)."""
    if group_size(group) == 1:
        return x
    _count("all_reduce", x)
    dist.all_reduce(x, op=op, group=group)
    return x


def _split_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.size(-1) % world:
        raise ValueError(f"last dim {x.size(-1)} not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    _count("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


SEQ_DIM = 1
"""The sequence dim of the models' activations [b, s, h]."""


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (positions [r s/p, (r+1) s/p)); no communication."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"sequence length {x.size(dim)} not divisible by tensor-parallel size {world} "
                         f"(parallel.sequence_parallel splits the sequence across the TP ranks)")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = SEQ_DIM) -> torch.Tensor:
    """All-gather ``dim``: [.., s/p, ..] on every rank -> [.., s, ..] (rank order); counted, no autograd."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    _count("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sum over the ranks, keep this rank's chunk of ``dim``: [.., s, ..] -> [.., s/p, ..]; counted, no autograd."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world:
        raise ValueError(f"sequence length {x.size(dim)} not divisible by tensor-parallel size {world}")
    _count("reduce_scatter", x)
    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _CopyToParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """g: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_sequence(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g: forward all-gather of the sequence, backward reduce-scatter (or split, for a whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, grad_is_partial: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.grad_is_partial:
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return split_sequence(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g-bar: forward reduce-scatter of the sequence, backward all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(grad, ctx.group), None


def copy_to_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f: identity forward, all-reduce backward (enter a tensor-parallel region)."""
    return x if group_size(group) == 1 else _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g: all-reduce forward, identity backward (leave a tensor-parallel region)."""
    return x if group_size(group) == 1 else _ReduceFromParallelRegion.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split the last dim, keep this rank's chunk; all-gather in backward."""
    return x if group_size(group) == 1 else _ScatterToParallelRegion.apply(x, group)


def gather_from_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim; split in backward."""
    return x if group_size(group) == 1 else _GatherFromParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                        dim: int = SEQ_DIM) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dim (``dim``); all-gather in backward. For a tensor every TP rank
    holds whole and alike (e.g. the position embeddings of all s positions): each rank's gradient is then the
    full one."""
    return x if group_size(group) == 1 else _ScatterToSequenceParallelRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                         grad_is_partial: bool = True) -> torch.Tensor:
    """g: all-gather the sequence [b, s/p, h] -> [b, s, h]; reduce-scatter in backward (enter a TP region whose
    ranks each produce a partial gradient of the whole sequence). ``grad_is_partial=False``: the consumer is
    replicated (every rank computes the same whole gradient, e.g. BERT's heads), so backward keeps this rank's
    chunk of it (Megatron's ``tensor_parallel_output_grad=False``)."""
    return x if group_size(group) == 1 else _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g-bar: reduce-scatter partial sums [b, s, h] -> this rank's [b, s/p, h] of the sum; all-gather in backward
    (leave a TP region)."""
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)
