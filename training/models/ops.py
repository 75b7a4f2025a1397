"""Element-wise pieces shared by the models, with faster CPU paths: dropout, dropout + residual, causal attention.

On CPU, ``F.dropout`` draws its mask with ``bernoulli_`` (about twice the time of ``rand``), stores it,
then multiplies and scales in separate passes; a residual add after it is one more pass over the
activation. Here, for CPU fp32 tensors, the mask is drawn with one ``rand`` compared in place
(``u >= p``, so P(keep) = 1 - p) and scaled in place to {0, 1/(1-p)}; the output is one ``mul`` or one
``addcmul`` (residual + x * mask). The backward multiplies by the same saved mask. Forward + backward,
the hidden-size dropout-and-add is 1.55-1.7x and the attention-probability dropout 1.25-1.4x faster than
``F.dropout`` (+ add) on the 2-core CPU (``benchmarks/bench_step_parts.py dropout``, benchmarks/RESULTS.md).

The draw comes from the default CPU generator, the one ``F.dropout`` uses, so the RNG tracker of
``training.parallel.random`` (TP-local streams) and activation checkpointing (which saves and restores
that generator) work unchanged. The masks are different numbers than ``F.dropout`` draws for the same
seed (a different sampler), with the same distribution. Other devices and dtypes use ``F.dropout``
(on GPUs it is one fused kernel already).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def _fast_path(x: torch.Tensor) -> bool:
    """CPU fp32 in eager mode (compiled code gets ``F.dropout``, which the compiler fuses itself)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()


def _scaled_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """{0, 1/(1-p)} with P(1/(1-p)) = 1 - p, shaped like x: one rand, compared and scaled in place."""
    return torch.rand_like(x).ge_(p).mul_(1.0 / (1.0 - p))


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        mask = _scaled_mask(x, p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


class _DropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, p):
        mask = _scaled_mask(x, p)
        ctx.save_for_backward(mask)
        return torch.addcmul(residual, x, mask)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, grad, None


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x, p, training)``; for CPU fp32 a faster mask (see the module docstring)."""
    if not training or p == 0.0:
        return x
    _check_p(p)
    if _fast_path(x):
        return _Dropout.apply(x, p)
    return F.dropout(x, p, True)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + F.dropout(x, p, training)`` in one pass on CPU fp32 (same shapes, no broadcasting)."""
    if not training or p == 0.0:
        return residual + x
    _check_p(p)
    if _fast_path(x) and residual.dtype == x.dtype and residual.shape == x.shape:
        return _DropoutAdd.apply(x, residual, p)
    return residual + F.dropout(x, p, True)


@functools.lru_cache(maxsize=8)
def _causal_bias(s: int, dtype: torch.dtype) -> torch.Tensor:
    """[s, s] additive mask: 0 on and below the diagonal, -inf above (a constant, never written)."""
    return torch.full((s, s), float("-inf"), dtype=dtype).triu_(1)


def causal_attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(hn) + causal) with dropout p on the probabilities, times V (CPU fp32).

    q, k, v [b, n, s, hn] -> [b, n, s, hn]. With dropout on, CPU SDPA has no fused kernel and falls
    back to its math path (builds the mask with tril, scales Q and K separately, runs a safe-softmax
    check); here the scale and the mask fold into one ``baddbmm`` (beta = 1, alpha = 1/sqrt(hn)) and
    the rest is softmax, the fast dropout above and a ``bmm``. Causal rows always keep the diagonal,
    so no row is fully masked.
    """
    b, n, s, hn = q.shape
    scores = torch.baddbmm(_causal_bias(s, q.dtype), q.reshape(b * n, s, hn), k.reshape(b * n, s, hn).transpose(1, 2),
                           alpha=1.0 / math.sqrt(hn))                      # [b n, s, s]
    probs = dropout(torch.softmax(scores, dim=-1), p, True)
    return torch.bmm(probs, v.reshape(b * n, s, hn)).view(b, n, s, hn)
