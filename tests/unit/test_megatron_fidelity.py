"""Megatron-LM fidelity, pinned to the number: LR schedule, init, weight-decay groups, vocabulary
padding and ftfy's effect on the cleaned text.

Each reference here is written independently from Megatron's definitions (``megatron/learning_rates.py``
``AnnealingLR`` after the late-2020 fix, HEAD ``OptimizerParamScheduler``; ``megatron/model/utils.py``
init methods; ``get_params_for_weight_decay_optimization``; ``_vocab_size_with_padding``), not from the
code under test.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers.megatron_reference import megatron_lrs
from training.config import OptimizerConfig
from training.models.config import ModelConfig, padded_vocab_size
from training.optim.adamw import build_optimizer, param_groups
from training.optim.lr_schedule import lr_at

# --------------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------------
SCHEDULES = [
    dict(lr=1.5e-4, min_lr=1e-5, warmup_iters=4, decay_iters=20, decay_style="cosine"),
    dict(lr=1e-4, min_lr=1e-5, warmup_iters=3, decay_iters=15, decay_style="linear"),
    dict(lr=2e-3, min_lr=0.0, warmup_iters=0, decay_iters=None, decay_style="cosine"),
    dict(lr=1e-3, min_lr=1e-4, warmup_iters=5, decay_iters=None, decay_style="constant"),
    dict(lr=1e-3, min_lr=1e-4, warmup_iters=1, decay_iters=8, decay_style="linear"),
]


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: f"{s['decay_style']}-w{s['warmup_iters']}")
def test_lr_schedule_is_megatrons_annealing_lr(sched):
    """The torch optimizer + scheduler pair handed to DeepSpeed, stepped as DeepSpeed steps it (scheduler
    after optimizer), runs every update at Megatron's rate: the first at 0 during warmup, max_lr at update
    W + 1, min_lr after the decay (past ``decay_iters``)."""
    iters = 24
    cfg = OptimizerConfig(**sched)
    model = nn.Linear(3, 2)
    opt, lr_sched = build_optimizer(model, cfg, iters)
    ours = []
    for _ in range(iters):
        ours.append(float(opt.param_groups[0]["lr"]))  # the device rate every group reads
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        lr_sched.step()
    ref = megatron_lrs(cfg, iters)
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert [lr_at(i, cfg, iters) for i in range(iters)] == pytest.approx(ref, rel=1e-12, abs=1e-15)
    if cfg.warmup_iters:
        assert ours[0] == 0.0 and ours[cfg.warmup_iters] == pytest.approx(cfg.lr)
    if cfg.decay_iters is not None and cfg.decay_style != "constant":
        assert ours[cfg.decay_iters + 1:] == [cfg.min_lr] * (iters - cfg.decay_iters - 1)


def test_lr_schedule_numbers():
    """A few values by hand: lr 1.5e-4, min 1e-5, warmup 4, cosine decay to update 20."""
    cfg = OptimizerConfig(lr=1.5e-4, min_lr=1e-5, warmup_iters=4, decay_iters=20, decay_style="cosine")
    assert [lr_at(i, cfg, 30) for i in range(5)] == pytest.approx([0.0, 3.75e-5, 7.5e-5, 1.125e-4, 1.5e-4])
    # halfway through the decay (n = 12): min + (max - min) / 2
    assert lr_at(12, cfg, 30) == pytest.approx(8e-5)
    assert lr_at(20, cfg, 30) == pytest.approx(1e-5) and lr_at(21, cfg, 30) == 1e-5


# --------------------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------------------
STD = 0.02


def _std_ok(t: torch.Tensor, std: float, rel: float = 0.03) -> bool:
    """Sample std within ``rel`` of ``std`` and mean ~0 (thousands of samples: error well under 1%)."""
    t = t.detach().double()
    return abs(t.std().item() / std - 1.0) < rel and abs(t.mean().item()) < 4 * std / math.sqrt(t.numel())


def _expected_std(name: str, num_layers: int) -> float | None:
    """Megatron: N(0, 0.02) everywhere, N(0, 0.02 / sqrt(2L)) for the output projection of each residual
    branch (attention ``dense`` and ``dense_4h_to_h``); None for parameters that are not drawn."""
    if name.endswith("bias") or ".ln" in name or "ln." in name or name.startswith(("final_ln", "embedding_ln")):
        return None
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        return STD / math.sqrt(2 * num_layers)
    return STD


def _check_init(model: nn.Module, num_layers: int) -> int:
    drawn = 0
    for name, p in model.named_parameters():
        std = _expected_std(name, num_layers)
        if std is None:
            if name.endswith("bias"):
                assert torch.count_nonzero(p) == 0, f"{name}: bias not zero"
            else:  # LayerNorm weight 1, bias 0
                assert torch.equal(p, torch.ones_like(p)), f"{name}: LayerNorm weight not 1"
            continue
        assert _std_ok(p, std), f"{name}: std {p.detach().double().std().item():.5f}, expected {std:.5f}"
        drawn += 1
    return drawn


def test_gpt2_init_std_and_scaled_residual_projections():
    layers = 4  # 0.02 / sqrt(8) = 0.00707
    cfg = ModelConfig(num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=1000)
    assert cfg.init_method_std == STD
    from training.models.gpt2 import GPTModel

    model = GPTModel(cfg, 1024, seed=3)
    # embedding + position + per layer (qkv, attn.proj, fc, mlp.proj)
    assert _check_init(model, layers) == 2 + 4 * layers
    proj = model.layers[2].attn.proj.weight
    assert abs(proj.double().std().item() - STD / math.sqrt(2 * layers)) < 2e-4


def test_bert_init_std_and_scaled_residual_projections():
    from training.models.bert import BertModel

    layers = 3
    cfg = ModelConfig(arch="bert", num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=64,
                      vocab_size=1000)
    model = BertModel(cfg, 1024, seed=5)
    # word, position, tokentype embeddings; 4 per layer; lm_head.dense, pooler, binary_head
    assert _check_init(model, layers) == 3 + 4 * layers + 3


# --------------------------------------------------------------------------------------------------
# Weight-decay groups
# --------------------------------------------------------------------------------------------------
def _exempt(model: nn.Module) -> set[str]:
    """Megatron's rule: every LayerNorm parameter and every parameter named ``bias`` get no decay."""
    norms = {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if isinstance(m, nn.LayerNorm)
             for pn, _ in m.named_parameters(recurse=False)}
    return norms | {n for n, _ in model.named_parameters() if n.endswith("bias")}


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_weight_decay_exempts_biases_and_layernorm(arch):
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel

    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=100,
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = (GPTModel if arch == "gpt2" else BertModel)(cfg, 128, seed=1)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: ({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in param_groups(model, 0.01)}
    exempt = _exempt(model)
    assert groups["no_decay"] == (exempt, 0.0)
    assert groups["decay"] == (set(names.values()) - exempt, 0.01)
    assert "embedding.word_embeddings.weight" in groups["decay"][0]  # embeddings are decayed

    # and the optimizer applies it: with zero gradients AdamW's update is the decay alone,
    # w <- w (1 - lr wd) for decayed weights; biases and LayerNorm stay exactly as they were
    ocfg = OptimizerConfig(lr=0.1, min_lr=0.0, weight_decay=0.5, warmup_iters=0, decay_style="constant")
    opt, _ = build_optimizer(model, ocfg, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] if n in exempt else before[n] * (1 - 0.1 * 0.5)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=n)


