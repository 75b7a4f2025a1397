"""The vectorised dedup path against independent references: xxh64 of the ``xxhash`` library and the
``\\w+`` regex, plain-Python shingle sets, datasketch's own ``MinHashLSH`` buckets, and exhaustive
verification (every candidate pair) for the union-find-skipping verifier."""
from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from data_pipeline import dedup as dd
from data_pipeline.doc_store import DocStore
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.store import ShardWriter

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
CORPUS = DATA / "corpus"

ODD_TEXTS = [
    "Héllo wörld ÇA  va? İstanbul ǅemal x_y 123abc " + "a" * 40 + " " + "b" * 31 + " " + "c" * 32,
    "", "!!! ... ???", "a", "ab\ncd", "x" * 8, "y" * 12, "z" * 17, "ÀB", "one two", "a b c d", "a b c d e",
    "a a a a a a a a", "日本語のテキスト と 漢字 ２０２４ 年", "tab\tsep\u00a0nbsp\u2003emsp  end_",
    "THE Quick brown FOX, the quick brown fox; the quick brown fox!",
] + [" ".join("".join(chr(97 + (i * 7 + j) % 26) for j in range(k)) for i in range(6)) for k in range(1, 40)]


@pytest.fixture(scope="module")
def corpus():
    if not (CORPUS / "botchan.txt").exists():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    words = real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])
    docs, _ = planted_corpus(words, families=60, variants=5, max_edit_frac=0.1, seed=5)
    # a bucket of identical documents: k(k-1)/2 candidate pairs, about k of them need measuring
    return docs + [docs[0]] * 12 + ODD_TEXTS


def _store(folder: Path, docs: list[str], shard: int = 50) -> DocStore:
    folder.mkdir(parents=True)
    for k in range(0, len(docs), shard):
        w = ShardWriter(folder, k // shard)
        for i in range(k, min(len(docs), k + shard)):
            w.add(i, f"d{i}", docs[i])
        w.commit({})
    return DocStore(folder)


def test_word_hashes_equal_xxhash_of_regex_words(corpus):
    h, nw = dd.word_unit_hashes(corpus)
    ref = [xxhash.xxh64_intdigest(w.encode("utf-8")) for t in corpus for w in re.findall(r"\w+", t.lower())]
    assert h.tolist() == ref
    assert nw.tolist() == [len(re.findall(r"\w+", t.lower())) for t in corpus]


def test_word_hashes_of_any_unicode_equal_the_regex():
    """Non-ASCII documents (their non-word characters turned into spaces, the rest kept as UTF-8 bytes): the
    same words as ``\\w+`` on random strings over ASCII, Latin, combining marks, punctuation, CJK, the
    characters whose lower case grows (``İ``) and any code point (lone surrogates included)."""
    import random

    rng = random.Random(3)
    pools = [[chr(c) for c in range(0x20, 0x7f)], [chr(c) for c in range(0xa0, 0x250)],
             [chr(c) for c in range(0x300, 0x370)], [chr(c) for c in range(0x2000, 0x2070)],
             [chr(c) for c in range(0x3000, 0x3100)], list("\u0130\u1e9e\u2126\u212a\u00b2\u2155\u0660\uff11_ \n")]
    texts = []
    for _ in range(3000):
        n = rng.randint(1, 30)
        if rng.random() < 0.2:
            texts.append("".join(chr(rng.randrange(0x110000)) for _ in range(n)))
        else:
            texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(n)))
    texts = [t for t in texts if not t.isascii()]
    h, nw = dd.word_unit_hashes(texts)
    words = [re.findall(r"\w+", t.lower()) for t in texts]
    assert h.tolist() == [xxhash.xxh64_intdigest(w.encode("utf-8", "surrogatepass")) for ws in words for w in ws]
    assert nw.tolist() == [len(ws) for ws in words] and sum(nw) > 3000


@pytest.mark.parametrize("unit", ["word", "char"])
def test_fingerprint_sets_match_reference_sets(corpus, unit):
    spec = dd.ShingleSpec(5, unit)
    values, offsets = dd.shingle_sets_batch(corpus, spec)
    sets = [values[offsets[k]:offsets[k + 1]] for k in range(len(corpus))]
    ref = [dd.shingle_set(t, spec) for t in corpus]
    for s, r in zip(sets, ref):
        assert len(s) == len(r) and np.all(s[1:] > s[:-1])  # sorted, distinct, one value per shingle
    # Jaccard of fingerprint sets == Jaccard of the plain-Python shingle sets, on overlapping pairs
    rng = np.random.default_rng(0)
    pairs = [(i, i + 1) for i in range(0, 300, 3)] + [tuple(rng.integers(0, len(corpus), 2)) for _ in range(200)]
    for i, j in pairs:
        assert dd.jaccard_sorted(sets[i], sets[j]) == pytest.approx(dd.jaccard(ref[i], ref[j]), abs=1e-12)
    # batching does not change a document's set
    for k in (0, 5, len(corpus) - 1):
        v1, o1 = dd.shingle_sets_batch([corpus[k]], spec)
        np.testing.assert_array_equal(v1, sets[k])


