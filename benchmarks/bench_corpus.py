"""Corpus-building benchmark.

1. A full build (ingest → tokenizer → filter → dedup → export) of a planted near-duplicate corpus
   made from real text (../shared/data/corpus): docs/s and peak RSS per stage, from stats.json.
2. The dedup stage (batch MinHash in worker processes + recall-biased LSH + exact verification +
   union-find) against a plain datasketch baseline on the same documents: per-document
   ``MinHash(num_perm=128)`` + ``update_batch`` of the same word-5-gram shingles (bytes, default SHA-1
   hash) and ``MinHashLSH(threshold=0.7, num_perm=128)`` query-then-insert, clusters = connected
   components of the LSH candidates (the baseline does no verification). Repetitions are interleaved
   (ours, baseline, ours, ...); median and min–max of docs/s are reported, with pair recall against
   the exact Jaccard of every pair and the number of pairs below 0.7 each one merged.

    .venv/bin/python benchmarks/bench_corpus.py --families 600 --variants 4 --reps 5 --workers 2
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_pipeline import dedup as dd  # noqa: E402
from data_pipeline.config import config_from_dict  # noqa: E402
from data_pipeline.planted import planted_corpus, real_words  # noqa: E402
from data_pipeline.stages import build  # noqa: E402
from data_pipeline.store import DocStore, ShardWriter  # noqa: E402

DATA = ROOT / ".." / "shared" / "data" / "corpus"


def ours(store: DocStore, tmp: Path, workers: int) -> tuple[float, dict[int, int]]:
    shingle = dd.ShingleSpec(5, "word")
    b, r = dd.lsh_params(0.7, 128, None, None, (0.1, 0.9))
    lsh = dd.LshSpec(0.7, 128, b, r, 1)
    sig_dir = tmp / "sigs"
    shutil.rmtree(sig_dir, ignore_errors=True)
    t = time.perf_counter()
    sigs, nsh = dd.compute_signatures(store, sig_dir, 128, 1, shingle, 500, workers, progress=False)
    pairs = dd.candidates_in_memory(sigs, nsh > 0, lsh, progress=False)
    verified = dd.verify_pairs(store, pairs, shingle, 20000, workers, progress=False)
    clusters, _ = dd.cluster(verified, 0.7)
    secs = time.perf_counter() - t
    return secs, {m: root for root, ms in clusters.items() for m in ms}


def baseline(texts: list[str]) -> tuple[float, dict[int, int]]:
    from datasketch import MinHash, MinHashLSH

    t = time.perf_counter()
    lsh = MinHashLSH(threshold=0.7, num_perm=128)
    uf = dd.UnionFind()
    for j, text in enumerate(texts):
        u = re.findall(r"\w+", text.lower())
        m = MinHash(num_perm=128)
        m.update_batch([" ".join(u[i:i + 5]).encode("utf-8") for i in range(max(1, len(u) - 4))])
        for i in lsh.query(m):
            uf.union(i, j)
        lsh.insert(j, m)
    secs = time.perf_counter() - t
    return secs, {m: root for root, ms in uf.clusters().items() for m in ms}


def pair_quality(member: dict[int, int], truth: dict[tuple[int, int], float], lo: float) -> tuple[float, int]:
    same = lambda i, j: i in member and member.get(i) == member.get(j)  # noqa: E731
    high = [p for p, j in truth.items() if j >= lo]
    recall = sum(same(i, j) for i, j in high) / len(high)
    return recall, len(high)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", type=int, default=600)
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    words = real_words([DATA / "botchan.txt", DATA / "tinyshakespeare.txt"])
    fams = min(args.families, len(words) // 300)
    texts, _ = planted_corpus(words, fams, args.variants, max_edit_frac=0.08, seed=11)
    n = len(texts)
    tmp = Path(tempfile.mkdtemp(prefix="bench_corpus_"))
    try:
        # ---------------------------------------------------------------- 1. full build, per stage
        inp = tmp / "planted.jsonl"
        inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        cfg = config_from_dict({"output_dir": str(tmp / "out"), "sources": [{"type": "jsonl", "path": str(inp)}],
                                "workers": args.workers, "shard_size": 500, "progress": False,
                                "tokenizer": {"vocab_size": 8000}, "dedup": {"chunk_size": 500}})
        _, stats = build(cfg, force=True)
        print(f"\n## full build: {n} planted documents, workers={args.workers}")
        print(f"documents: {stats['documents']}")
        print("| stage | seconds | docs in | docs/s | peak RSS main (MiB) | peak RSS workers (MiB) |")
        print("|---|---|---|---|---|---|")
        for k, s in stats["stages"].items():
            print(f"| {k} | {s['seconds']:.2f} | {s['docs_in']} | {s['docs_per_s']:.0f} | {s['peak_rss_mib']:.0f} "
                  f"| {s['peak_rss_children_mib']:.0f} |")
        print(f"dedup phases (s): {stats['dedup']['phase_seconds']}; candidates {stats['dedup']['candidate_pairs']}, "
              f"verified {stats['dedup']['verified_pairs']}, removed {stats['dedup']['removed']}")

        # ---------------------------------------------------------------- 2. dedup vs baseline
        store_dir = tmp / "store"
        store_dir.mkdir()
        for k in range(0, n, 500):
            w = ShardWriter(store_dir, k // 500)
            for i in range(k, min(n, k + 500)):
                w.add(i, f"d{i}", texts[i])
            w.commit({})
        store = DocStore(store_dir)
        sets = [dd.shingle_set(t, dd.ShingleSpec(5, "word")) for t in texts]
        truth = {}
        for i, j in itertools.combinations(range(n), 2):
            inter = len(sets[i] & sets[j])
            if inter:
                truth[(i, j)] = inter / (len(sets[i]) + len(sets[j]) - inter)
        t_ours, t_base = [], []
        for _ in range(args.reps):
            s, m_ours = ours(store, tmp, args.workers)
            t_ours.append(n / s)
            s, m_base = baseline(texts)
            t_base.append(n / s)
        print(f"\n## dedup stage vs plain datasketch: {n} documents, {args.reps} interleaved reps")
        print("| method | docs/s median | min–max | recall J>=0.7 | recall J>=0.75 | pairs J<0.7 in one cluster (transitive) |")
        print("|---|---|---|---|---|---|")
        for name, ts, mem in (("ours (batch MinHash x%d procs, 20x6 LSH, exact verify)" % args.workers, t_ours, m_ours),
                              ("datasketch MinHash+MinHashLSH(0.7) per doc", t_base, m_base)):
            r7, n7 = pair_quality(mem, truth, 0.7)
            r75, n75 = pair_quality(mem, truth, 0.75)
            low = sum(1 for (i, j), v in truth.items() if v < 0.7 and i in mem and mem.get(i) == mem.get(j))
            print(f"| {name} | {statistics.median(ts):.0f} | {min(ts):.0f}–{max(ts):.0f} | {r7:.3f} (of {n7}) "
                  f"| {r75:.3f} (of {n75}) | {low} |")
        print(f"\nspeed-up (median): {statistics.median(t_ours) / statistics.median(t_base):.2f}x")
        print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
              f"{__import__('os').cpu_count()} cores, numpy {np.__version__}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