# --------------------------------------------------------------------------------------------------
# Vocabulary padding (the table of the Megatron-LM paper)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,padded", [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_gpt2_vocabulary_padding_table(tp, padded):
    divisible_by = ModelConfig().make_vocab_size_divisible_by
    assert divisible_by == 128
    assert padded_vocab_size(50257, divisible_by, tp) == padded
    # Megatron's loop, written out: grow until divisible by 128 x TP
    after = 50257
    while after % (divisible_by * tp):
        after += 1
    assert after == padded


# --------------------------------------------------------------------------------------------------
# ftfy in the cleaning stage
# --------------------------------------------------------------------------------------------------
FTFY_CASES = [
    # UTF-8 read as Windows-1252 (mojibake)
    ("The cafÃ© served crÃ¨me brÃ»lÃ©e.", "The café served crème brûlée."),
    ("â€œQuotedâ€\x9d and itâ€™s fine", '"Quoted" and it\'s fine'),
    # HTML entities in text without tags
    ("Fish &amp; chips &lt;3 &quot;yes&quot;", 'Fish & chips <3 "yes"'),
    # latin ligatures and full-width letters
    ("The ﬁrst ﬂoor ofﬁce", "The first floor office"),
    ("ＡＢＣ１２３", "ABC123"),
]


