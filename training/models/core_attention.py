"""The attention cores: softmax(Q K^T / sqrt(hn) + mask) with dropout, times V, on a rank's heads; one chosen per
layer when the model is built (:func:`build_core`, from ``training.models.config.ModelConfig``), as Megatron-Core builds
its ``core_attention`` from a layer spec. The attention module (:class:`training.models.blocks.ParallelSelfAttention`)
calls ``self.core_attention(q, k, v, mask)`` and chooses no kernel.

* :class:`SDPACore`: ``F.scaled_dot_product_attention`` (flash or memory-efficient kernels on GPUs); the default,
  and BERT's bidirectional layers.
* :class:`CPUDropoutCore`: SDPA, but with dropout on CPU fp32 the fused causal kernel
  :func:`training.models.ops.causal_attention_with_dropout`; for causal layers with attention dropout.
* :class:`MegatronCore`: :func:`core_attention` below, explicit scores and Megatron's fp16 stabilisers; for
  ``apply_query_key_layer_scaling`` or ``attention_softmax_in_fp32``.

Every core owns its dropout stream (:class:`AttentionCore`); ``model.recompute: selective`` wraps the chosen core
in :class:`Recomputed`.

Megatron's core attention with its two fp16 stabilisers, for ``model.apply_query_key_layer_scaling`` and
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

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from training.models.config import ModelConfig
from training.models.ops import causal_attention_with_dropout, dropout
from training.models.qkv import repeat_kv
from training.parallel import random as tp_random

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


# --- the cores: one chosen per layer when the model is built -----------------------------------------------------
class AttentionCore(nn.Module):
    """softmax(Q K^T / sqrt(hn) + mask) with dropout p on the probabilities, times V, on TP-local heads.

    ``forward(q [b, n/p, s, hn], k, v [b, g/p, sk, hn], attn_mask)`` -> [b, n/p, s, hn]: key/value heads repeated
    for their query heads (:func:`~training.models.qkv.repeat_kv`), then :meth:`kernel`. ``attn_mask``: None, or
    bool broadcastable to [b, n/p, s, sk], True = attend (BERT's padding mask, a KV-cache step's mask).

    Its own dropout stream: attention-probability dropout acts on TP-local heads, so it draws from the
    model-parallel stream: eager, the tracker's generator fork around the kernel; under ``torch.compile`` (or
    ``traced_rng``, a compiled layer's eagerly recomputed core) the counter-based mask of
    :func:`training.parallel.random.model_parallel_dropout` in the explicit core, since a generator's state cannot
    be switched inside a graph. Without dropout (p = 0: eval, or ``attention_dropout: 0``) no number is drawn and
    no stream switched. What forward decides at run time, and why: p (train/eval mode), whether it is being
    compiled (a trace-time constant), and in :class:`CPUDropoutCore` the tensors' device (below)."""

    query_key_layer_scaling = False
    softmax_in_fp32 = False

    def __init__(self, dropout_p: float, causal: bool, layer_number: int = 1):
        super().__init__()
        self.dropout_p = dropout_p
        self.causal = causal
        self.layer_number = layer_number                                   # 1-based (Megatron's)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(q, k, v, attn_mask, self.dropout_p if self.training else 0.0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, p: float,
               traced_rng: bool = False) -> torch.Tensor:
        """:meth:`forward` with dropout ``p`` given (what :class:`Recomputed` replays)."""
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))           # [b, n/p, sk, hn]
        if p == 0.0:
            return self.kernel(q, k, v, attn_mask, 0.0)
        if traced_rng or torch.compiler.is_compiling():
            return self.explicit(q, k, v, attn_mask, p, tp_random.model_parallel_dropout)
        with tp_random.model_parallel_rng():
            return self.kernel(q, k, v, attn_mask, p)

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
               p: float) -> torch.Tensor:
        """The core's computation, dropout p from the current default generator: [b, n/p, s, hn]."""
        raise NotImplementedError

    def explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, p: float,
                 dropout_fn: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> torch.Tensor:
        """:func:`core_attention` with this core's stabilisers (none but in :class:`MegatronCore`)."""
        return core_attention(q, k, v, layer_number=self.layer_number,
                              query_key_layer_scaling=self.query_key_layer_scaling,
                              softmax_in_fp32=self.softmax_in_fp32, causal=self.causal, attn_mask=attn_mask,
                              dropout_p=p, dropout_fn=dropout_fn)

    def keeps_scores(self, q: torch.Tensor, p: float) -> bool:
        """Whether the kernel keeps s x s tensors for backward (what selective recomputation saves). SDPA's fused
        kernels (flash, memory-efficient: on GPUs, and on CPU without dropout) keep only q, k, v, the output and
        the log-sum-exp, and recompute the scores in their backward kernel; with dropout off a GPU (SDPA's math
        path, the CPU dropout kernel) the probabilities, their mask and output are kept."""
        return p > 0.0 and q.device.type != "cuda"

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}, causal={self.causal}, layer_number={self.layer_number}"


