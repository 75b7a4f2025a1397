"""The sharded (worker-side) dedup against today's single-process ``dedup_store``: the same clusters, links,
Jaccards to the survivor and counts, on corpora with many duplicates, chains of near-duplicates, exact
copies and none, for several partition / range layouts and worker counts; and the bucket shuffle alone
against ``band_pairs``."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import dedup as dd
from data_pipeline.config import config_from_dict
from data_pipeline.dedup.buckets import BucketJob, ReduceJob, bucket_chunk, pair_file, reduce_partition
from data_pipeline.dedup.sharded import dedup_sharded, layout, local_pmap
from data_pipeline.doc_store import DocStore
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.stages import build
from data_pipeline.store import ShardWriter

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2"
CORPUS = DATA / "corpus"
SHINGLE = dd.ShingleSpec(5, "word")
LSH = dd.LshSpec(0.7, 128, 20, 6, 1)


@pytest.fixture(scope="module")
def words():
    if not (CORPUS / "botchan.txt").exists():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])


def _chains(words: list[str], chains: int, length: int, doc_words: int = 200, seed: int = 3) -> list[str]:
    """Chains of near-duplicates: each document edits 3 of its predecessor's words, so neighbours are
    above 0.7 and the ends of a chain far below it (clusters joined only transitively), shuffled."""
    rng = random.Random(seed)
    docs = []
    for c in range(chains):
        cur = words[c * doc_words:(c + 1) * doc_words]
        for _ in range(length):
            docs.append(" ".join(cur))
            cur = list(cur)
            for p in rng.sample(range(doc_words), 3):
                cur[p] = rng.choice(words)
    rng.shuffle(docs)
    return docs


def _corpora(words: list[str]) -> dict[str, list[str]]:
    many, _ = planted_corpus(words, families=40, variants=8, max_edit_frac=0.1, seed=11)
    none = [" ".join(words[k * 150:(k + 1) * 150]) for k in range(300)]
    mixed = many[:200] + [many[3]] * 15 + ["!!! ...", "", "one two", "a b c d e"] + none[:50]
    return {"many": many, "chains": _chains(words, 12, 25), "none": none, "mixed": mixed}


def _store(folder: Path, docs: list[str], shard: int = 64) -> DocStore:
    folder.mkdir(parents=True)
    for k in range(0, len(docs), shard):
        w = ShardWriter(folder, k // shard)
        for i in range(k, min(len(docs), k + shard)):
            w.add(i, f"d{i}", docs[i])
        w.commit({})
    return DocStore(folder)


def _summary(res: dd.DedupResult) -> dict:
    return {"clusters": res.clusters, "link": res.link, "to_survivor": res.to_survivor,
            "counts": (res.candidates, res.verified, res.accepted, res.rejected, res.skipped),
            "unsignatured": res.unsignatured_count()}


def test_sharded_equals_single_process(words, tmp_path):
    for name, docs in _corpora(words).items():
        store = _store(tmp_path / name / "store", docs)
        ref = dd.dedup_store(store, tmp_path / name / "sig-ref", SHINGLE, LSH, 37, 1, 64, progress=False)
        want = _summary(ref)
        if name == "none":
            assert want["clusters"] == {} and want["counts"][0] == 0
        else:
            assert len(want["clusters"]) >= 10 and want["counts"][4] > 0, name  # real clusters, pairs skipped
        if name == "chains":  # transitive members below the threshold to their survivor
            assert min(want["to_survivor"].values()) < 0.7
        if name == "mixed":
            assert want["unsignatured"] == 2
        # (records per partition, documents per range, workers, verify block): one task each, many, tiny blocks
        for k, (rec, rng, workers, block) in enumerate([(10**9, 10**9, 1, 20000), (500, 40, 2, 64),
                                                         (97, 7, 2, 5)]):
            got = dedup_sharded(store, tmp_path / name / f"sig-{k}", tmp_path / name / f"work-{k}", SHINGLE, LSH,
                                37, block, local_pmap(workers), min_tasks=workers, records_per_part=rec,
                                docs_per_range=rng)
            assert _summary(got) == want, (name, k)
            assert not (tmp_path / name / f"work-{k}").exists()
        store.close()


def test_layout_grows_with_corpus():
    assert layout(1000, 20, 2) == (2, 2, 500)
    parts, ranges, range_docs = layout(10**7, 20, 2)
    assert parts == 200 and ranges == 100 and range_docs == 100_000
    assert layout(1, 20, 4)[1] == 1


def test_bucket_files_give_band_pairs(tmp_path):
    rng = np.random.default_rng(0)
    n, bands, rows, chunk = 700, 8, 3, 128
    sigs = rng.integers(0, 4, size=(n, bands * rows), dtype=np.uint32)  # tiny alphabet: many shared bands
    sigs[rng.choice(n, 200, replace=False)] = sigs[rng.choice(n, 200)]  # plus exact copies
    nsh = rng.integers(0, 5, size=n)  # some documents without a signature (nsh == 0)
    for s in range(0, n, chunk):
        f = dd.chunk_files(tmp_path, s)
        np.save(f["sig"], sigs[s:s + chunk])
        np.save(f["nsh"], nsh[s:s + chunk])
    want = dd.band_pairs(sigs, nsh > 0, bands, rows)
    assert len(want) > 1000
    starts = tuple(range(0, n, chunk))
    for parts, range_docs in ((1, n), (3, 100), (7, 33)):
        work = tmp_path / f"w{parts}"
        (work / "b").mkdir(parents=True)
        (work / "p").mkdir()
        unsig = sum(bucket_chunk(BucketJob(str(tmp_path), s, bands, rows, parts, str(work / "b"))) for s in starts)
        assert unsig == int((nsh == 0).sum())
        total = sum(reduce_partition(ReduceJob(str(work / "b"), p, starts, n, range_docs, str(work / "p")))
                    for p in range(parts))
        keys = [np.load(pair_file(work / "p", r, p)) for r in range(-(-n // range_docs)) for p in range(parts)
                if pair_file(work / "p", r, p).exists()]
        for r in range(-(-n // range_docs)):  # every pair filed under the range of its lower document
            for p in range(parts):
                if pair_file(work / "p", r, p).exists():
                    assert (np.load(pair_file(work / "p", r, p)) // n // range_docs == r).all()
        got = np.unique(np.concatenate(keys))
        assert total >= len(got)
        np.testing.assert_array_equal(np.stack([got // n, got % n], axis=1), want)


@pytest.mark.parametrize("exact", [True, False])
def test_build_outputs_byte_identical_to_in_memory_dedup(words, tmp_path, exact):
    """A whole local build (the dedup stage's steps as worker tasks) against the retired single-driver path,
    now the oracle (``tests/helpers/dedup_oracle.py``) run on the build's filter store: the same bytes in
    ``removed.npy`` and ``duplicates.jsonl`` and the same dedup counts."""
    if not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"GPT-2 tokenizer files not found under {GPT2}")
    import json

    from data_pipeline.files import write_jsonl_atomic
    from data_pipeline.stages.bookkeeping import work_dir
    from data_pipeline.stages.dedup import dedup_specs
    from tests.helpers.dedup_oracle import reference_dedup_files

    docs = _corpora(words)["mixed"] + _chains(words, 4, 12, seed=9)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "out"), "sources": [{"type": "jsonl", "path": str(src)}],
        "workers": 2, "shard_size": 40, "progress": False,
        "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                      "merges_file": str(GPT2 / "gpt2-merges.txt")},
        "length": {"min_tokens": 16}, "dedup": {"chunk_size": 32, "exact": exact}})
    out, st = build(cfg)
    stats = st["dedup"]
    shingle, lsh = dedup_specs(cfg)
    store = DocStore(work_dir(cfg, "filter"))
    removed, rows, counts = reference_dedup_files(store, tmp_path / "sig-ref", tmp_path / "ref", shingle, lsh, 32,
                                                  cfg.dedup.verify_block_docs, exact)
    store.close()
    np.testing.assert_array_equal(np.load(work_dir(cfg, "dedup") / "removed.npy"), removed)
    write_jsonl_atomic(tmp_path / "ref-duplicates.jsonl", rows)
    assert (out / "duplicates.jsonl").read_bytes() == (tmp_path / "ref-duplicates.jsonl").read_bytes()
    assert stats["removed"] >= 40 and stats["clusters"] >= 10
    for k, v in counts.items():
        assert stats[k] == v, k
    assert not (out / "work" / "dedup" / "lsh").exists()  # intermediate bucket / pair / edge files removed


def test_single_driver_dedup_is_retired(tmp_path):
    from data_pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="dedup.sharded=false .* was retired"):
        config_from_dict({"output_dir": str(tmp_path / "o"), "sources": [{"type": "default"}],
                          "dedup": {"sharded": False}})


def test_equal_key_pairs_survives_hash_collisions(monkeypatch):
    """Groups are decided on the rows: with every key hashing alike (all collide) the pairs are unchanged."""
    from data_pipeline.dedup import buckets

    rng = np.random.default_rng(1)
    key = rng.integers(0, 3, size=(400, 3)).astype(np.uint32)
    docs = rng.permutation(400).astype(np.int64)
    want = {(min(docs[a], docs[b]), max(docs[a], docs[b])) for a in range(400) for b in range(a + 1, 400)
            if (key[a] == key[b]).all()}
    got = set(zip(*(x.tolist() for x in buckets.equal_key_pairs(key, docs))))
    assert got == want and len(want) > 1000
    monkeypatch.setattr(buckets, "key_hash", lambda k: np.zeros(len(k), np.uint64))
    got = set(zip(*(x.tolist() for x in buckets.equal_key_pairs(key, docs))))
    assert got == want


def test_union_find_stores_only_joined_documents():
    uf = dd.UnionFind()
    assert uf.find(5) == 5 and uf.find(7) == 7 and uf.parent == {}  # finds of lone documents store nothing
    uf.union(9, 4)
    uf.union(9, 12)
    assert uf.find(12) == 4 and set(uf.parent) == {4, 9, 12} and uf.clusters() == {4: [4, 9, 12]}


def test_visit_measured_accepts_at_the_threshold_and_keeps_first_links():
    from data_pipeline.dedup.verify import AcceptedEdges

    uf, res, accepted = dd.UnionFind(), dd.DedupResult({}, {}, {}), AcceptedEdges()
    for i, j, jac in [(1, 4, 0.7), (2, 4, 0.9), (3, 5, 0.69), (1, 2, 1.0)]:
        dd.visit_measured(uf, res, accepted, i, j, jac, 0.7)
    assert (res.verified, res.accepted, res.rejected) == (4, 3, 1)
    assert uf.clusters() == {1: [1, 2, 4]} and len(accepted) == 3
    assert res.link == {4: (1, 0.7), 1: (4, 0.7), 2: (4, 0.9)}  # the first merging edge of each end only
    # the survivors' edges looked up after the visit: (1, 4) and (1, 2) were accepted, (1, 5) and (2, 4)-as-(4, 2) not
    accepted.reuse(res, [(1, 4), (1, 5), (1, 2), (4, 2), (3, 5)])
    assert res.to_survivor == {4: 0.7, 2: 1.0}
    big = AcceptedEdges()
    big.add(2**31 - 1, 2**31 - 1 + 1, 0.8)  # the largest document numbers the pair key holds
    big.reuse(res, [(2**31 - 1, 2**31)])
    assert res.to_survivor[2**31] == 0.8
    with pytest.raises(ValueError, match="must be < 2"):
        big.add(2**31, 2**31 + 1, 0.8)


def test_stale_files_of_an_interrupted_run_are_not_read(words, tmp_path):
    docs = _corpora(words)["chains"]
    store = _store(tmp_path / "store", docs)
    want = _summary(dd.dedup_store(store, tmp_path / "sig", SHINGLE, LSH, 50, 1, 64, progress=False))
    work = tmp_path / "work"
    for sub in ("pairs", "edges"):  # bogus leftovers: a pair of every document with the next, all "duplicates"
        (work / sub).mkdir(parents=True)
    n = len(docs)
    np.save(pair_file(work / "pairs", 0, 99), np.arange(n - 1) * n + np.arange(1, n))
    np.save(work / "edges" / "e-000000.npy", np.arange(n - 1) * n + np.arange(1, n))
    np.save(work / "edges" / "j-000000.npy", np.ones(n - 1))
    got = dedup_sharded(store, tmp_path / "sig", work, SHINGLE, LSH, 50, 64, local_pmap(1), docs_per_range=60)
    assert _summary(got) == want


def test_memory_benchmark_runs_and_both_paths_agree(words, tmp_path):
    """``benchmarks/bench_dedup_memory.py`` at a tiny size: a row per path, the same result digest."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_dedup_memory", "--docs", "3000", "--chunk", "500",
                          "--tmp", str(tmp_path), "--paths", "memory", "sharded", "stage-before", "stage"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r.split("|") for r in out.stdout.splitlines() if r.startswith("| 3,000 ")]
    assert [r[3].strip() for r in rows] == ["memory", "sharded", "stage-before", "stage"]
    assert rows[0][-2] == rows[1][-2] and int(rows[0][9].replace(",", "")) > 20  # same digest; real removals
    # the stage's report files (exact copies merged in) are identical with and without the flat driver
    assert rows[2][-2] == rows[3][-2] and rows[2][-2].strip().startswith("files ")
    assert rows[2][8:11] == rows[3][8:11] and rows[2][9] == rows[0][9]  # the same documents removed as fuzzy alone
    assert int(rows[2][10].replace(",", "")) < int(rows[0][10].replace(",", ""))  # copies never reach the LSH
    assert list(tmp_path.iterdir()) == []  # the generated store is deleted


