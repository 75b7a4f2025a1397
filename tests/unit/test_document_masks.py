"""Packed-document options (training/data/documents.py): Megatron's masks and positions, and what they do to a GPT."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.training_runs import ROOT
from training.config import ConfigError, load_config
from training.data.documents import DocumentMasks, masked_mean
from training.models.config import ModelConfig
from training.models.gpt2 import GPTModel

EOD = 0


def megatron_masks(data: torch.Tensor, eod: int):
    """Megatron's ``_get_ltor_masks_and_position_ids`` (reset positions, reset mask, EOD loss mask), written as its
    loops over the EOD indices of each row; attention mask True = attend (Megatron's is the complement)."""
    b, s = data.shape
    attend = torch.tril(torch.ones(s, s, dtype=torch.bool)).repeat(b, 1, 1)
    positions = torch.arange(s).repeat(b, 1)
    for row in range(b):
        eods = [i for i in range(s) if int(data[row, i]) == eod]
        prev = 0
        for i in eods:
            attend[row, i + 1:, :i + 1] = False
            positions[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    loss_mask = (data != eod).float()
    return positions, attend.unsqueeze(1), loss_mask


def _packed(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    tokens[tokens % 7 == 0] = EOD  # ~1 in 7 tokens ends a document
    tokens[0, 0] = EOD   # a sample that starts with an EOD
    tokens[-1, -1] = EOD  # and one that ends with one
    tokens[1 % b, 3:5] = EOD  # two EODs in a row (an empty document)
    return tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masks_and_positions_are_megatrons(seed):
    tokens = _packed(3, 29, seed)
    positions, attend, loss_mask = DocumentMasks(EOD, True, True, True).of(tokens)
    ref_positions, ref_attend, ref_loss = megatron_masks(tokens, EOD)
    assert torch.equal(positions, ref_positions)
    assert torch.equal(attend, ref_attend)
    assert torch.equal(loss_mask, ref_loss)
    assert DocumentMasks.from_options(EOD, False, False, False) is None
    assert DocumentMasks(EOD, reset_attention_mask=True).of(tokens)[0::2] == (None, None)


def _model(arch: str) -> GPTModel:
    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=60,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(cfg, 64, seed=3).eval()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_other_documents_are_untouched_and_the_loss_is_the_per_document_mean(arch):
    """[doc A, EOD, doc B, EOD, doc C]: with positions and mask reset, changing doc A leaves the logits of B and C
    bitwise as they were; with the EOD loss mask too, the packed loss equals the token mean over the three
    documents each run alone from position 0 (the positions whose input is an EOD left out)."""
    model = _model(arch)
    docs = [torch.tensor([5, 9, 3, 11, 7, EOD]), torch.tensor([21, 4, 4, 30, 2, 17, 8, EOD]),
            torch.tensor([13, 6, 40, 25, 1, 33, 2, 19, 44, 12])]
    sample = torch.cat(docs)  # 24 tokens + one label
    tokens, labels = sample[None, :-1], sample[None, 1:]
    documents = DocumentMasks(EOD, True, True, True)
    positions, mask, loss_mask = documents.of(tokens)
    with torch.no_grad():
        logits = model(tokens, positions=positions, attn_mask=mask)
        changed = tokens.clone()
        changed[0, :5] = torch.tensor([50, 51, 52, 53, 54])
        p2, m2, _ = documents.of(changed)
        logits2 = model(changed, positions=p2, attn_mask=m2)
        assert torch.equal(logits[0, 6:], logits2[0, 6:])
        assert not torch.equal(logits[0, :5], logits2[0, :5])

        packed = masked_mean(model(tokens, labels, positions=positions, attn_mask=mask), loss_mask)
        alone = [model(d[None, :-1], d[None, 1:])[0] for d in (docs[0], docs[1], docs[2])]
        # inside each document the targets are its own next tokens; the packed sample's EOD inputs are masked
        expected = torch.cat(alone).mean()
        assert packed.item() == pytest.approx(expected.item(), rel=1e-6)
        # without the options the documents see each other and the loss differs
        assert model(tokens, labels).mean().item() != pytest.approx(expected.item(), rel=1e-3)


def test_config_refuses_what_it_cannot_run(tmp_path):
    base = ["data.reset_attention_mask=true"]
    with pytest.raises(ConfigError, match=r"data.reset_attention_mask with parallel.pipeline=2: .*parallel.pipeline=1"):
        load_config(ROOT / "configs" / "gpt2_tiny.yaml", [*base, "parallel.pipeline=2", "model.num_layers=2"])
    with pytest.raises(ConfigError, match="packed-document options are for GPT"):
        load_config(ROOT / "configs" / "bert_tiny.yaml", base)
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", [*base, "data.eod_mask_loss=true"])
    assert cfg.data.document_options() == ["reset_attention_mask", "eod_mask_loss"]
