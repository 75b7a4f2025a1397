"""Megatron-Core's own data code (the ``megatron-core==0.16.1`` wheel of the test extra, run in-process) reads what
this project writes: its ``IndexedDataset`` reads our ``.bin/.idx`` back to the same token ids, sequence lengths and
document indices; its ``GPTDataset`` builds the same doc/sample/shuffle index maps as ours (Megatron's 2021
``_build_index_mappings`` with the short last epoch shuffled apart, ``separate_last_epoch=True``, what
``data.prefixes`` uses), loads our cached ``.npy`` maps, and serves the same samples."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder
from tests.helpers.corpora import EOD, make_gpt_corpus
from tests.helpers.megatron_reference import megatron_core_datasets_dir, megatron_core_gpt_dataset
from training.data.gpt_dataset import build_gpt_datasets


def _sentence_corpus(prefix: Path, dtype, vocab: int, seed: int) -> list[list[np.ndarray]]:
    """A BERT-style corpus (several items per document, an empty document every 9th) written by our builder."""
    rng = np.random.default_rng(seed)
    docs = []
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for k in range(60):
            doc = [] if k % 9 == 4 else [rng.integers(0, vocab, rng.integers(1, 30)) for _ in range(rng.integers(1, 5))]
            for item in doc:
                b.add_item(item)
            b.end_document()
            docs.append(doc)
    return docs


CORPORA = {
    "gpt_uint16": lambda p: [[d] for d in make_gpt_corpus(p, 150, seed=5, empty_every=13)],
    "sentences_uint16": lambda p: _sentence_corpus(p, np.uint16, 50_257, 1),
    "sentences_int32": lambda p: _sentence_corpus(p, np.int32, 250_000, 2),
}


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "file"])
@pytest.mark.parametrize("corpus", list(CORPORA))
def test_megatron_core_indexed_dataset_reads_our_bin_idx(corpus, mmap, tmp_path):
    megatron_core_datasets_dir()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / corpus
    docs = CORPORA[corpus](prefix)
    items = [it for doc in docs for it in doc]
    ours = MMapIndexedDataset(prefix)
    theirs = IndexedDataset(str(prefix), mmap=mmap)
    assert len(theirs) == len(items) == len(ours)
    assert theirs.sequence_lengths.tolist() == [len(it) for it in items] == ours.sizes.tolist()
    want_doc_idx = np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert theirs.document_indices.tolist() == want_doc_idx == ours.doc_idx.tolist()
    assert theirs.index.dtype == ours.dtype
    assert theirs.index.sequence_pointers.tolist() == ours.pointers.tolist()
    for i, it in enumerate(items):
        got = theirs[i]
        assert got.dtype == ours.dtype and got.tolist() == np.asarray(it).tolist(), i
        if len(it) > 2:
            assert theirs.get(i, offset=1, length=len(it) - 2).tolist() == np.asarray(it)[1:-1].tolist()
    whole = theirs[0:len(items)]  # a slice: Megatron-Core returns one array per item
    assert [x.tolist() for x in whole] == [np.asarray(it).tolist() for it in items]



def test_megatron_core_indexed_dataset_reads_a_corpus_built_by_the_data_pipeline(tmp_path):
    """``data_pipeline.build`` (configs/data/tiny.yaml, 120 records, one worker) writes the GPT and BERT datasets;
    Megatron-Core's reader gives every GPT document as our tokenizer's ids of the kept text plus EOD, and the
    BERT sentence dataset item for item and document for document as our reader does."""
    megatron_core_datasets_dir()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    import data_pipeline
    from data_pipeline.config import load_config
    from megatron_ds_suite.core.corpus import load_corpus

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "data" / "tiny.yaml",
                      [f"output_dir={tmp_path / 'c'}", "workers=1", "sources.0.limit=120", "dataset.bert=true",
                       "tokenizer.flavor=bert"])
    out = data_pipeline.build(cfg)
    tok = load_corpus(out).tokenizer
    kept = [json.loads(x)["text"] for x in (out / "documents.jsonl").read_text().splitlines()]
    gpt = IndexedDataset(str(out / "gpt_text_document"))
    assert len(gpt) == len(kept) >= 50
    assert gpt.document_indices.tolist() == list(range(len(kept) + 1))
    want = [ids + [tok.eod] for ids in tok.encode_batch(kept)]
    assert gpt.sequence_lengths.tolist() == [len(w) for w in want]
    assert all(gpt[i].tolist() == want[i] for i in range(len(kept)))
    bert, ours = IndexedDataset(str(out / "bert_text_sentence")), MMapIndexedDataset(out / "bert_text_sentence")
    assert len(bert.document_indices) - 1 == len(kept) and len(bert) > 3 * len(kept)
    assert bert.document_indices.tolist() == ours.doc_idx.tolist()
    assert bert.sequence_lengths.tolist() == ours.sizes.tolist()
    assert all(bert[i].tolist() == ours[i].tolist() for i in range(len(bert)))

# (samples, seq_length, seed): one epoch; several epochs with the short last one shuffled apart; several epochs with
# a last epoch long enough to be shuffled with the others
GPT_CASES = {"one_epoch": (40, 16, 1234), "short_last_epoch": (500, 16, 7), "long_last_epoch": (818, 32, 99),
             "seq_1": (3000, 1, 3)}


def _their_maps(ds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return ds.document_index, ds.sample_index, ds.shuffle_index


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_megatron_core_gpt_dataset_builds_our_index_maps(case, tmp_path):
    """Same split documents, sample count, sequence length and seed -> Megatron-Core's doc/sample/shuffle index
    (in memory and its cached .npy files) equal ours (our cached .npy files), dtypes included, and every sample's
    tokens (Megatron-Core's ``tokens`` + last label) equal ours."""
    n, seq, seed = GPT_CASES[case]
    prefix = tmp_path / "c"
    make_gpt_corpus(prefix, 200, seed=3, empty_every=17)
    ours = build_gpt_datasets(prefix, "969,30,1", (n, max(1, n // 20), 1), seq, seed, cache_dir=tmp_path / "ours",
                              separate_last_epoch=True)
    checked = 0
    for name, ds in zip(("train", "valid", "test"), ours):
        if ds is None:
            continue
        theirs = megatron_core_gpt_dataset(prefix, ds.documents, ds.num_samples, seq, seed, name,
                                           tmp_path / "theirs", 1000, EOD)
        on_disk = {k: np.load(p) for k, p in ds.index_paths(tmp_path / "ours").items()}
        their_files = sorted((tmp_path / "theirs").glob(f"*-GPTDataset-{name}-*_index.npy"))
        their_disk = {f.name.rsplit("-", 1)[1].split("_")[0]: np.load(f) for f in their_files}
        assert sorted(their_disk) == ["document", "sample", "shuffle"]
        for mine, file_mine, t, file_t in zip((ds.doc_idx, ds.sample_idx, ds.shuffle_idx),
                                              (on_disk["doc"], on_disk["sample"], on_disk["shuffle"]),
                                              _their_maps(theirs),
                                              (their_disk["document"], their_disk["sample"], their_disk["shuffle"])):
            assert mine.dtype == t.dtype == file_mine.dtype == file_t.dtype, name
            assert np.array_equal(mine, t) and np.array_equal(file_mine, file_t), name
        assert len(theirs) == len(ds)
        for i in range(len(ds)):
            s = theirs[i]
            assert np.append(s["tokens"].numpy(), s["labels"].numpy()[-1]).tolist() == ds[i].tolist(), (name, i)
        checked += 1
    assert checked >= 2
    if case == "short_last_epoch":  # the case separates the last epoch: the order is not the 2020 one
        assert ours[0].first_epochs_samples is not None and ours[0].num_epochs > 1
    if case == "long_last_epoch":
        assert ours[0].first_epochs_samples is None and ours[0].num_epochs > 1


def test_megatron_core_gpt_dataset_loads_our_cached_index_files(tmp_path):
    """Our three cached .npy files, put under Megatron-Core's cache names, are what its GPTDataset loads (a cache
    hit: it memory-maps them) and serves samples from."""
    prefix = tmp_path / "c"
    make_gpt_corpus(prefix, 120, seed=8)
    ours = build_gpt_datasets(prefix, "1,0,0", (700, 0, 0), 24, 5, cache_dir=tmp_path / "ours",
                              separate_last_epoch=True)[0]
    probe = megatron_core_gpt_dataset(prefix, ours.documents, ours.num_samples, 24, 5, "train", tmp_path / "names",
                                      1000, EOD)
    names = {f.name.rsplit("-", 1)[1].split("_")[0]: f.name for f in (tmp_path / "names").iterdir()}
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(tmp_path / "names" / names["description.txt"], cache)
    for ours_key, their_key in (("doc", "document"), ("sample", "sample"), ("shuffle", "shuffle")):
        shutil.copy(ours.index_paths(tmp_path / "ours")[ours_key], cache / names[their_key])
    theirs = megatron_core_gpt_dataset(prefix, ours.documents, ours.num_samples, 24, 5, "train", cache, 1000, EOD)
    for arr, key in zip(_their_maps(theirs), ("document", "sample", "shuffle")):
        assert isinstance(arr, np.memmap) and Path(arr.filename) == cache / names[key]
    assert np.array_equal(probe.shuffle_index, theirs.shuffle_index)
    for i in range(len(ours)):
        s = theirs[i]
        assert np.append(s["tokens"].numpy(), s["labels"].numpy()[-1]).tolist() == ours[i].tolist(), i


@pytest.mark.parametrize("raw", [[3, 7], [0.2, 0.5, 0.3]], ids=["two", "three"])
def test_megatron_core_blended_dataset_over_our_prefixes_draws_our_sequence(raw, tmp_path):
    """``data.prefixes``' train and valid blends against Megatron-Core's own ``BlendedDataset`` over its own
    ``GPTDataset``s of the same prefixes (each asked for our per-prefix sample count of the same split documents;
    weights as Megatron 2021 hands them over): the same dataset index, dataset sample index and samples."""
    megatron_core_datasets_dir()
    from megatron.core.datasets.blended_dataset import BlendedDataset as McoreBlend

    from training.data.blending import build_blended_datasets, normalise

    prefixes = []
    for j in range(len(raw)):
        prefixes.append(tmp_path / f"p{j}")
        make_gpt_corpus(prefixes[-1], 90 + 40 * j, seed=20 + j)
    weights = normalise(raw)
    n = (2_000, 120, 0)
    ours = build_blended_datasets(weights, prefixes, "95,5,0", n, 16, 1234, tmp_path / "ours", 1000)
    for name, blend, size in zip(("train", "valid"), ours, n):
        parts = [megatron_core_gpt_dataset(p, ds.documents, ds.num_samples, 16, 1234, name, None, 1000, EOD)
                 for p, ds in zip(prefixes, blend.datasets)]
        theirs = McoreBlend(parts, list(weights), size, parts[0].config)
        assert any(ds.first_epochs_samples is not None for ds in blend.datasets)  # some short last epoch apart
        assert np.array_equal(theirs.dataset_index, blend.dataset_index), name
        assert np.array_equal(theirs.dataset_sample_index, blend.dataset_sample_index), name
        for i in range(size):
            s = theirs[i]
            assert np.append(s["tokens"].numpy(), s["labels"].numpy()[-1]).tolist() == blend[i].tolist(), (name, i)