def test_exact_map_reduce_equals_exact_representatives(words, tmp_path):
    from data_pipeline.dedup import exact as ex
    from data_pipeline.dedup.exact_sharded import (
        KeyMapJob,
        KeyReduceJob,
        SubsetJob,
        SubsetPositions,
        key_map,
        key_reduce,
        read_dups,
        shard_groups,
        write_subset_group,
    )
    from data_pipeline.files import atomic_write_json
    from data_pipeline.store import TEXT_FROM

    base = _corpora(words)["mixed"]
    docs = base + base[::3] + [base[5]] * 4  # copies later in the store, some of copies
    store = _store(tmp_path / "store", docs, shard=17)
    rep_of = ex.exact_representatives(ex.text_keys(store))
    want = np.flatnonzero(rep_of != np.arange(len(docs)))
    assert len(want) > 100
    for parts, per_group in [(1, 10**9), (3, 40), (7, 1)]:
        work = tmp_path / f"w{parts}"
        (work / "keys").mkdir(parents=True)
        (work / "dups").mkdir()
        (work / "sub").mkdir()
        groups = shard_groups(store, per_group)
        assert [g[0] for g in groups][1:] == [g[1] for g in groups][:-1] and groups[-1][1] == len(store.shards)
        for g, (lo, hi) in enumerate(groups):
            key_map(KeyMapJob(str(store.folder), g, lo, hi, parts, str(work / "keys")))
        starts = tuple(int(store.starts[lo]) for lo, _ in groups)
        n = sum(key_reduce(KeyReduceJob(str(work / "keys"), p, len(groups), starts, str(work / "dups")))
                for p in range(parts))
        got = read_dups(work / "dups")
        assert n == len(want) and got[:, 0].tolist() == want.tolist() and got[:, 1].tolist() == rep_of[want].tolist()
        atomic_write_json(work / "sub" / TEXT_FROM, {"folder": str(store.text_folder.resolve())})
        for g, (lo, hi) in enumerate(groups):
            write_subset_group(SubsetJob(str(store.folder), g, lo, hi, str(work / "dups"), str(work / "sub")))
        sub, reps = DocStore(work / "sub"), np.flatnonzero(rep_of == np.arange(len(docs)))
        to_store = SubsetPositions(work / "sub")
        assert len(sub) == len(reps) and [to_store(p) for p in range(len(sub))] == reps.tolist()
        assert list(sub.iter_texts()) == [docs[p] for p in reps]