@pytest.mark.parametrize("raw,fixed", FTFY_CASES)
def test_cleaning_applies_ftfy(raw, fixed):
    from data_pipeline.clean import clean_text

    assert clean_text(raw) == fixed
    assert clean_text(raw, use_ftfy=False) == raw  # the switch really is what changes it


def test_ingest_stage_writes_ftfy_fixed_text(tmp_path):
    """Through the ingest stage's shard worker, as ``python -m data_pipeline build`` runs it."""
    from data_pipeline.sources import RawRecord
    from data_pipeline.stages.ingest import IngestJob, ingest_shard
    from data_pipeline.store import iter_shard

    recs = [RawRecord(f"t:{i}", raw) for i, (raw, _) in enumerate(FTFY_CASES)]
    ingest_shard(IngestJob(str(tmp_path), 0, recs, 0, ftfy=True, normalize_whitespace=True, split=None,
                           count_words=False))
    assert [d["text"] for d in iter_shard(tmp_path, 0)] == [fixed for _, fixed in FTFY_CASES]


# --------------------------------------------------------------------------------------------------
# BERT masking budget
# --------------------------------------------------------------------------------------------------
def _single_piece_vocab(size: int = 500):
    """Every ordinary piece is a whole word, so the budget (not word boundaries) decides the count."""
    import numpy as np

    from training.data.bert_data import BertVocab

    return BertVocab(cls=1, sep=2, mask=3, pad=0, word_start=np.ones(size, dtype=bool), random_ids=np.arange(5, size))