def test_band_pairs_equal_datasketch_buckets(corpus):
    signer = dd.Signer(128, 1, dd.ShingleSpec(5, "word"))
    sigs, nsh = signer.sign_batch(corpus)
    active = nsh > 0
    for bands, rows in ((20, 6), (14, 9), (32, 4)):
        lsh = dd.LshSpec(0.7, 128, bands, rows, 1)
        index = dd.make_lsh(lsh)
        for j in np.flatnonzero(active).tolist():
            index.insert(j, signer.lean(sigs[j]))
        ref = dd.bucket_pairs(index)
        got = dd.band_pairs(sigs, active, bands, rows)
        assert set(map(tuple, got.tolist())) == ref and len(got) == len(ref) > 0
        assert np.all(got[:, 0] < got[:, 1])


def test_skipping_verifier_equals_exhaustive(corpus, tmp_path):
    store = _store(tmp_path / "store", corpus)
    shingle = dd.ShingleSpec(5, "word")
    b, r = dd.lsh_params(0.7, 128, None, None, (0.1, 0.9))
    lsh = dd.LshSpec(0.7, 128, b, r, 1)
    sig_dir = tmp_path / "sigs"
    results = []
    for workers, max_docs in ((2, 20000), (1, 7)):  # tiny max_docs: many runs, result must not change
        shutil.rmtree(sig_dir, ignore_errors=True)
        results.append(dd.dedup_store(store, sig_dir, shingle, lsh, 40, workers, max_docs, progress=False))
    res = results[0]
    pairs = dd.band_pairs(*_sigs(sig_dir, len(store), 40), b, r)
    full = dd.verify_pairs(store, map(tuple, pairs.tolist()), shingle, 50, 1, progress=False)
    clusters, link = dd.cluster(full, 0.7)
    assert res.clusters == clusters and res.link == link and len(clusters) > 10
    assert results[1].clusters == clusters and results[1].link == link
    assert res.to_survivor == results[1].to_survivor
    assert res.candidates == len(full) and res.skipped > 0 and res.verified + res.skipped == len(full)
    assert res.accepted + res.rejected == res.verified and res.rejected > 0
    # the bucket of 13 identical copies: 78 candidate pairs among them, 12 measured (0, c) then 66 skipped
    assert res.skipped >= 66
    # Jaccard to the survivor: the plain-Python reference
    for root, ms in clusters.items():
        for m in ms[1:]:
            ref = dd.jaccard(dd.shingle_set(corpus[root], shingle), dd.shingle_set(corpus[m], shingle))
            assert res.to_survivor[m] == pytest.approx(ref, abs=1e-12)
    copies = [k for k, t in enumerate(corpus) if t == corpus[0]]
    assert len(copies) == 13 and all(res.to_survivor[m] == 1.0 for m in copies[1:])
    # every candidate pair with J >= 0.7 (by the reference) ends in one cluster
    member = {m: r for r, ms in clusters.items() for m in ms}
    for i, j, jac in full:
        if jac >= 0.7:
            assert member[i] == member[j]


def _sigs(sig_dir: Path, n: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    starts = range(0, n, chunk)
    sigs = np.concatenate([np.load(sig_dir / f"sig-{s:012d}.npy") for s in starts])
    nsh = np.concatenate([np.load(sig_dir / f"nsh-{s:012d}.npy") for s in starts])
    return sigs, nsh > 0


def test_shingle_cache_reads_only_requested(corpus, tmp_path):
    store = _store(tmp_path / "store", corpus)
    spec = dd.ShingleSpec(5, "word")
    dd.compute_signatures(store, tmp_path / "sigs", 128, 1, spec, 33, 1, progress=False)
    cache = dd.ShingleCache(tmp_path / "sigs", len(store), 33)
    want = [0, 32, 33, 100, len(store) - 1]
    got = cache.load(want)
    assert sorted(got) == want
    values, offsets = dd.shingle_sets_batch([corpus[k] for k in want], spec)
    for k, d in enumerate(want):
        np.testing.assert_array_equal(got[d], values[offsets[k]:offsets[k + 1]])
    for a, b in itertools.combinations(want, 2):
        assert dd.jaccard_sorted(got[a], got[b]) == pytest.approx(
            dd.jaccard(dd.shingle_set(corpus[a], spec), dd.shingle_set(corpus[b], spec)), abs=1e-12)
