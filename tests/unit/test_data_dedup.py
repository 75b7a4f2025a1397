"""Near-duplicate removal on a planted corpus of real text with exactly measured pairwise Jaccard."""
from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from datasketch import MinHash

from data_pipeline import dedup as dd
from data_pipeline.doc_store import DocStore
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.store import ShardWriter

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
CORPUS = DATA / "corpus"


def _ref_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Independent reference: lower-cased \\w+ words, all n-grams."""
    u = re.findall(r"\w+", text.lower())
    return {tuple(u[i:i + n]) for i in range(len(u) - n + 1)}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    if not (CORPUS / "botchan.txt").exists():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    words = real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])
    docs, fam = planted_corpus(words, families=100, variants=4, max_edit_frac=0.08, seed=3)
    folder = tmp_path_factory.mktemp("store")
    for k in range(0, len(docs), 120):  # several shards
        w = ShardWriter(folder, k // 120)
        for i in range(k, min(len(docs), k + 120)):
            w.add(i, f"doc{i}", docs[i])
        w.commit({})
    sets = [_ref_shingles(t) for t in docs]
    truth = {}
    for i, j in itertools.combinations(range(len(docs)), 2):
        a, b = sets[i], sets[j]
        inter = len(a & b)
        if inter:
            truth[(i, j)] = inter / (len(a) + len(b) - inter)
    return DocStore(folder), docs, truth


def run_dedup(store, workers=2, threshold=0.7, tmp=None):
    shingle = dd.ShingleSpec(5, "word")
    b, r = dd.lsh_params(threshold, 128, None, None, (0.1, 0.9))
    lsh = dd.LshSpec(threshold, 128, b, r, 1)
    sig_dir = tmp / "sigs"
    shutil.rmtree(sig_dir, ignore_errors=True)
    sigs, nsh = dd.compute_signatures(store, sig_dir, 128, 1, shingle, 100, workers, progress=False)
    active = nsh > 0
    pairs = dd.candidates_in_memory(sigs, active, lsh, progress=False)
    verified = dd.verify_pairs(store, pairs, shingle, 50, workers, progress=False)
    clusters, link = dd.cluster(verified, threshold)
    return pairs, verified, clusters, link


def test_lsh_params_recall_biased():
    assert dd.lsh_params(0.7, 128, None, None, (0.1, 0.9)) == (20, 6)
    assert dd.candidate_probability(0.7, 20, 6) > 0.9
    assert dd.lsh_params(0.7, 128, 16, 8) == (16, 8)


@pytest.mark.parametrize("num_perm", [16, 64, 128, 256])
def test_lsh_params_equal_datasketch_choice(num_perm):
    """Our scipy-free optimum (Gauss-Legendre, exact for these polynomials) picks datasketch's pair."""
    from datasketch.lsh import _optimal_param

    for t in np.arange(0.3, 0.96, 0.05):
        for w in ((0.1, 0.9), (0.5, 0.5), (0.9, 0.1), (0.3, 0.7)):
            want = tuple(int(x) for x in _optimal_param(float(t), num_perm, *w))
            assert dd.lsh_params(float(t), num_perm, None, None, w) == want, (t, w)


def test_affine32_permutations_equal_datasketch():
    from data_pipeline.dedup.minhash import affine32_permutations

    for num_perm, seed in ((128, 1), (128, 1234), (64, 7), (256, 0)):
        a, b = affine32_permutations(num_perm, seed)
        ref_a, ref_b = MinHash(num_perm=num_perm, seed=seed, scheme="affine32").permutations
        np.testing.assert_array_equal(a, ref_a)
        np.testing.assert_array_equal(b, ref_b)
        assert a.dtype == b.dtype == np.uint32 and np.all(a % 2 == 1)


def test_signature_equals_datasketch_reference():
    spec = dd.ShingleSpec(5, "word")
    signer = dd.Signer(128, 7, spec)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat today"
    hv = dd.shingle_hashes(text, spec)
    ref = MinHash(num_perm=128, seed=7, hashfunc=lambda x: x)
    ref.update_batch([int(h) for h in hv])
    np.testing.assert_array_equal(signer.sign(text)[0], ref.hashvalues)
    assert len(hv) == len(_ref_shingles(text))
    texts = [text, "short one", "", "Another text, with other words entirely; and more of them here.", "x y z w v u"]
    sigs, nsh = signer.sign_batch(texts, block_rows=7)
    for k, t in enumerate(texts):
        s, c = signer.sign(t)
        np.testing.assert_array_equal(sigs[k], s)
        assert nsh[k] == c
    # short documents: one shingle; no words: no shingle
    assert len(dd.shingle_set("two words", spec)) == 1 and dd.shingle_set("!!! ...", spec) == set()
    assert dd.shingle_set("abcdefg", dd.ShingleSpec(5, "char")) == {"abcde", "bcdef", "cdefg"}
    assert len(dd.shingle_hashes("abcdefg", dd.ShingleSpec(5, "char"))) == 3


