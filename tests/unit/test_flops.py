"""MFU FLOP counts (training.metrics) against torch's FlopCounterMode on the real models at TP=1.

The counter counts matmul FLOPs (mm/addmm/bmm/baddbmm, 2 n k j each) of what the model actually runs;
attention is forced onto SDPA's math backend so its two matmuls (Q K^T, P V) are visible to it (the fused
CPU kernel is not counted). Softmax, LayerNorm, GeLU, dropout, embedding lookups and cross-entropy are not
matmuls, in the counter and in the formulas alike, so with the *actual* number of masked positions of the
batch the formulas must agree with the counter to rounding. The trainer's BERT figure uses the *expected*
masked count (``bert_expected_masked_positions``); on a real batch of the data pipeline it must be within 3 %.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from training.config import load_config
from training.models.config import padded_vocab_size
from training.plan.accounting import (
    bert_expected_masked_positions,
    bert_flops_per_iteration,
    flops_per_iteration,
    model_flops_per_iteration,
)

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = ROOT / ".." / "shared" / "data" / "corpus" / "botchan.txt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Sentence-level BERT corpus of Botchan's first 1,500 lines (documents of 30 lines), spm vocab 1000."""
    from data_pipeline.sentences import split_sentences
    from data_pipeline.tokenizer_train import train_sentencepiece
    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype

    if not BOTCHAN.is_file():
        pytest.skip(f"shared data {BOTCHAN} is absent")
    lines = BOTCHAN.read_text(encoding="utf-8").lstrip("\ufeff").splitlines()[:1500]
    docs = [split_sentences(" ".join(x.strip() for x in lines[i:i + 30])) for i in range(0, len(lines), 30)]
    root = tmp_path_factory.mktemp("flops_corpus")
    tok = train_sentencepiece([" ".join(d) for d in docs], root / "spm", 1000, flavor="bert", lowercase=True)
    with MMapIndexedDatasetBuilder(root / "sent", best_dtype(tok.vocab_size)) as b:
        for d in docs:
            b.add_document([np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(d) if ids])
    return tok, MMapIndexedDataset(root / "sent")


def _count(run) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of ``run()`` (returns the scalar loss) with math-backend attention."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            loss = run()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def test_bert_flops_match_flop_counter(corpus):
    from training.data.bert_data import BertDataset, BertVocab, collate
    from training.models.bert import BertModel, bert_loss
    from training.tasks.bert import masking_config

    tok, indexed = corpus
    cfg = load_config(ROOT / "configs" / "bert_tiny.yaml", ["parallel.tensor=1", f"model.vocab_size={tok.vocab_size}"])
    m, t = cfg.model, cfg.train
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    ds = BertDataset(indexed, np.arange(indexed.num_documents), 4 * t.global_batch_size, m.seq_length,
                     BertVocab.from_tokenizer(tok), masking_config(cfg), cfg.bert.short_seq_prob, cfg.train.seed)
    batch = collate([ds[i] for i in range(t.global_batch_size)])  # one global batch (the trainer's FLOPs unit)
    model = BertModel(m, padded, None, seed=cfg.train.seed).eval()  # dropout off: no effect on matmul FLOPs

    def run():
        lm, sop = model(batch["text"], batch["types"], batch["padding_mask"], batch["labels"], batch["loss_mask"])
        return bert_loss(lm, sop, batch["is_random"])[0]

    fwd, bwd = _count(run)
    assert bwd == 2 * fwd  # backward = gradients of both matmul operands
    counted = fwd + bwd
    b = t.global_batch_size
    real_masked = int(batch["loss_mask"].sum()) / b
    assert 0 < real_masked <= round(cfg.bert.masked_lm_prob * m.seq_length)
    exact = bert_flops_per_iteration(b, m.seq_length, m.num_layers, m.hidden_size, padded, real_masked,
                                     m.ffn_size, m.binary_head)
    assert exact == pytest.approx(counted, rel=1e-9)

    # the trainer's figure (expected masked count): within 3 % of the real batch; the gap is all in the
    # MLM head, 6 B h (h + V) (E[m] - m_batch) (short documents end samples early in this small corpus)
    expected = bert_expected_masked_positions(cfg.bert.masked_lm_prob, cfg.bert.short_seq_prob, m.seq_length)
    trainer = flops_per_iteration(cfg, padded)
    assert trainer == pytest.approx(exact + 6 * b * m.hidden_size * (m.hidden_size + padded) * (expected - real_masked))
    assert trainer == pytest.approx(counted, rel=0.03)
    # the GPT formula (vocabulary projection at every position) overstates this model by far more
    gpt = model_flops_per_iteration(b, m.seq_length, m.num_layers, m.hidden_size, padded, m.ffn_size)
    assert gpt > 1.2 * counted


def test_gpt2_flops_match_flop_counter(corpus):
    from training.models.gpt2 import GPTModel

    tok, indexed = corpus
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", ["parallel.tensor=1", f"model.vocab_size={tok.vocab_size}"])
    m, t = cfg.model, cfg.train
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    stream = np.concatenate([np.asarray(indexed[i]) for i in range(len(indexed))])
    need = t.global_batch_size * (m.seq_length + 1)
    assert len(stream) >= need
    seqs = torch.from_numpy(stream[:need].astype(np.int64)).view(t.global_batch_size, m.seq_length + 1)
    model = GPTModel(m, padded, None, seed=cfg.train.seed).eval()
    fwd, bwd = _count(lambda: model(seqs[:, :-1], seqs[:, 1:]).mean())
    assert bwd == 2 * fwd
    # Narayanan et al. count the full s x s attention matrix; the math backend computes it all (then masks)
    assert flops_per_iteration(cfg, padded) == pytest.approx(fwd + bwd, rel=1e-9)
