"""BERT samples on real text: masking statistics, whole words, n-grams, SOP pairs, skipping, determinism."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from training.data.bert_data import (
    BertDataError,
    BertDataset,
    BertVocab,
    MaskingConfig,
    build_samples_mapping,
    word_units,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
BOTCHAN = DATA / "corpus" / "botchan.txt"
SEQ = 128
LINES_PER_DOC = 30


def _documents() -> list[list[str]]:
    """Botchan in documents of 30 lines, split into sentences; every 7th document keeps one sentence only
    (to exercise the skip), and one document is empty."""
    from data_pipeline.sentences import split_sentences

    if not BOTCHAN.is_file():
        pytest.skip(f"shared data {BOTCHAN} is absent")
    lines = BOTCHAN.read_text(encoding="utf-8").lstrip("\ufeff").splitlines()
    docs = []
    for k, i in enumerate(range(0, len(lines), LINES_PER_DOC)):
        sents = split_sentences(" ".join(x.strip() for x in lines[i:i + LINES_PER_DOC]))
        docs.append(sents[:1] if k % 7 == 3 else sents)
    docs.insert(5, [])
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from data_pipeline.tokenizer_train import train_sentencepiece
    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype

    docs = _documents()
    root = tmp_path_factory.mktemp("bert_corpus")
    tok = train_sentencepiece([" ".join(d) for d in docs], root / "spm", 2000, flavor="bert", lowercase=True)
    with MMapIndexedDatasetBuilder(root / "sent", best_dtype(tok.vocab_size)) as b:
        for d in docs:
            b.add_document([np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(d) if ids])
    return tok, MMapIndexedDataset(root / "sent"), docs


@pytest.fixture(scope="module")
def dataset(corpus):
    tok, ds, _ = corpus
    vocab = BertVocab.from_tokenizer(tok)
    docs = np.arange(ds.num_documents)
    return BertDataset(ds, docs, 1500, SEQ, vocab, MaskingConfig(), 0.1, seed=1234)


@pytest.fixture(scope="module")
def samples(dataset):
    return [dataset[i] for i in range(1500)]


def test_masking_statistics(dataset, samples):
    vocab = dataset.vocab
    n_tok = n_masked = n_mask_id = n_same = n_random = 0
    for s in samples:
        real = int(s["padding_mask"].sum())
        orig = s["original"]
        lab = s["labels"][:real]
        sel = lab >= 0
        assert np.array_equal(lab[sel], orig[sel])                           # labels are the original ids
        assert not np.isin(orig[sel], [vocab.cls, vocab.sep]).any()          # never [CLS]/[SEP]
        assert np.array_equal(s["loss_mask"][:real], sel.astype(np.int64)) and s["loss_mask"][real:].sum() == 0
        n_tok += real
        n_masked += int(sel.sum())
        got = s["text"][:real][sel]
        n_mask_id += int((got == vocab.mask).sum())
        n_same += int((got == orig[sel]).sum())
        n_random += int(((got != vocab.mask) & (got != orig[sel])).sum())
        # every position not predicted is unchanged
        assert np.array_equal(s["text"][:real][~sel], orig[~sel])
    frac = n_masked / n_tok
    # Megatron's budget: min(0.15 x target (a float cap: 18.75 at length 128), round(0.15 L)) per sample, whole
    # words may fall short: 14.1 % here (round(0.15 L) alone, without the cap, gives 14.9 %)
    assert 0.135 <= frac <= 0.145, frac
    assert abs(n_mask_id / n_masked - 0.8) < 0.015, n_mask_id / n_masked
    assert abs(n_same / n_masked - 0.1) < 0.015, n_same / n_masked   # (a random id equal to the original counts here)
    assert abs(n_random / n_masked - 0.1) < 0.015, n_random / n_masked


def test_whole_words_never_split_and_ngram_lengths(dataset, samples):
    vocab = dataset.vocab
    spans, draws = Counter(), Counter()
    multi_piece_words = 0
    for s in samples:
        real = int(s["padding_mask"].sum())
        orig = s["original"]
        special = np.isin(orig, [vocab.cls, vocab.sep])
        sel = s["labels"][:real] >= 0
        for unit in word_units(orig, s["types"][:real], special, vocab.word_start, True):
            multi_piece_words += len(unit) > 1
            assert sel[unit].all() or not sel[unit].any(), "a word was partly masked"
            # a unit is a word: first piece starts a word (or follows a special token), the rest continue it
            assert all(not vocab.word_start[orig[i]] for i in unit[1:])
        spans.update(s["spans"])
        draws.update(s["draws"])
    assert multi_piece_words > 1000  # the check above is not vacuous
    # drawn n-gram lengths: p(n) ∝ 1/n = (6, 3, 2) / 11
    total = sum(draws.values())
    assert total > 10000
    p_draw = np.array([draws[n] / total for n in (1, 2, 3)])
    np.testing.assert_allclose(p_draw, np.array([6, 3, 2]) / 11, atol=0.015)
    # masked spans: the budget and overlaps cut long spans more often, so shorter n gain mass
    total = sum(spans.values())
    p = np.array([spans[n] / total for n in (1, 2, 3)])
    assert set(spans) <= {1, 2, 3}
    assert p[0] > p[1] > p[2] > 0.08, p
    assert p[0] >= p_draw[0] and p[2] <= p_draw[2], (p, p_draw)


def test_sop_balanced_and_pairs_from_one_document(corpus, dataset, samples):
    tok, ds, _ = corpus
    vocab = dataset.vocab
    labels = np.array([int(s["is_random"]) for s in samples])
    assert abs(labels.mean() - 0.5) < 0.04, labels.mean()
    doc_of = np.searchsorted(ds.doc_idx, np.arange(len(ds)), side="right") - 1
    checked = 0
    for i, s in enumerate(samples):
        start, end, target = (int(x) for x in dataset.mapping[i])
        assert end - start >= 2 and doc_of[start] == doc_of[end - 1]        # >= 2 sentences of one document
        orig = s["original"]
        seps = np.flatnonzero(orig == vocab.sep)
        assert orig[0] == vocab.cls and len(seps) == 2 and seps[1] == len(orig) - 1
        assert np.array_equal(s["types"][:len(orig)], (np.arange(len(orig)) > seps[0]).astype(np.int64))
        a, b = orig[1:seps[0]].tolist(), orig[seps[0] + 1:seps[1]].tolist()
        assert a and b and len(a) + len(b) <= min(target, SEQ - 3)
        if not s["truncated"]:
            sents = [ds[j].tolist() for j in range(start, end)]
            first, second = (b, a) if s["is_random"] else (a, b)
            joined = [t for x in sents for t in x]
            assert first + second == joined
            # the A/B boundary is a sentence boundary
            assert len(first) in np.cumsum([len(x) for x in sents]).tolist()
            checked += 1
    assert checked > 200


def test_short_documents_skipped_and_counted(corpus, dataset):
    _, ds, docs = corpus
    expected = sum(len([x for x in d if x.strip()]) < 2 for d in docs)
    assert expected >= 5
    assert dataset.stats.skipped_short_documents == expected
    assert dataset.stats.documents == len(docs)
    used = {int(np.searchsorted(ds.doc_idx, s, side="right") - 1) for s in dataset.mapping[:, 0]}
    assert all(ds.doc_idx[d + 1] - ds.doc_idx[d] >= 2 for d in used)
    # short-sequence targets with probability ~0.1 (every document is longer than one target here)
    short = (dataset.mapping[:, 2] < SEQ - 3).mean()
    assert 0.05 < short < 0.16, short


def test_no_sentence_boundaries_is_a_clear_error():
    doc_idx = np.arange(11)  # 10 documents of one item each: a document-level (GPT) dataset
    sizes = np.full(10, 50)
    with pytest.raises(BertDataError, match="two or more sentences"):
        build_samples_mapping(doc_idx, sizes, np.arange(10), 10, SEQ, 0.1, 1)


def test_deterministic_per_sample(corpus, dataset):
    tok, ds, _ = corpus
    again = BertDataset(ds, np.arange(ds.num_documents), 1500, SEQ, dataset.vocab, MaskingConfig(), 0.1, seed=1234)
    for i in (7, 3, 1499, 7):
        a, b = dataset[i], again[i]
        for k in ("text", "types", "labels", "loss_mask", "padding_mask"):
            assert np.array_equal(a[k], b[k])
        assert a["is_random"] == b["is_random"]
    other = BertDataset(ds, np.arange(ds.num_documents), 1500, SEQ, dataset.vocab, MaskingConfig(), 0.1, seed=99)
    assert not all(np.array_equal(dataset[i]["text"], other[i]["text"]) for i in range(5))


def test_vocabulary_without_special_tokens_is_rejected(tmp_path):
    from data_pipeline.tokenizer_train import train_sentencepiece

    if not BOTCHAN.is_file():
        pytest.skip(f"shared data {BOTCHAN} is absent")
    gpt = train_sentencepiece([BOTCHAN.read_text(encoding="utf-8")[:60000]], tmp_path / "g", 400, flavor="gpt")
    with pytest.raises(BertDataError, match=r"lacks \[CLS\], \[SEP\], \[MASK\], \[PAD\].*tokenizer.flavor=bert"):
        BertVocab.from_tokenizer(gpt)


@pytest.mark.parametrize("damage", ["zeroed file", "zeroed mapping"])
def test_a_damaged_samples_mapping_cache_is_rebuilt_not_used(corpus, dataset, tmp_path, caplog, damage):
    """The cached samples mapping (.npz) zeroed whole was a BadZipFile traceback; its mapping array zeroed (rows
    (0, 0, 0)) was used as is. Now it is rebuilt with one warning and the samples are the original ones."""
    import zipfile

    tok, ds, _ = corpus
    docs = np.arange(ds.num_documents)
    first = BertDataset(ds, docs, 300, SEQ, dataset.vocab, MaskingConfig(), 0.1, seed=1234, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    if damage == "zeroed file":
        path.write_bytes(b"\0" * path.stat().st_size)
    else:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["mapping"] = np.zeros_like(arrays["mapping"])
        with zipfile.ZipFile(path, "w") as zf:  # same layout as np.savez writes
            for k, v in arrays.items():
                with zf.open(f"{k}.npy", "w") as f:
                    np.lib.format.write_array(f, v)
    with caplog.at_level("WARNING", logger="training.data.bert_data"):
        again = BertDataset(ds, docs, 300, SEQ, dataset.vocab, MaskingConfig(), 0.1, seed=1234, cache_dir=tmp_path)
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.levelname == "WARNING"] == [
        f"cached BERT train samples mapping {path} is damaged"]
    np.testing.assert_array_equal(again.mapping, first.mapping)
    assert all(np.array_equal(again[i]["text"], first[i]["text"]) for i in range(0, 300, 29))
