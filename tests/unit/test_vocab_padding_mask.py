"""``model.mask_vocab_padding``: the vocabulary's padding columns out of the training softmax (issue 44 item 6)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.models.config import ModelConfig, validate_model_options
from training.models.gpt2 import GPTModel
from training.parallel.cross_entropy import vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_does_not_depend_on_the_padding(dtype):
    """The same real logits with 16 or 48 padding columns (random values): masked, both losses equal torch's
    cross-entropy over the real columns and each other bitwise, the padding columns get no gradient; unmasked the
    padding changes the loss (what a reshard to another TP did)."""
    torch.manual_seed(0)
    vocab = 100
    real = torch.randn(2, 5, vocab).to(dtype)
    target = torch.randint(0, vocab, (2, 5))
    ref = F.cross_entropy(real.float().reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(2, 5)
    masked, unmasked = [], []
    for pad in (16, 48):
        logits = torch.cat([real, 3 * torch.randn(2, 5, pad).to(dtype)], dim=-1).requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, vocab_size=vocab)
        loss.sum().backward()
        assert torch.equal(logits.grad[..., vocab:], torch.zeros_like(logits.grad[..., vocab:]))
        masked.append(loss.detach())
        unmasked.append(vocab_parallel_cross_entropy(logits.detach(), target))
    torch.testing.assert_close(masked[0], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(masked[0], masked[1])
    assert (unmasked[0] - unmasked[1]).abs().max() > 1e-3 and (unmasked[0] - ref).abs().min() > 0


def test_gpt_model_with_the_mask_is_the_real_vocabulary_loss():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=90,
                      hidden_dropout=0.0, attention_dropout=0.0, mask_vocab_padding=True)
    model = GPTModel(cfg, 128, seed=1).eval()
    tokens, labels = torch.randint(0, 90, (2, 8)), torch.randint(0, 90, (2, 8))
    with torch.no_grad():
        loss = model(tokens, labels)
        logits = model(tokens)
    ref = F.cross_entropy(logits[..., :90].reshape(-1, 90), labels.reshape(-1), reduction="none").reshape(2, 8)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    unmasked = F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="none").reshape(2, 8)
    assert (unmasked - ref).min() > 0  # the 38 padding columns raised every token's loss


def test_bert_refuses_it():
    with pytest.raises(ValueError, match="mask_vocab_padding"):
        validate_model_options(ModelConfig(arch="bert", num_layers=2, hidden_size=32, num_attention_heads=4,
                                           seq_length=8, vocab_size=90, mask_vocab_padding=True))
