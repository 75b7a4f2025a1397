"""Peak memory of the fuzzy dedup: the driver and its workers, in-memory driver path vs ``dedup.sharded``.

For each N the benchmark writes a document store of N documents, generated batch by batch straight into store
shards (no input file is written; the store is deleted at the end): ``--corpus generated`` (default,
``bench_corpus.markov_corpus``: ~300-word word-bigram documents from botchan + tinyshakespeare) or ``--corpus
real`` (``real_corpus.real_text_corpus``: resampled real sentences, web-like lengths, non-ASCII words and
mojibake); both with 10 % edited and 2 % exact copies of earlier documents of the same 50,000-document batch
(batch ``b`` seeded with ``7 + b``). Then each path runs in a fresh process on that store
(signatures computed from scratch each time, same chunks and workers):

* ``memory``: ``dedup.dedup_store`` (signatures loaded on the driver, LSH, verification and union-find there);
* ``sharded``: ``dedup.sharded.dedup_sharded`` with ``local_pmap`` (the fuzzy steps as worker tasks, the edge
  files replayed and the result returned on the driver);
* ``stage-before`` / ``stage``: the dedup stage's work as the build does it with ``dedup.sharded`` (exact copies
  first, fuzzy dedup of the survivors, ``duplicates.jsonl`` + ``removed.npy`` written), before issue 31's flat
  driver (exact keys, the survivors' subset, the replay, the merge and the report on the driver) and now
  (``dedup_stage_files``: all of it in worker tasks). Their digest is that of the two written files.

Printed per run: wall seconds, peak RSS of the driver (its ``VmHWM``) and of the largest worker process
(``RUSAGE_CHILDREN`` max RSS), clusters / removed / candidate pairs, and a digest of the full result
(clusters, links, Jaccards to survivors, counts): equal digests = identical results.

    .venv/bin/python -m benchmarks.bench_dedup_memory --docs 100000 1000000 --workers 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_pipeline.planted import real_words
from data_pipeline.report import peak_rss_mib

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data" / "corpus"
BATCH = 50_000


def write_store(folder: Path, n: int, shard: int, corpus: str = "generated") -> float:
    """``n`` documents of ``corpus`` into a store at ``folder``; returns the text megabytes written."""
    from tqdm import tqdm

    from benchmarks.bench_corpus import markov_corpus
    from benchmarks.real_corpus import real_sentences, real_text_corpus
    from data_pipeline.store import ShardWriter

    if corpus == "real":
        src = real_sentences()
        if src is None:
            raise SystemExit("--corpus real needs ../shared/data (WikiText-103, LAMBADA, botchan, tinyshakespeare)")

        def batch(m: int, seed: int) -> list[str]:
            return real_text_corpus(m, seed=seed, sources=src)
    else:
        words = real_words([DATA / "botchan.txt", DATA / "tinyshakespeare.txt"])

        def batch(m: int, seed: int) -> list[str]:
            return markov_corpus(words, m, seed=seed)
    folder.mkdir(parents=True)
    size, k = 0, 0
    for b in tqdm(range(0, n, BATCH), desc=f"writing {n:,} {corpus} documents", unit="batch", file=sys.stderr):
        docs = batch(min(BATCH, n - b), 7 + b // BATCH)
        for s in range(0, len(docs), shard):
            w = ShardWriter(folder, k)
            for i, text in enumerate(docs[s:s + shard], start=b + s):
                w.add(i, f"doc-{i}", text)
                size += len(text.encode())
            w.commit({})
            k += 1
    return size / 1e6


def _stage_before(store, tmp: Path, shingle, lsh, workers: int, chunk: int) -> dict:
    """The dedup stage's sharded path before issue 31's flat driver: exact keys grouped, the survivors' subset,
    ``dedup_sharded`` (edges replayed here), ``merge_exact`` and the report rows, all on this process."""
    import numpy as np

    from data_pipeline import dedup as dd
    from data_pipeline.dedup import exact as ex
    from data_pipeline.dedup.sharded import dedup_sharded, local_pmap
    from data_pipeline.files import atomic_save_npy, write_jsonl_atomic

    n = len(store)
    rep_of = ex.exact_representatives(ex.text_keys(store))
    reps = np.flatnonzero(rep_of == np.arange(n))
    sub = ex.write_subset(store, reps, tmp / "exact-survivors")
    res = ex.merge_exact(dedup_sharded(sub, tmp / "sig-exact", tmp / "work", shingle, lsh, chunk, 20000,
                                       local_pmap(workers), workers), reps, rep_of)
    rows, removed = dd.duplicate_rows(store, res.clusters, res.link, lambda root, m: res.to_survivor[m])
    atomic_save_npy(tmp / "out" / "removed.npy", np.asarray(sorted(removed), dtype=np.int64))
    write_jsonl_atomic(tmp / "out" / "duplicates.jsonl", rows)
    return {"clusters": len(res.clusters), "removed": len(removed), "candidates": res.candidates,
            "phases": res.seconds}


def run_one(path: str, store_dir: Path, tmp: Path, workers: int, chunk: int) -> dict:
    """In this (fresh) process: one dedup of the store; the measurements as a dict."""
    from data_pipeline import dedup as dd
    from data_pipeline.dedup.sharded import dedup_sharded, dedup_stage_files, local_pmap
    from data_pipeline.doc_store import DocStore

    shingle, lsh = dd.ShingleSpec(5, "word"), dd.LshSpec(0.7, 128, 20, 6, 1)
    store = DocStore(store_dir)
    rss0 = peak_rss_mib()[0]
    t = time.perf_counter()
    if path in ("stage-before", "stage"):  # exact + fuzzy + the report files, as the build's dedup stage
        (tmp / "out").mkdir()
        if path == "stage":
            got = dedup_stage_files(store, tmp / "sig", tmp / "work", tmp / "out", shingle, lsh, chunk, 20000,
                                    local_pmap(workers), True, workers)
            got = {"clusters": got["clusters"], "removed": got["removed"], "candidates": got["candidates"],
                   "phases": got["seconds"]}
        else:
            got = _stage_before(store, tmp, shingle, lsh, workers, chunk)
        secs = time.perf_counter() - t
        driver, _ = peak_rss_mib()
        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        h = hashlib.sha256()
        for f in ("duplicates.jsonl", "removed.npy"):
            h.update((tmp / "out" / f).read_bytes())
        return {"path": path, "docs": len(store), "seconds": round(secs, 1), "driver_mib": round(driver),
                "driver_after_open_mib": round(rss0), "worker_mib": round(kids), **got,
                "digest": "files " + h.hexdigest()[:16]}
    if path == "memory":
        res = dd.dedup_store(store, tmp / "sig", shingle, lsh, chunk, workers, 20000, progress=False)
    else:
        res = dedup_sharded(store, tmp / "sig", tmp / "work", shingle, lsh, chunk, 20000, local_pmap(workers),
                            workers)
    secs = time.perf_counter() - t
    driver, _ = peak_rss_mib()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    summary = json.dumps([sorted(res.clusters.items()), sorted(res.link.items()), sorted(res.to_survivor.items()),
                          [res.candidates, res.verified, res.accepted, res.rejected, res.skipped,
                           res.unsignatured_count()]])
    return {"path": path, "docs": len(store), "seconds": round(secs, 1), "driver_mib": round(driver),
            "driver_after_open_mib": round(rss0), "worker_mib": round(kids), "clusters": len(res.clusters),
            "removed": sum(len(m) - 1 for m in res.clusters.values()), "candidates": res.candidates,
            "digest": hashlib.sha256(summary.encode()).hexdigest()[:16], "phases": res.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, nargs="+", default=[100_000])
    ap.add_argument("--paths", nargs="+", default=["memory", "sharded"], choices=["memory", "sharded", "stage-before", "stage"])
    ap.add_argument("--corpus", choices=["generated", "real"], default="generated",
                    help="the documents: markov bigram text, or resampled real sentences (benchmarks/real_corpus.py)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2000, help="documents per signature chunk and per store shard")
    ap.add_argument("--tmp", default=None, help="folder for the store and the signatures (default: a new temp dir)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one measured run
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, Path(args.store), Path(args.tmp), args.workers, args.chunk)))
        return
    print("| documents | text MB | path | wall s | peak RSS driver (MiB) | driver after opening the store (MiB) "
          "| peak RSS largest worker (MiB) | clusters | removed | candidate pairs | result digest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.docs:
        tmp = Path(tempfile.mkdtemp(prefix="bench_dedup_mem_", dir=args.tmp))
        try:
            t = time.perf_counter()
            mb = write_store(tmp / "store", n, args.chunk, args.corpus)
            print(f"<!-- {n:,} {args.corpus} documents, {mb:,.0f} MB written in {time.perf_counter() - t:.0f} s -->",
                  flush=True)
            for path in args.paths:
                run_tmp = tmp / path
                run_tmp.mkdir()
                out = subprocess.run([sys.executable, "-m", "benchmarks.bench_dedup_memory", "--run", path,
                                      "--store", str(tmp / "store"), "--tmp", str(run_tmp), "--workers",
                                      str(args.workers), "--chunk", str(args.chunk)],
                                     cwd=ROOT, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{path} at {n} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {n:,} | {mb:,.0f} | {path} | {r['seconds']} | {r['driver_mib']} | "
                      f"{r['driver_after_open_mib']} | {r['worker_mib']} | {r['clusters']:,} | {r['removed']:,} | "
                      f"{r['candidates']:,} | {r['digest']} |", flush=True)
                shutil.rmtree(run_tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
