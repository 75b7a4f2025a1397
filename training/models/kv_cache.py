"""The key/value cache of incremental decoding: what :class:`~training.models.gpt2.GPTModel`'s forward takes to
feed only the new tokens of a generation step (``evaluation.generate`` is the loop around it).

Notation: b batch, n heads, g key/value heads (= n without grouped-query attention), hn head size, p = TP
degree, T_max cache positions. Each layer's attention (:class:`~training.models.blocks.ParallelSelfAttention`)
writes the keys and values of its t new positions after the ``length`` cached ones (keys after RoPE, grouped
heads not repeated: a GQA cache is n/g times smaller) and attends over all of them; the model then advances
``length`` once per forward. At TP = k every rank caches its own g/k key/value heads.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Keys and values of every layer, ``k[i]``/``v[i]`` [b, g/p, T_max, hn] for the layer numbered i + 1,
    filled up to ``length``. ``valid`` [b, T_max] bool marks real tokens (False = padding, e.g. a left-padded
    prompt's pad positions, masked as keys); None = every position is a real token."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype,
                 valid: torch.Tensor | None = None):
        attn = model.layers[0].attn
        shape = (batch, attn.local_kv_heads, max_len, attn.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in model.layers]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in model.layers]
        self.max_len = max_len
        self.valid = valid
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s (0-based) keys and values of the t new positions [b, g/p, t, hn] after the
        cached ones; return all of them so far, [b, g/p, length + t, hn] each (views of the cache)."""
        start, end = self.length, self.length + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attn_mask(self, t: int) -> torch.Tensor:
        """[b or 1, 1, t, length + t] bool (True = attend) for t new positions: causal over the cache, padding
        keys masked; every position may attend itself, so a padding row is never fully masked (its output is
        unused)."""
        start, end = self.length, self.length + t
        device = self.k[0].device
        q_pos = torch.arange(start, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        keep = k_pos <= q_pos                                                  # [t, end], causal
        if self.valid is not None:
            keep = (keep & self.valid[:, None, :end]) | (k_pos == q_pos)       # [b, t, end]
        return keep[None, None] if keep.dim() == 2 else keep[:, None]

    def advance(self, t: int) -> None:
        """Count the t positions every layer has just stored."""
        self.length += t
