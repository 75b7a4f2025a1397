"""training.parallel.sharding: shards of a full tensor and their merge are inverse, the strided (fused QKV)
layout keeps whole Q/K/V blocks per rank, and vocabulary rows are trimmed or zero-padded."""
from __future__ import annotations

import pytest
import torch

from training.parallel.sharding import (
    is_vocab_sized,
    merge_shards,
    merge_tagged,
    resize_vocab_rows,
    shard,
    shard_tagged,
)


@pytest.mark.parametrize("dim,stride,world", [(0, 1, 2), (1, 1, 4), (0, 3, 2), (0, 3, 4)])
def test_shard_then_merge_is_identity(dim, stride, world):
    full = torch.randn(24, 12, generator=torch.Generator().manual_seed(0))
    shards = [shard(full, dim, r, world, stride) for r in range(world)]
    assert all(s.size(dim) == full.size(dim) // world for s in shards)
    assert torch.equal(merge_shards(shards, dim, stride), full)
    assert torch.equal(merge_tagged(shards, (dim, stride)), full)
    assert all(torch.equal(shard_tagged(full, (dim, stride), r, world), s) for r, s in enumerate(shards))


def test_strided_shard_holds_each_ranks_q_k_v():
    h, world = 4, 2
    q, k, v = (torch.full((h, 1), float(i)) + torch.arange(h).view(h, 1) / 10 for i in range(3))
    rank1 = shard(torch.cat([q, k, v]), 0, 1, world, stride=3)
    assert torch.equal(rank1, torch.cat([q[2:], k[2:], v[2:]]))


def test_replicated_and_single_shard_pass_through():
    t = torch.randn(3, 5)
    assert shard_tagged(t, None, 1, 2) is t
    assert shard_tagged(t, (0, 1), 0, 1) is t
    assert merge_tagged([t, torch.zeros_like(t)], None) is t


def test_indivisible_shard_raises():
    with pytest.raises(ValueError, match="not divisible"):
        shard(torch.zeros(5, 2), 0, 0, 2)


def test_resize_vocab_rows_trims_and_zero_pads():
    t = torch.arange(12.0).view(6, 2)
    assert resize_vocab_rows(t, 6) is t
    assert torch.equal(resize_vocab_rows(t, 4), t[:4])
    padded = resize_vocab_rows(t, 8)
    assert torch.equal(padded[:6], t) and not padded[6:].any()
    bias = resize_vocab_rows(torch.ones(3), 5)
    assert bias.tolist() == [1, 1, 1, 0, 0]
    assert is_vocab_sized("embedding.word_embeddings.weight") and is_vocab_sized("lm_head.bias")
    assert not is_vocab_sized("lm_head.dense.bias")
