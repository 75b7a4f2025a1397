"""Rotary position embeddings (RoPE; Su et al. 2021): the frequencies, optionally with Llama 3's scaling, their
cos/sin tables (cached: one table per sequence length, device and dtype, shared by every layer), and the rotation.

Frequencies theta_i = base^(-2i/d), i < d/2 (d = rotary dims); position m turns the pair (x_i, x_{i+d/2}) by the
angle m theta_i (the "rotate half" layout of GPT-NeoX, Llama and Megatron-Core).

Llama 3's scaling (``model.rope_scaling``, ``rope_type: llama3``; Meta's Llama 3.1 reference, ``transformers``'
``rope_type: llama3``): with L the original context (``original_max_position_embeddings``) and a frequency's
wavelength w_i = 2 pi / theta_i, r_i = L / w_i counts its turns over L. Frequencies that turn fewer than
``low_freq_factor`` times are divided by ``factor`` (slowed down: they now span factor x L); those that turn more
than ``high_freq_factor`` times are kept; in between, a linear blend in r_i:

    theta_i' = (1 - t_i) theta_i / factor + t_i theta_i,   t_i = clamp((r_i - low) / (high - low), 0, 1)

(t_i = 0 and 1 give the two ends exactly). The tables are not rescaled (attention factor 1).
"""
from __future__ import annotations

import functools
import math

import torch

Llama3Scaling = tuple[float, float, float, int]
"""(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of Llama 3's RoPE scaling."""


def inverse_frequencies(rotary_dim: int, base: float, scaling: Llama3Scaling | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/d), i < d/2, fp32 [d/2]; with ``scaling``, Llama 3's (module docstring)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)                                  # [d/2]
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    turns = original / (2 * math.pi / inv_freq)                           # r_i = L / w_i
    t = ((turns - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - t) * inv_freq / factor + t * inv_freq


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype,
                   scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles: positions [..., s] (integer) -> two [..., s, rotary_dim] in ``dtype``, laid
    out [theta_0 .. theta_{d/2-1}, theta_0 .. theta_{d/2-1}]. Computed in fp32, then cast, as ``transformers``."""
    inv_freq = inverse_frequencies(rotary_dim, base, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq                       # [..., s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                               # [..., s, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@functools.lru_cache(maxsize=16)
def _table(seq: int, rotary_dim: int, base: float, scaling: Llama3Scaling | None, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in training after an evaluation
        return rotary_cos_sin(torch.arange(seq, device=device), rotary_dim, base, dtype, scaling)


def rotary_table(seq: int, rotary_dim: int, base: float, dtype: torch.dtype, device: torch.device,
                 scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, rotary_dim] of positions 0 .. seq-1 (:func:`rotary_cos_sin`), computed once per
    (seq, dims, base, scaling, device, dtype) and shared by every layer and step: constants, never written.
    Traced code (``torch.compile``) computes them in its graph instead."""
    if torch.compiler.is_compiling():
        return rotary_cos_sin(torch.arange(seq, device=device), rotary_dim, base, dtype, scaling)
    return _table(seq, rotary_dim, base, scaling, torch.device(device), dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` dims of every head of x [b, heads, s, hn] by RoPE; the rest pass.

    Dimension i pairs with i + d/2 (d = rotary dims): (x_i, x_{i+d/2}) -> (x_i cos - x_{i+d/2} sin,
    x_{i+d/2} cos + x_i sin), i.e. the complex number x_i + j x_{i+d/2} times e^{j m theta_i}.
    ``cos``/``sin`` [s, d] or [b, 1, s, d] (:func:`rotary_cos_sin`)."""
    d = cos.size(-1)
    rot, rest = (x, None) if d == x.size(-1) else (x[..., :d], x[..., d:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)
