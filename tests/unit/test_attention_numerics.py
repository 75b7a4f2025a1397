"""``model.apply_query_key_layer_scaling`` and ``model.attention_softmax_in_fp32`` as Megatron defines them:
the same math in fp32 (GPT-2 and BERT logits unchanged), and in fp16 layer l's Q.K scores divided by l
before they are rounded to fp16 and multiplied back in an fp32 softmax, so scores that would overflow
fp16 (> 65504) stay finite; the reference is computed in float64 from the same fp16 inputs."""
from __future__ import annotations

import math

import pytest
import torch

from training.models.config import ModelConfig
from training.models.core_attention import core_attention


def _reference(q, k, v, causal=True):
    """softmax(Q K^T / sqrt(hn) + causal mask) V in float64."""
    q, k, v = q.double(), k.double(), v.double()
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _ramp(b, n, s, hn, g) -> torch.Tensor:
    """Token j ~ (1 + 0.05 j): key j's score grows with j by ~5 % (thousands, far above fp16's spacing of
    16-32 at these magnitudes), so each causal row's softmax has a clear winner and fp16 rounding of the
    scores cannot flip it."""
    ramp = 1 + 0.05 * torch.arange(s, dtype=torch.float32).view(1, 1, s, 1)
    return ramp * (1 + 0.002 * torch.randn(b, n, s, hn, generator=g))


def _large_qkv(seed=0, b=2, n=2, s=8, hn=16, c=150.0):
    """fp16 q, k with Q.K / sqrt(hn) of 9e4-1.2e5 (over fp16's 65504, under 4 x 65504)."""
    g = torch.Generator().manual_seed(seed)
    q = (c * _ramp(b, n, s, hn, g)).half()
    k = (c * _ramp(b, n, s, hn, g)).half()
    v = torch.randn(b, n, s, hn, generator=g).half()
    return q, k, v


def test_layer_scaling_keeps_fp16_scores_finite():
    q, k, v = _large_qkv()
    assert (q.double() @ k.double().transpose(-1, -2) / 4).abs().max() > 65504  # would overflow fp16
    ref = _reference(q, k, v)
    kw = dict(causal=True, attn_mask=None, dropout_p=0.0)
    scaled = core_attention(q, k, v, layer_number=4, query_key_layer_scaling=True, softmax_in_fp32=True, **kw)
    assert scaled.dtype == torch.float16 and torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled.double(), ref, rtol=0, atol=2e-2)
    # layer scaling forces the softmax into fp32 (multiplying back by l in fp16 would overflow again)
    forced = core_attention(q, k, v, layer_number=4, query_key_layer_scaling=True, softmax_in_fp32=False, **kw)
    torch.testing.assert_close(forced, scaled, rtol=0, atol=0)
    # without it (fp32 softmax alone, or layer 1) the fp16 scores are inf and the output is not finite
    for layer, scaling in ((4, False), (1, True)):
        y = core_attention(q, k, v, layer_number=layer, query_key_layer_scaling=scaling, softmax_in_fp32=True, **kw)
        assert not torch.isfinite(y).all(), (layer, scaling)


def test_softmax_in_fp32_alone_matches_reference_in_fp16():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g).half() for _ in range(3))
    y = core_attention(q, k, v, layer_number=3, query_key_layer_scaling=False, softmax_in_fp32=True, causal=True,
                       attn_mask=None, dropout_p=0.0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), _reference(q, k, v), rtol=0, atol=5e-3)


def test_model_passes_its_layer_number():
    """Layer index 3 is Megatron's layer_number 4: its fp16 scores of ~9e4 are computed as ~2.3e4."""
    from training.models.gpt2 import TransformerLayer

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=2, seq_length=8, hidden_dropout=0.0,
                      attention_dropout=0.0, apply_query_key_layer_scaling=True)
    outs = {}
    for index in (3, 0):
        attn = TransformerLayer(cfg, None, 1, index).attn
        with torch.no_grad():  # Q = K = 150 x, V = x: rows [Q; K; V] of the fused weight at TP=1
            eye = torch.eye(32)
            attn.qkv.weight.copy_(torch.cat([150 * eye, 150 * eye, eye]))
        attn = attn.half().eval()
        x = _ramp(2, 1, 8, 32, torch.Generator().manual_seed(2)).view(2, 8, 32).half()
        with torch.no_grad():
            outs[index] = attn(x)
            if index == 3:
                q = (150 * x).view(2, 8, 2, 16).transpose(1, 2)
                ref = _reference(q, q, x.view(2, 8, 2, 16).transpose(1, 2))            # [b, n, s, hn]
                ref = ref.transpose(1, 2).reshape(2, 8, 32) @ attn.proj.weight.double().t()
    assert attn.layer_number == 1
    assert torch.isfinite(outs[3]).all() and not torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[3].double(), ref, rtol=0, atol=2e-2)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_options_leave_fp32_math_unchanged(arch):
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel

    outs = []
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 11:] = 0
    for on in (False, True):
        cfg = ModelConfig(arch=arch, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                          hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
                          apply_query_key_layer_scaling=on, attention_softmax_in_fp32=on)
        if arch == "gpt2":
            outs.append(GPTModel(cfg, 128, seed=4).eval()(tokens))
        else:
            outs.append(BertModel(cfg, 128, seed=4).eval()(tokens, None, padding)[0][padding.bool()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