@pytest.mark.parametrize("target,real_len,predicted", [(125, 128, 18), (50, 53, 7)])
def test_bert_masking_budget_is_megatrons_float_cap(target, real_len, predicted):
    """Megatron: num_to_predict = min(masked_lm_prob * max_num_tokens, max(1, round(masked_lm_prob * len))),
    the cap a float. Full samples at max_seq_length 128: cap 0.15 x 125 = 18.75 -> 18 predictions
    (round(0.15 x 128) = 19 without the cap); a short target of 50: cap 7.5 -> 7 (round(7.95) = 8)."""
    import numpy as np

    from training.data.bert_data import MaskingConfig, build_sample

    vocab = _single_piece_vocab()
    cfg = MaskingConfig()
    assert 0.15 * target < round(0.15 * real_len)  # the cap is what binds
    counts = []
    for seed in range(40):
        rng = np.random.RandomState(seed)
        sentences = [rng.randint(5, 500, size=40) for _ in range(5)]
        s = build_sample(sentences, target, 128, vocab, cfg, np.random.RandomState(seed))
        assert int(s["padding_mask"].sum()) == real_len
        counts.append(int((s["labels"] >= 0).sum()))
    assert counts == [predicted] * 40
    assert predicted / real_len == pytest.approx(0.15 * target // 1 / real_len)


# --------------------------------------------------------------------------------------------------
# GPT sample order: Megatron 2021's separate last epoch
# --------------------------------------------------------------------------------------------------
def megatron2021_index_maps(documents, sizes, num_samples: int, seq_length: int, seed: int):
    """Port of Megatron 2021 ``gpt_dataset._build_index_mappings`` (doc, sample, shuffle index maps)."""
    import numpy as np

    from tests.helpers.megatron_reference import cpp_build_sample_idx, megatron_epochs

    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = megatron_epochs(tokens_per_epoch, seq_length, num_samples)
    if num_epochs == 1:
        separate_last_epoch = False
    else:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_num_samples = num_samples - from_epochs_minus_one
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= last_epoch_num_samples < per_epoch + 1
        separate_last_epoch = last_epoch_num_samples < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed=seed)

    def doc_idx_of(epochs, separate):
        if not separate or epochs == 1:
            d = np.mgrid[0:epochs, 0:len(documents)][1]
            d[:] = documents
            d = d.reshape(-1).astype(np.int32)
            rng.shuffle(d)
            return d
        return np.concatenate((doc_idx_of(epochs - 1, False), doc_idx_of(1, False)))

    doc_idx = doc_idx_of(num_epochs, separate_last_epoch)
    sample_idx = cpp_build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    n = from_epochs_minus_one if separate_last_epoch else total
    first = np.arange(0, n, dtype=np.uint32)
    rng.shuffle(first)
    if n == total:
        return doc_idx, sample_idx, first, separate_last_epoch
    last = np.arange(n, total, dtype=np.uint32)
    rng.shuffle(last)
    return doc_idx, sample_idx, np.concatenate((first, last)), separate_last_epoch


@pytest.mark.parametrize("extra_fraction,separated", [(0.1, True), (0.5, True), (0.9, False), (None, False)])
def test_gpt_separate_last_epoch_matches_megatron_2021(tmp_path, extra_fraction, separated):
    """``separate_last_epoch=True`` builds exactly Megatron 2021's index maps: when the last of E > 1 epochs
    supplies < 80 % of an epoch's samples it is shuffled apart (doc_idx and shuffle_idx); otherwise (and
    with one epoch) the order is Megatron 2020's, the default."""
    import numpy as np

    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
    from tests.helpers.corpora import make_gpt_corpus
    from training.data.gpt_dataset import GPTDataset

    make_gpt_corpus(tmp_path / "c", 40, seed=3)
    indexed = MMapIndexedDataset(tmp_path / "c")
    documents = np.arange(3, 37)
    seq = 16
    per_epoch = (int(indexed.sizes[documents].sum()) - 1) // seq
    # one epoch (None) or two epochs whose second supplies `extra_fraction` of an epoch's samples
    num_samples = per_epoch - 2 if extra_fraction is None else per_epoch + int(extra_fraction * per_epoch)
    doc_ref, sample_ref, shuffle_ref, sep = megatron2021_index_maps(documents, indexed.sizes, num_samples, seq, 7)
    assert sep == separated
    ds = GPTDataset("train", indexed, documents, num_samples, seq, 7, cache_dir=tmp_path / "cache",
                    separate_last_epoch=True)
    np.testing.assert_array_equal(np.asarray(ds.doc_idx), doc_ref)
    np.testing.assert_array_equal(np.asarray(ds.sample_idx), sample_ref)
    np.testing.assert_array_equal(np.asarray(ds.shuffle_idx), shuffle_ref)
    default = GPTDataset("train", indexed, documents, num_samples, seq, 7, cache_dir=tmp_path / "cache")
    same = np.array_equal(np.asarray(default.shuffle_idx), shuffle_ref)
    assert same != separated  # the option changes the order exactly when Megatron 2021 separates
    if separated:
        # the first M1 = ((E-1) T - 1) // L samples in training order are those of the first E - 1 epochs
        assert ds.first_epochs_samples == per_epoch
        assert sorted(np.asarray(ds.shuffle_idx)[:per_epoch].tolist()) == list(range(per_epoch))
