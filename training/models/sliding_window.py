"""Mistral's sliding-window attention (``model.sliding_window``): query position i sees key position j when
0 <= i - j < w (itself and the w - 1 positions before it), as transformers' ``sliding_window`` mask does.

The window is one more mask on what the attention already masks (causality, a packed sample's documents, a KV-cache
step's padding keys): :func:`within_window` ANDs it into the model's ``attn_mask`` (True = attend) before the
layers run, so every attention core honours it unchanged. Where the window covers every position of the forward
(start + s <= w) the mask is left as it was: a short sequence keeps SDPA's causal kernel with no mask tensor.
"""
from __future__ import annotations

import torch


def window_mask(start: int, s: int, window: int, device: torch.device) -> torch.Tensor:
    """[s, start + s] bool, True = attend: the s queries at positions start .. start + s - 1 over keys 0 ..
    start + s - 1, causal and within ``window``."""
    q = torch.arange(start, start + s, device=device)[:, None]
    k = torch.arange(start + s, device=device)[None, :]
    return (k <= q) & (q - k < window)


def within_window(attn_mask: torch.Tensor | None, start: int, s: int, window: int | None,
                  device: torch.device) -> torch.Tensor | None:
    """``attn_mask`` (None = causal, or bool broadcastable to [b, 1, s, start + s]) restricted to the window; itself
    when there is no window or it covers all start + s positions."""
    if window is None or start + s <= window:
        return attn_mask
    keep = window_mask(start, s, window, device)[None, None]               # [1, 1, s, start + s]
    return keep if attn_mask is None else attn_mask & keep
