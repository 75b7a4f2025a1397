"""Hugging Face export: transformers loads the folder and its logits equal ours."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2"


def _cfg(vocab=300):
    from training.models.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=vocab,
                       hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)


def test_hf_model_logits_equal_ours(tmp_path):
    from transformers import GPT2LMHeadModel

    from training.models.gpt2 import GPTModel
    from training.tools.export_hf import build_hf_model

    cfg = _cfg()
    ours = GPTModel(cfg, 384, seed=4).eval()
    # make the LayerNorm/bias parameters non-trivial so every mapped tensor matters
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in ours.named_parameters():
            if n.endswith("bias") or ".ln" in n or "final_ln" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    hf = build_hf_model(ours.state_dict(), cfg, 300, eod=299)
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "m").eval()
    tokens = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(tokens)[..., :300]
        b = loaded(tokens).logits
    assert b.shape == (3, 24, 300)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