class SDPACore(AttentionCore):
    """``F.scaled_dot_product_attention``: flash or memory-efficient kernels on GPUs (causal without a mask:
    ``is_causal``, no mask tensor); the default core."""

    def kernel(self, q, k, v, attn_mask, p):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                              is_causal=self.causal and attn_mask is None)


class CPUDropoutCore(SDPACore):
    """SDPA, except with dropout on CPU fp32 and no explicit mask:
    :func:`training.models.ops.causal_attention_with_dropout` (one ``baddbmm`` with the causal bias, softmax, the fast CPU dropout, ``bmm``), since SDPA has no fused CPU
    kernel with dropout and falls back to its slower math path. Chosen for causal layers with attention dropout.
    The device is read in forward: models are built on the CPU and moved afterwards (``.to``, DeepSpeed's engine),
    so it is not known when the core is chosen."""

    def kernel(self, q, k, v, attn_mask, p):
        if p > 0.0 and attn_mask is None and q.device.type == "cpu" and q.dtype == torch.float32:
            return causal_attention_with_dropout(q, k, v, p)
        return super().kernel(q, k, v, attn_mask, p)


class MegatronCore(AttentionCore):
    """Megatron's explicit core with its fp16 stabilisers (:func:`core_attention`, the module docstring): scores
    divided by the layer number (``apply_query_key_layer_scaling``), softmax in fp32. Keeps the s x s
    probabilities on every device."""

    def __init__(self, dropout_p: float, causal: bool, layer_number: int, query_key_layer_scaling: bool,
                 softmax_in_fp32: bool):
        super().__init__(dropout_p, causal, layer_number)
        self.query_key_layer_scaling = query_key_layer_scaling
        self.softmax_in_fp32 = softmax_in_fp32

    def kernel(self, q, k, v, attn_mask, p):
        return self.explicit(q, k, v, attn_mask, p)

    def keeps_scores(self, q, p):
        return True

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, query_key_layer_scaling={self.query_key_layer_scaling}, "
                f"softmax_in_fp32={self.softmax_in_fp32}")


class Recomputed(nn.Module):
    """``model.recompute: selective`` (Korthikanti et al. 2022) around a core: in training with autograd on, where
    the core keeps s x s tensors (:meth:`AttentionCore.keeps_scores`), forward keeps only q, k, v (k, v before the
    GQA repeat) and backward runs the core again from the same RNG states (same dropout mask); elsewhere it is
    the core itself."""

    def __init__(self, core: AttentionCore):
        super().__init__()
        self.core = core

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        p = self.core.dropout_p if self.training else 0.0
        if self.training and torch.is_grad_enabled() and self.core.keeps_scores(q, p):
            # a compiled layer runs the recomputed core eagerly, with the compiled path's traceable dropout mask
            return recompute_core(self.core, q, k, v, attn_mask, p, torch.compiler.is_compiling())
        return self.core.attend(q, k, v, attn_mask, p)


@torch.compiler.disable
def recompute_core(core: AttentionCore, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None, p: float, traced_rng: bool) -> torch.Tensor:
    """``core.attend`` keeping only q, k, v (:func:`training.parallel.random.recompute`)."""
    return tp_random.recompute(functools.partial(core.attend, attn_mask=attn_mask, p=p, traced_rng=traced_rng),
                               q, k, v)


def build_core(cfg: ModelConfig, layer_number: int, causal: bool) -> nn.Module:
    """The attention core of layer ``layer_number`` (1-based), chosen once from the model config:

    ==================================================================  =========================
    config                                                              core
    ==================================================================  =========================
    ``apply_query_key_layer_scaling`` or ``attention_softmax_in_fp32``  :class:`MegatronCore`
    causal (GPT) with ``attention_dropout`` > 0                         :class:`CPUDropoutCore`
    otherwise (BERT's bidirectional layers; no attention dropout)       :class:`SDPACore`
    ==================================================================  =========================

    wrapped in :class:`Recomputed` with ``recompute: selective``."""
    core: AttentionCore
    if cfg.apply_query_key_layer_scaling or cfg.attention_softmax_in_fp32:
        core = MegatronCore(cfg.attention_dropout, causal, layer_number, cfg.apply_query_key_layer_scaling,
                            cfg.attention_softmax_in_fp32)
    elif causal and cfg.attention_dropout > 0.0:
        core = CPUDropoutCore(cfg.attention_dropout, causal, layer_number)
    else:
        core = SDPACore(cfg.attention_dropout, causal, layer_number)
    return Recomputed(core) if cfg.recompute == "selective" else core
