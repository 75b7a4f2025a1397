"""The planner's context-parallel traffic (training/plan/context_comm.py) against the bytes the two CP attention
cores really send: DeepSpeed-Ulysses' all-to-alls and the ring's K/V shifts, counted at torch.distributed in a
2-rank gloo run of one attention forward and backward, with grouped-query heads."""
from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from training.layout import Layout
from training.plan.accounting import ModelShape
from training.plan.context_comm import context_comm

B, HEADS, KV_HEADS, HN, SEQ = 2, 4, 2, 8, 16


class _Sent:
    """Wraps a torch.distributed send-side call and adds up what this rank puts on the wire: ``share`` of the
    tensor argument ``name`` (at ``index`` when positional; an all-to-all keeps 1/c of its input at home)."""

    def __init__(self, fn, name: str, index: int, share: float):
        self.fn, self.name, self.index, self.share, self.ops, self.bytes = fn, name, index, share, 0, 0.0

    def __call__(self, *args, **kwargs):
        tensor = kwargs[self.name] if self.name in kwargs else args[self.index]
        self.ops += 1
        self.bytes += tensor.numel() * tensor.element_size() * self.share
        return self.fn(*args, **kwargs)


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from training.parallel.context import RingCore, UlyssesCore

    class Causal(torch.nn.Module):
        def forward(self, q, k, v, attn_mask=None):  # the model's core signature (no mask here: causal)
            assert attn_mask is None
            rep = q.size(1) // k.size(1)
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  is_causal=True)

    out = {}
    for impl, core in (("ulysses", UlyssesCore(Causal(), dist.group.WORLD)), ("ring", RingCore(dist.group.WORLD))):
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(B, HEADS, SEQ // world, HN, generator=gen, requires_grad=True)
        k, v = (torch.randn(B, KV_HEADS, SEQ // world, HN, generator=gen, requires_grad=True) for _ in range(2))
        a2a = _Sent(dist.all_to_all_single, "input", 1, (world - 1) / world)  # (output, input, ...)
        send = _Sent(dist.isend, "tensor", 0, 1.0)                      # (tensor, dst, ...)
        dist.all_to_all_single, dist.isend = a2a, send
        try:
            core(q, k, v).square().sum().backward()
        finally:
            dist.all_to_all_single, dist.isend = a2a.fn, send.fn
        out[impl] = (a2a.ops + send.ops, a2a.bytes + send.bytes)
    return out


def test_planned_context_traffic_equals_what_the_cores_send():
    results = run_distributed(_worker, 2)
    shape = ModelShape(arch="gpt2", num_layers=1, hidden=HEADS * HN, heads=HEADS, seq=SEQ, vocab=64, positions=SEQ,
                       ffn=4 * HEADS * HN, kv_heads=KV_HEADS)
    for impl in ("ulysses", "ring"):
        planned = context_comm(shape, Layout(micro_batch=B, global_batch=B, context=2, context_impl=impl), layers=1,
                               ckpt=False, act_bytes=4)
        assert planned.ops > 0
        for sent in results:
            ops, wire = sent[impl]
            assert (ops, wire) == (planned.ops, pytest.approx(planned.wire, rel=1e-12)), (impl, sent, planned)