def test_union_find_lowest_index_survives():
    clusters, link = dd.cluster([(5, 9, 0.8), (2, 9, 0.75), (1, 3, 0.69), (7, 8, 1.0)], 0.7)
    assert clusters == {2: [2, 5, 9], 7: [7, 8]}
    assert link[9] == (2, 0.75) and link[5] == (9, 0.8) and 1 not in link


def test_planted_recall_precision_determinism(planted, tmp_path):
    store, docs, truth = planted
    pairs, verified, clusters, link = run_dedup(store, tmp=tmp_path)
    member_root = {m: r for r, ms in clusters.items() for m in ms}
    # every verified Jaccard equals the independent reference exactly
    for i, j, jac in verified:
        assert jac == pytest.approx(truth.get((i, j), 0.0), abs=1e-12)
    # recall: >= 95% of pairs with J >= 0.75 end in the same cluster
    high = [p for p, j in truth.items() if j >= 0.75]
    assert len(high) >= 100, len(high)
    found = sum(1 for i, j in high if i in member_root and member_root.get(i) == member_root.get(j))
    assert found / len(high) >= 0.95, (found, len(high))
    # precision: every merging edge has exact J >= 0.7; every cluster lies inside one component of the
    # true ">= 0.7" graph, and the survivor is its lowest index
    for m, (via, jac) in link.items():
        assert truth[(min(m, via), max(m, via))] >= 0.7
    for r, ms in clusters.items():
        assert r == min(ms)
    edges_true = {p for p, j in truth.items() if j >= 0.7}
    uf = dd.UnionFind()
    for i, j in edges_true:
        uf.union(i, j)
    for r, ms in clusters.items():
        assert len({uf.find(m) for m in ms}) == 1
    # candidates far below the threshold exist and were rejected by verification
    assert any(j < 0.7 for _, _, j in verified)
    # same result on every run, whatever the number of workers
    _, verified2, clusters2, _ = run_dedup(store, workers=1, tmp=tmp_path)
    assert clusters2 == clusters and sorted(verified2) == sorted(verified)



def test_duplicate_rows_equal_a_row_per_cluster_built_from_the_metadata(tmp_path):
    """``duplicate_rows`` (rows made as they are written, from arrays) against the rows built directly from each
    member's metadata, on random clusters over a 5-shard store; the store is closed before the rows are made."""
    from data_pipeline.store import ShardWriter

    rng = np.random.default_rng(4)
    n = 500
    for k in range(0, n, 100):
        w = ShardWriter(tmp_path, k // 100)
        for i in range(k, k + 100):
            w.add(1000 + 3 * i, f"src-{i}-\u00e9", f"text {i}")
        w.commit({})
    perm = rng.permutation(n)
    clusters, link, to_survivor, pos = {}, {}, {}, 0
    while pos < 400:
        ms = sorted(int(x) for x in perm[pos:pos + int(rng.integers(2, 7))])
        pos += len(ms)
        clusters[ms[0]] = ms
        for j, m in enumerate(ms[1:]):
            link[m] = (ms[int(rng.integers(0, j + 1))], float(rng.random()))
            to_survivor[m] = float(rng.random())
    store = DocStore(tmp_path)
    meta = {p: store.meta(p) for ms in clusters.values() for p in ms}
    want = [{"kept": meta[r]["src"], "kept_i": meta[r]["i"],
             "removed": [{"id": meta[m]["src"], "i": meta[m]["i"], "jaccard": round(to_survivor[m], 6),
                          "linked_via": meta[link[m][0]]["i"], "link_jaccard": round(link[m][1], 6)}
                         for m in clusters[r][1:]]} for r in sorted(clusters)]
    rows, removed = dd.duplicate_rows(store, clusters, link, lambda root, m: to_survivor[m])
    store.close()
    assert list(rows) == want
    assert removed == [m for r in sorted(clusters) for m in clusters[r][1:]]
    assert want[0]["kept_i"] == 1000 + 3 * sorted(clusters)[0]
    link[clusters[sorted(clusters)[0]][1]] = (n + 5, 0.9)  # a link outside every cluster: an error, not a wrong row
    with pytest.raises(ValueError, match="not a member"):
        dd.duplicate_rows(DocStore(tmp_path), clusters, link, lambda root, m: to_survivor[m])
