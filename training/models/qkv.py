"""The fused QKV projection's layouts: how its rows hold the heads, split across TP ranks, and back.

Notation: b batch, s sequence, h hidden, n heads, g key/value heads (``num_query_groups``; g = n without
grouped-query attention), hn = h/n head size, p = TP degree.

* Multi-head attention (g = n, GPT-2's layout): global rows ``[Q; K; V]``, each ``n hn`` rows, split with
  stride 3 so that rank r holds ``[Q_r; K_r; V_r]`` (its n/p heads of each).
* Grouped-query attention (g < n, Megatron-Core's layout): per key/value group, the group's n/g query heads
  then its key head then its value head: global rows ``[q_{0..n/g-1}, k_0, v_0 | q_{n/g..2n/g-1}, k_1, v_1 | ...]``,
  each ``hn`` rows per head. Split by output rows with stride 1, rank r holds groups r g/p .. (r+1) g/p - 1
  whole: its n/p query heads and their g/p key/value heads.

Each key/value head is repeated for its n/g query heads before the attention core (:func:`repeat_kv`); the
KV cache keeps them unrepeated (n/g times smaller).
"""
from __future__ import annotations

import torch


def qkv_stride(heads: int, groups: int) -> int:
    """The column-parallel stride of the fused QKV weight: 3 for ``[Q; K; V]``, 1 for whole groups."""
    return 3 if groups == heads else 1


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """The full fused QKV weight (or bias) from separate ones: q [n hn, ...], k and v [g hn, ...] (rows = output
    features, as ``nn.Linear``). g = n: ``[Q; K; V]``; g < n: per group ``[q heads of the group; k; v]`` (the
    module docstring's layouts). Inverse: :func:`split_qkv`."""
    if groups == heads:
        return torch.cat([q, k, v], dim=0)
    rest = q.shape[1:]
    hn = k.size(0) // groups
    per = heads // groups
    parts = [q.reshape(groups, per * hn, *rest), k.reshape(groups, hn, *rest), v.reshape(groups, hn, *rest)]
    return torch.cat(parts, dim=1).reshape((heads + 2 * groups) * hn, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n hn, ...], k [g hn, ...], v [g hn, ...]) of a full fused QKV weight or bias (:func:`fuse_qkv`)."""
    rest = qkv.shape[1:]
    hn = qkv.size(0) // (heads + 2 * groups)
    if groups == heads:
        q, k, v = qkv.split([heads * hn, groups * hn, groups * hn], dim=0)
        return q, k, v
    per = heads // groups
    grouped = qkv.reshape(groups, (per + 2) * hn, *rest)
    q, k, v = grouped.split([per * hn, hn, hn], dim=1)
    return q.reshape(heads * hn, *rest), k.reshape(groups * hn, *rest), v.reshape(groups * hn, *rest)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's fused projection [b, s, (n + 2g)/p hn] -> q [b, n/p, s, hn], k and v [b, g/p, s, hn]
    (``heads`` = n/p, ``kv_heads`` = g/p; the rank's rows in the module docstring's layout)."""
    b, s = qkv.shape[:2]
    if heads == kv_heads:                                                  # [Q_r; K_r; V_r]
        q, k, v = qkv.view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [b, n/p, s, hn]
        return q, k, v
    per = heads // kv_heads                                                # per group [q heads; k; v]
    qkv = qkv.view(b, s, kv_heads, per + 2, head_dim)
    q = qkv[:, :, :, :per].reshape(b, s, heads, head_dim).transpose(1, 2)  # [b, n/p, s, hn]
    k = qkv[:, :, :, per].transpose(1, 2)                                  # [b, g/p, s, hn]
    v = qkv[:, :, :, per + 1].transpose(1, 2)
    return q, k, v


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g/p, s, hn] -> [b, n/p, s, hn] (``heads`` = n/p): each key/value head repeated for its n/g query
    heads; unchanged (the same tensor) without grouped-query attention."""
    b, g, s, hn = t.shape
    if g == heads:
        return t
    rep = heads // g
    return t[:, :, None].expand(b, g, rep, s, hn).reshape(b, g * rep, s, hn)
