"""Splitting full tensors into tensor-parallel shards and back, and re-cutting the vocabulary padding.

The one place that knows how a TP-partitioned tensor is laid out across ranks; the layers (master
weight -> this rank's shard), checkpoint merging, ``training/tools/reshard.py``, the Hugging Face import
and export, and the evaluation loader all go through it.

Layout. A tensor partitioned along ``dim`` with stride ``s`` over ``p`` ranks is cut into ``s * p``
equal pieces along ``dim``; rank ``r`` holds pieces ``r, r + p, ..., r + (s-1) p`` concatenated. With
``s = 1`` that is the plain block split ``A = [A_0 ... A_{p-1}]``; the fused QKV weight uses ``s = 3``,
so rank ``r`` holds ``[Q_r; K_r; V_r]`` (whole heads of each). Merging interleaves the shards'
pieces back: ``full = cat_k cat_r pieces[r][k]``. A parameter's ``(partition_dim, stride)`` pair is its
*partition tag* (``training.parallel.utils.set_tensor_parallel_attributes``); replicated parameters
have none (``None``) and are the same on every rank.

Vocabulary. The word embedding (and BERT's LM-head bias) has one row per *padded* vocabulary entry:
the real vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by x TP``. The padding
rows are never targets, so moving between layouts (or to and from Hugging Face, which has none) trims
or zero-pads them: :func:`resize_vocab_rows`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from training.parallel.utils import divide

PartitionTag = tuple[int, int]
"""(partition_dim, stride) of a tensor-parallel parameter; ``None`` in its place means replicated."""


def shard(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a new contiguous tensor); with stride s the dim
    is cut into s*world pieces and the rank keeps pieces rank, rank+world, ... (e.g. Q_r, K_r, V_r of a
    fused QKV). ``full.size(dim)`` must be divisible by ``world * stride``."""
    per_partition = divide(full.size(dim), world)
    per_stride = divide(per_partition, stride)
    pieces = torch.split(full, per_stride, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim).contiguous()


def merge_shards(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order: the inverse of :func:`shard`."""
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim)


def shard_tagged(full: torch.Tensor, tag: PartitionTag | None, rank: int, world: int) -> torch.Tensor:
    """:func:`shard` by a partition tag; a replicated tensor (``tag`` None) or ``world`` 1 is returned as is."""
    if tag is None or world == 1:
        return full
    return shard(full, tag[0], rank, world, tag[1])


def merge_tagged(shards: Sequence[torch.Tensor], tag: PartitionTag | None) -> torch.Tensor:
    """:func:`merge_shards` by a partition tag; a replicated tensor (``tag`` None) or a single shard is
    returned as is (rank 0's copy)."""
    if tag is None or len(shards) == 1:
        return shards[0]
    return merge_shards(shards, tag[0], tag[1])


def is_vocab_sized(name: str) -> bool:
    """Parameters with one row per (padded) vocabulary entry: the word embedding, the untied output layer
    (``model.untie_embeddings_and_output_weights``) and BERT's LM-head bias."""
    return name.endswith(("word_embeddings.weight", "output_layer.weight", "lm_head.bias"))


def resize_vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad the vocabulary rows (dim 0) to ``rows``; the padding rows are never real ids.
    ``t`` itself when it already has ``rows`` rows, otherwise a new tensor."""
    if t.size(0) == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    n = min(rows, t.size(0))
    out[:n] = t[:n]
    return out
