"""training.models.ops: CPU dropout / dropout-add / causal attention against references written out by hand."""
import math

import pytest
import torch
import torch.nn.functional as F

from training.models.ops import causal_attention_with_dropout, dropout, dropout_add

P = 0.1


def _reference_mask(shape, seed: int, p: float) -> torch.Tensor:
    """The mask the ops must draw: keep where u >= p for u = torch.rand(shape) after manual_seed(seed)."""
    torch.manual_seed(seed)
    return (torch.rand(shape) >= p).float() / (1.0 - p)


def test_dropout_add_forward_backward_match_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 32, generator=gen, requires_grad=True)
    r = torch.randn(4, 16, 32, generator=gen, requires_grad=True)
    g = torch.randn(4, 16, 32, generator=gen)
    mask = _reference_mask(x.shape, 7, P)
    torch.manual_seed(7)
    y = dropout_add(x, r, P, True)
    torch.testing.assert_close(y, r + x * mask, rtol=0, atol=1e-6)
    y.backward(g)
    torch.testing.assert_close(x.grad, g * mask, rtol=0, atol=1e-6)
    torch.testing.assert_close(r.grad, g, rtol=0, atol=0)
    # dropped elements are exactly the residual; kept ones are residual + x / (1 - p)
    dropped = mask == 0
    assert 0 < dropped.sum() < dropped.numel()
    assert torch.equal(y.detach()[dropped], r.detach()[dropped])


def test_dropout_matches_reference_and_keeps_one_minus_p():
    x = torch.ones(1_000_000, requires_grad=True)
    mask = _reference_mask(x.shape, 3, P)
    torch.manual_seed(3)
    y = dropout(x, P, True)
    torch.testing.assert_close(y, mask, rtol=0, atol=0)
    keep = (y > 0).float().mean().item()
    assert abs(keep - (1 - P)) < 5 * math.sqrt(P * (1 - P) / x.numel())  # 5 sigma
    assert abs(y.mean().item() - 1.0) < 0.005                             # unbiased: E[y] = x
    y.sum().backward()
    torch.testing.assert_close(x.grad, mask, rtol=0, atol=0)


def test_dropout_same_seed_same_mask_and_eval_is_identity():
    x = torch.randn(64, 64)
    torch.manual_seed(11)
    a = dropout(x, 0.3, True)
    torch.manual_seed(11)
    b = dropout(x, 0.3, True)
    assert torch.equal(a, b)
    assert dropout(x, 0.3, False) is x
    r = torch.randn(64, 64)
    assert torch.equal(dropout_add(x, r, 0.3, False), r + x)
    assert torch.equal(dropout_add(x, r, 0.0, True), r + x)


def test_other_dtypes_use_torch_dropout():
    x = torch.ones(10_000, dtype=torch.float64)
    torch.manual_seed(5)
    y = dropout(x, P, True)
    torch.manual_seed(5)
    assert torch.equal(y, F.dropout(x, P, True))


def test_bad_probability_is_one_clear_error():
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        dropout(torch.ones(3), 1.0, True)


def test_causal_attention_matches_sdpa_and_reference_with_dropout():
    gen = torch.Generator().manual_seed(1)
    b, n, s, hn = 2, 3, 8, 4
    q, k, v = (torch.randn(b, n, s, hn, generator=gen, requires_grad=True) for _ in range(3))
    g = torch.randn(b, n, s, hn, generator=gen)
    # p = 0: plain causal attention
    torch.testing.assert_close(causal_attention_with_dropout(q, k, v, 0.0),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)

    def reference(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) / math.sqrt(hn)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(scores, -1) * mask) @ v

    mask = _reference_mask((b * n, s, s), 9, 0.25).view(b, n, s, s)
    torch.manual_seed(9)
    ours = causal_attention_with_dropout(q, k, v, 0.25)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref = reference(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, e in zip(grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
