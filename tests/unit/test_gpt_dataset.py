"""GPTDataset against brute force (concatenate shuffled documents, slice) and a line-by-line port of
Megatron's C++ ``build_sample_idx``; split arithmetic; caching; corpus manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.tokenizer_train import train_sentencepiece
from megatron_ds_suite.core.corpus import CorpusError, copy_tokenizer_files, load_corpus, write_manifest
from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder
from megatron_ds_suite.core.tokenizer import SentencePieceTokenizer
from tests.helpers.corpora import EOD, make_gpt_corpus
from tests.helpers.megatron_reference import cpp_build_sample_idx, megatron_epochs
from training.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetError,
    build_gpt_datasets,
    num_epochs_for,
    split_boundaries,
)


def brute_force_samples(docs: list[np.ndarray], documents: np.ndarray, num_samples: int, seq_length: int,
                        seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle the epochs' document list, concatenate, cut every seq_length with one overlap; shuffle."""
    tpe = sum(len(docs[d]) for d in documents)
    epochs = megatron_epochs(tpe, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    order = np.array(list(documents) * epochs, dtype=np.int32)
    rng.shuffle(order)
    stream = np.concatenate([docs[d] for d in order]).astype(np.int64)
    m = (epochs * tpe - 1) // seq_length
    samples = np.stack([stream[k * seq_length : k * seq_length + seq_length + 1] for k in range(m)])
    perm = np.arange(m, dtype=np.uint32)
    rng.shuffle(perm)
    return samples, perm


@pytest.mark.parametrize("seq_length,num_samples,empty_every", [(16, 50, 0), (7, 400, 5), (64, 1000, 3), (1, 30, 0)])
def test_samples_equal_brute_force(tmp_path: Path, seq_length: int, num_samples: int, empty_every: int) -> None:
    docs = make_gpt_corpus(tmp_path / "c", 40, seed=seq_length, empty_every=empty_every)
    indexed = MMapIndexedDataset(tmp_path / "c")
    documents = np.arange(5, 35)
    ds = GPTDataset("train", indexed, documents, num_samples, seq_length, seed=1234, cache_dir=tmp_path / "cache")
    samples, perm = brute_force_samples(docs, documents, num_samples, seq_length, 1234)
    assert len(ds) == len(samples) >= num_samples
    np.testing.assert_array_equal(ds.shuffle_idx, perm)
    got = np.stack([ds[i] for i in range(len(ds))])
    assert got.dtype == np.int64 and got.shape == (len(ds), seq_length + 1)
    np.testing.assert_array_equal(got, samples[perm])
    # sample_idx equals Megatron's C++ walk (including zero-length documents)
    ref = cpp_build_sample_idx(indexed.sizes, np.asarray(ds.doc_idx), seq_length, ds.num_epochs, ds.tokens_per_epoch)
    np.testing.assert_array_equal(np.asarray(ds.sample_idx), ref)
    assert ds.doc_idx.dtype == np.int32 and ds.shuffle_idx.dtype == np.uint32
    if seq_length > 1:  # samples do cross documents: some sample holds an EOD before its last token
        assert any((s[:-1] == EOD).any() for s in got)


def test_multiple_epochs_and_epoch_formula(tmp_path: Path) -> None:
    docs = make_gpt_corpus(tmp_path / "c", 10, seed=3)
    tpe = sum(len(d) for d in docs)
    for seq, ns in [(8, 1), (8, 10), (5, 1000), (tpe - 1, 1), (tpe, 1), (tpe + 3, 7)]:
        assert num_epochs_for(tpe, seq, ns) == megatron_epochs(tpe, seq, ns), (seq, ns)
    indexed = MMapIndexedDataset(tmp_path / "c")
    ns = 5 * tpe // 16  # about 5 epochs of 16-token samples
    ds = GPTDataset("train", indexed, np.arange(10), ns, 16, seed=7, cache_dir=tmp_path)
    assert ds.num_epochs == megatron_epochs(tpe, 16, ns) >= 5
    assert np.bincount(np.asarray(ds.doc_idx), minlength=10).tolist() == [ds.num_epochs] * 10
    samples, perm = brute_force_samples(docs, np.arange(10), ns, 16, 7)
    np.testing.assert_array_equal(np.stack([ds[i] for i in range(ns)]), samples[perm[:ns]])


def test_seed_determinism_and_cache_reuse(tmp_path: Path) -> None:
    make_gpt_corpus(tmp_path / "c", 200, seed=1)
    indexed = MMapIndexedDataset(tmp_path / "c")
    docs = np.arange(200)
    a = GPTDataset("train", indexed, docs, 300, 32, seed=11, cache_dir=tmp_path / "a")
    assert a.built_index
    paths = a.index_paths(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in paths.values())
    assert all("c_train_indexmap_300ns_32sl_11s_" in p.name for p in paths.values())
    mtimes = {k: p.stat().st_mtime_ns for k, p in paths.items()}
    a2 = GPTDataset("train", indexed, docs, 300, 32, seed=11, cache_dir=tmp_path / "a")
    assert not a2.built_index
    assert {k: p.stat().st_mtime_ns for k, p in paths.items()} == mtimes
    assert isinstance(a2.doc_idx, np.memmap)
    b = GPTDataset("train", indexed, docs, 300, 32, seed=11, cache_dir=tmp_path / "b")  # fresh build, same seed
    assert b.built_index
    for k in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    np.testing.assert_array_equal(np.stack([a[i] for i in range(50)]), np.stack([a2[i] for i in range(50)]))
    c = GPTDataset("train", indexed, docs, 300, 32, seed=12, cache_dir=tmp_path / "b")
    assert c.built_index
    assert not np.array_equal(np.asarray(a.doc_idx), np.asarray(c.doc_idx))
    assert not np.array_equal(np.stack([a[i] for i in range(50)]), np.stack([c[i] for i in range(50)]))
    # a different document range never reuses the cache (digest in the file name)
    d = GPTDataset("train", indexed, docs[:150], 300, 32, seed=11, cache_dir=tmp_path / "a")
    assert d.built_index
    # pickling (DataLoader workers) re-opens the cached maps instead of copying them
    import pickle

    blob = pickle.dumps(a)
    assert len(blob) < 20_000
    a3 = pickle.loads(blob)
    assert isinstance(a3.sample_idx, np.memmap) and len(a3) == len(a)
    np.testing.assert_array_equal(a3[17], a[17])
    # default cache location: next to the dataset
    e = GPTDataset("valid", indexed, docs, 10, 32, seed=11, cache_dir=None)
    assert all(p.parent == tmp_path for p in e.index_paths().values()) and e.built_index


@pytest.mark.parametrize("kind", ["doc", "sample", "shuffle"])
@pytest.mark.parametrize("zeroed", ["whole file", "array data"])
def test_a_zeroed_index_cache_file_is_rebuilt_not_used(tmp_path: Path, caplog, kind: str, zeroed: str) -> None:
    """A cache file zeroed by a crash or a bad copy (all bytes, or the array after an intact .npy header) was
    used as is (shuffle_idx all 0: every sample the same) or failed later with an AssertionError; it is now
    detected on load, rebuilt with one warning, and the samples are the original ones."""
    make_gpt_corpus(tmp_path / "c", 200, seed=1)
    indexed = MMapIndexedDataset(tmp_path / "c")
    a = GPTDataset("train", indexed, np.arange(200), 300, 32, seed=11, cache_dir=tmp_path / "a")
    want = np.stack([a[i] for i in range(len(a))])
    path = a.index_paths(tmp_path / "a")[kind]
    raw = path.read_bytes()
    keep = 0 if zeroed == "whole file" else len(raw) - np.load(path).nbytes
    path.write_bytes(raw[:keep] + b"\0" * (len(raw) - keep))
    with caplog.at_level("WARNING", logger="training.data.gpt_dataset"):
        b = GPTDataset("train", indexed, np.arange(200), 300, 32, seed=11, cache_dir=tmp_path / "a")
    assert b.built_index and path.read_bytes() == raw
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "are damaged" in warnings[0] and "rebuilding" in warnings[0]
    np.testing.assert_array_equal(np.stack([b[i] for i in range(len(b))]), want)
    c = GPTDataset("train", indexed, np.arange(200), 300, 32, seed=11, cache_dir=tmp_path / "a")
    assert not c.built_index  # the rebuilt set is accepted as is


def test_split_boundaries_match_megatron() -> None:
    def megatron(splits_string: str, size: int) -> list[int]:
        splits = [float(s) for s in splits_string.split(",")]
        while len(splits) < 3:
            splits.append(0.0)
        splits = splits[:3]
        splits = [s / sum(splits) for s in splits]
        idx = [0]
        for i, s in enumerate(splits):
            idx.append(idx[i] + int(round(s * float(size))))
        diff = idx[-1] - size
        for i in range(1, len(idx)):
            idx[i] -= diff
        return idx

    for split, size in [("969,30,1", 1000), ("969,30,1", 123_457), ("949,50,1", 10), ("1,1,1", 2), ("8,1,1", 7),
                        ("100", 5), ("98,2", 1234)]:
        assert split_boundaries(split, size) == megatron(split, size), (split, size)
    assert split_boundaries("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_boundaries("969/30/1", 1000) == [0, 969, 999, 1000]
    for bad in ("a,b", "1,-1,0", "0,0,0", "1,2,3,4", ""):
        with pytest.raises(GPTDatasetError):
            split_boundaries(bad, 10)


def test_build_gpt_datasets_splits_and_empty_split(tmp_path: Path) -> None:
    docs = make_gpt_corpus(tmp_path / "c", 100, seed=5)
    tr, va, te = build_gpt_datasets(tmp_path / "c", "90,10,0", (200, 20, 5), 16, seed=3, cache_dir=tmp_path / "ix")
    assert te is None and tr is not None and va is not None
    np.testing.assert_array_equal(tr.documents, np.arange(90))
    np.testing.assert_array_equal(va.documents, np.arange(90, 100))
    samples, perm = brute_force_samples(docs, np.arange(90, 100), 20, 16, 3)
    np.testing.assert_array_equal(np.stack([va[i] for i in range(len(va))]), samples[perm])
    tr0, _, _ = build_gpt_datasets(tmp_path / "c", "90,10,0", (0, 20, 0), 16, seed=3, cache_dir=tmp_path / "ix")
    assert tr0 is None
    with pytest.raises(GPTDatasetError, match="three"):
        build_gpt_datasets(tmp_path / "c", "90,10,0", (1, 2), 16, seed=3)  # type: ignore[arg-type]


def test_zero_token_split_and_bad_requests(tmp_path: Path) -> None:
    with MMapIndexedDatasetBuilder(tmp_path / "z", np.uint16) as b:
        for _ in range(10):
            b.add_item(np.zeros(0, dtype=np.int64))
            b.end_document()
        for _ in range(10):
            b.add_item([1, 2, 3, EOD])
            b.end_document()
    indexed = MMapIndexedDataset(tmp_path / "z")
    with pytest.raises(GPTDatasetError, match="0 tokens"):
        GPTDataset("train", indexed, np.arange(10), 5, 8, seed=1, cache_dir=tmp_path)
    with pytest.raises(GPTDatasetError, match="no documents"):
        GPTDataset("train", indexed, np.arange(0), 5, 8, seed=1, cache_dir=tmp_path)
    with pytest.raises(GPTDatasetError, match="num_samples"):
        GPTDataset("train", indexed, np.arange(20), 0, 8, seed=1, cache_dir=tmp_path)
    with pytest.raises(GPTDatasetError, match="outside"):
        GPTDataset("train", indexed, np.arange(15, 25), 5, 8, seed=1, cache_dir=tmp_path)
    with pytest.raises(GPTDatasetError, match="epochs"):
        GPTDataset("train", indexed, np.arange(20), 10**12, 1024, seed=1, cache_dir=tmp_path)
    tr, va, te = build_gpt_datasets(tmp_path / "z", "50,50,0", (5, 5, 0), 8, seed=1, cache_dir=tmp_path)
    assert tr is None and va is not None and te is None  # the first 10 documents are all empty
    with MMapIndexedDatasetBuilder(tmp_path / "e", np.uint16):
        pass
    with pytest.raises(GPTDatasetError, match="no tokens"):
        build_gpt_datasets(tmp_path / "e", "1,0,0", (5, 0, 0), 8, seed=1)


def test_bert_layout_split_follows_documents(tmp_path: Path) -> None:
    """With one item per sentence, splits are contiguous document ranges expanded to their sentences."""
    from training.data.gpt_dataset import split_documents

    with MMapIndexedDatasetBuilder(tmp_path / "s", np.uint16) as b:
        for k in range(10):
            for _ in range(k % 3 + 1):
                b.add_item([k, k])
            b.end_document()
    indexed = MMapIndexedDataset(tmp_path / "s")
    tr, va, te = split_documents(indexed, "8,2,0")
    assert {int(indexed[i][0]) for i in tr} == set(range(8))
    assert {int(indexed[i][0]) for i in va} == {8, 9}
    assert len(te) == 0 and len(tr) + len(va) == len(indexed)


def _sp_tokenizer(tmp_path: Path) -> SentencePieceTokenizer:
    text = "\n".join(f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300))
    return train_sentencepiece([text], tmp_path / "tok" / "sp", 300, flavor="gpt")


def test_corpus_manifest_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    tok = _sp_tokenizer(tmp_path)
    with pytest.raises(CorpusError, match="has no corpus.json: build it with python -m data_pipeline build"):
        load_corpus(root)
    make_gpt_corpus(root / "gpt_text_document", 20)
    spec = copy_tokenizer_files(tok.spec(), root)
    with pytest.raises(CorpusError, match="do not exist"):
        write_manifest(root, spec, "gpt_text_document", "missing_sentence", {})
    write_manifest(root, spec, str(root / "gpt_text_document"), None, {"documents": 20, "split": "969,30,1"})
    manifest = json.loads((root / "corpus.json").read_text())
    assert manifest["gpt_prefix"] == "gpt_text_document" and manifest["bert_prefix"] is None
    assert manifest["tokenizer"]["model_file"] == "tokenizer/sp.model"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    # the directory is movable: everything is relative to root
    moved = tmp_path / "moved"
    root.rename(moved)
    (tmp_path / "tok" / "sp.model").unlink()
    c = load_corpus(moved)
    assert c.gpt_prefix == (moved / "gpt_text_document").resolve() and c.bert_prefix is None
    assert c.extra == {"documents": 20, "split": "969,30,1"}
    assert c.tokenizer.encode("the lazy dog") == tok.encode("the lazy dog")
    assert len(c.gpt_dataset()) == 20
    with pytest.raises(CorpusError, match="no BERT dataset"):
        c.bert_dataset()
    (moved / "gpt_text_document.bin").unlink()
    with pytest.raises(CorpusError, match="missing"):
        load_corpus(moved)
    (moved / "corpus.json").write_text("{not json")
    with pytest.raises(CorpusError, match="not valid JSON"):
        load_corpus(moved)
