"""Relative gaps between two runs' gradients or weights, by the PP=1 model's parameter names (the parity tests of
the pipeline schedules: tests/parallel/test_pipeline_schedules.py, tests/parallel/test_bert_pipe.py)."""
from __future__ import annotations

import torch


def comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` without the key part of the fused QKV bias ([Q; K; V] per rank): softmax does not see a key bias, so
    its gradient is rounding noise that Adam turns into full-size updates of either sign in every run."""
    if not name.endswith("attn.qkv.bias"):
        return t
    third = t.numel() // 3
    return torch.cat([t[:third], t[2 * third:]])


def rel_gap(a: dict, b: dict) -> float:
    """The largest ||a[n] - b[n]|| / ||b[n]|| over the (comparable) tensors of two dicts with the same names."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((comparable(n, a[n]) - comparable(n, b[n])).norm() / comparable(n, b[n]).norm().clamp_min(1e-30)
                ).item() for n in a)


def model_gap(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every (comparable) weight of the model: the updated weights. Per tensor, Adam turns
    rounding-level differences of near-zero gradients (the small biases) into larger relative ones (the QKV bias's
    reaches 1.3e-6 under sequence parallelism, 1e-8 in absolute terms)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    diff = sum((comparable(n, a[n]) - comparable(n, b[n])).norm() ** 2 for n in a)
    return (diff / sum(comparable(n, b[n]).norm() ** 2 for n in a)).sqrt().item()
