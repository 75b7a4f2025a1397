"""Megatron's core attention with its two fp16 stabilisers, for ``model.apply_query_key_layer_scaling`` and
``model.attention_softmax_in_fp32`` (both off by default, as in Megatron's arguments).

Megatron (``ParallelAttention`` + ``FusedScaleMaskSoftmax``, torch path), per layer ``l`` (1-based):

* ``norm_factor = sqrt(hn)``, times ``coeff = l`` with query-key layer scaling;
* ``scores = baddbmm(Q, K^T, alpha = 1 / norm_factor)`` in the activation dtype: with scaling the fp16
  scores are l times smaller, so a deep layer's large Q.K products stay below fp16's 65504;
* softmax input cast to fp32 when ``attention_softmax_in_fp32`` (forced on by layer scaling), then
  multiplied back by ``coeff`` (in fp32, where it cannot overflow), masked with -10000, softmax, cast back;
* dropout on the probabilities, times V.

In fp32 both options leave the math unchanged (scores / l * l); in fp16 they decide whether the scores
overflow and how the softmax rounds. ``tests/unit/test_attention_numerics.py`` checks both.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from training.models.ops import dropout

MASKED_SCORE = -10000.0  # Megatron's attention_mask_func fill value


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_number: int,
                   query_key_layer_scaling: bool, softmax_in_fp32: bool, causal: bool,
                   attn_mask: torch.Tensor | None, dropout_p: float,
                   dropout_fn: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> torch.Tensor:
    """q [b, n, s, hn], k and v [b, n, sk, hn] -> [b, n, s, hn]. ``attn_mask``: bool, broadcastable to [b, n, s, sk],
    True = attend (the SDPA convention used by the models); ``causal`` adds the lower-triangular mask, aligned to
    the last key (sk > s: the s queries follow sk - s cached keys, :class:`training.models.kv_cache.KVCache`).
    ``dropout_fn(probs, p)`` replaces the default-stream dropout on the probabilities (compiled layers pass
    :func:`training.parallel.random.model_parallel_dropout`)."""
    b, n, s, hn = q.shape
    sk = k.size(2)
    coeff = float(max(1, layer_number)) if query_key_layer_scaling else 1.0
    softmax_in_fp32 = softmax_in_fp32 or query_key_layer_scaling  # Megatron forces it with layer scaling
    norm_factor = math.sqrt(hn) * coeff
    scores = torch.baddbmm(torch.empty(b * n, s, sk, dtype=q.dtype, device=q.device), q.reshape(b * n, s, hn),
                           k.reshape(b * n, sk, hn).transpose(1, 2), beta=0.0, alpha=1.0 / norm_factor)  # [b n, s, sk]
    scores = scores.view(b, n, s, sk)
    half = scores.dtype in (torch.float16, torch.bfloat16)
    x = scores.float() if (half and softmax_in_fp32) else scores
    if coeff != 1.0:
        x = x * coeff
    keep = None
    if causal:
        keep = torch.ones(s, sk, dtype=torch.bool, device=q.device).tril_(sk - s)
    if attn_mask is not None:
        keep = attn_mask if keep is None else keep & attn_mask
    if keep is not None:
        x = x.masked_fill(~keep, MASKED_SCORE)
    probs = torch.softmax(x, dim=-1)
    if half and softmax_in_fp32:
        probs = probs.to(scores.dtype)
    if dropout_fn is not None and dropout_p > 0.0:
        probs = dropout_fn(probs, dropout_p)
    else:
        probs = dropout(probs, dropout_p, dropout_p > 0.0)
    return torch.matmul(probs, v)                                         # [b, n, s, hn]
