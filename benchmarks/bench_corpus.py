"""Corpus-building benchmark.

1. A full build (ingest → tokenizer → filter → dedup → export) of a planted near-duplicate corpus
   made from real text (../shared/data/corpus): docs/s and peak RSS per stage, from stats.json.
2. The dedup stage exactly as the build runs it (``dedup.dedup_store``: vectorised shingle fingerprints
   + batch MinHash in worker processes, band-sort LSH at 20×6, Jaccard verification of every candidate
   pair not already joined, union-find) against a plain datasketch baseline on the same documents:
   per-document ``MinHash(num_perm=128)`` + ``update_batch`` of the same word-5-gram shingles (bytes,
   default SHA-1 hash) and ``MinHashLSH(threshold=0.7, num_perm=128)`` query-then-insert, clusters =
   connected components of the LSH candidates (the baseline does no verification). Repetitions are
   interleaved (ours, baseline, ours, ...); median and min–max of docs/s (wall) and the CPU seconds
   (this process + its worker processes) are reported, with pair recall against the exact Jaccard of
   every pair and the number of pairs below 0.7 each one merged, and the machine's load average.
3. Optional, one run each, in a separate interpreter (a throwaway venv: neither is a project dependency),
   skipped with a message when it cannot be imported:
   * HuggingFace datatrove 0.10 MinHash steps 1-3 (signatures → buckets → clusters; local executor,
     20×6 buckets, 64-bit xxhash, its spaCy English word tokenizer, no verification) with
     ``--datatrove-python`` (venv: ``pip install datatrove spacy regex tokenizers orjson 'xxhash<4'``;
     datatrove 0.10.1 passes ``str`` to ``xxh64_intdigest``, which xxhash 4 rejects);
   * text-dedup 0.4 (PyPI) ``text_dedup.minhash`` (HF datasets map + union-find, 128 perms, 20×6,
     xxh3, no false-positive check; timed from load to save) with ``--textdedup-python``
     (venv: ``pip install text-dedup``).

    .venv/bin/python benchmarks/bench_corpus.py --families 600 --variants 4 --reps 5 --workers 2 \
        [--datatrove-python /tmp/venv-dt/bin/python] [--textdedup-python /tmp/venv-td/bin/python]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
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


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its reaped children (the pool workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def ours(store: DocStore, tmp: Path, workers: int, chunk: int) -> tuple[float, float, dict[int, int], dd.DedupResult]:
    shingle = dd.ShingleSpec(5, "word")
    b, r = dd.lsh_params(0.7, 128, None, None, (0.1, 0.9))
    lsh = dd.LshSpec(0.7, 128, b, r, 1)
    sig_dir = tmp / "sigs"
    shutil.rmtree(sig_dir, ignore_errors=True)
    c, t = cpu_seconds(), time.perf_counter()
    res = dd.dedup_store(store, sig_dir, shingle, lsh, chunk, workers, 20000, progress=False)
    secs, cpu = time.perf_counter() - t, cpu_seconds() - c
    return secs, cpu, {m: root for root, ms in res.clusters.items() for m in ms}, res


def baseline(texts: list[str]) -> tuple[float, float, dict[int, int]]:
    from datasketch import MinHash, MinHashLSH

    c, t = cpu_seconds(), time.perf_counter()
    lsh = MinHashLSH(threshold=0.7, num_perm=128)
    uf = dd.UnionFind()
    for j, text in enumerate(texts):
        u = re.findall(r"\w+", text.lower())
        m = MinHash(num_perm=128)
        m.update_batch([" ".join(u[i:i + 5]).encode("utf-8") for i in range(max(1, len(u) - 4))])
        for i in lsh.query(m):
            uf.union(i, j)
        lsh.insert(j, m)
    secs, cpu = time.perf_counter() - t, cpu_seconds() - c
    return secs, cpu, {m: root for root, ms in uf.clusters().items() for m in ms}


# Runs under the --datatrove-python interpreter; argv: input folder (one jsonl per worker), work dir, workers,
# docs per file. Prints one JSON line: the seconds of steps 1-3 and {global doc index: cluster id}.
DATATROVE_SCRIPT = r'''
import json, logging, sys, time
from pathlib import Path
import numpy as np
from loguru import logger
logger.remove()
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                               MinhashDedupSignature)
from datatrove.pipeline.readers import JsonlReader
from datatrove.utils.hashing import HashConfig
inp, work, workers, per_file = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = MinhashConfig(n_grams=5, num_buckets=20, hashes_per_bucket=6, hash_config=HashConfig(precision=64))
steps = [
    ([JsonlReader(inp, glob_pattern="*.jsonl", id_key="id", text_key="text"),
      MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg)], workers, workers),
    # one task per bucket, run in-process: a worker pool would spawn a fresh interpreter per task
    ([MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=cfg)],
     cfg.num_buckets, 1),
    ([MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove_ids"), config=cfg,
                          save_cluster_id=True)], 1, 1),
]
t = time.perf_counter()
step_s = []
for k, (pipe, tasks, procs) in enumerate(steps):
    LocalPipelineExecutor(pipeline=pipe, tasks=tasks, workers=procs, logging_dir=str(work / f"logs{k}"),
                          skip_completed=False).run()
    step_s.append(round(time.perf_counter() - t - sum(step_s), 3))
secs = time.perf_counter() - t
member = {}
for f in sorted((work / "remove_ids").glob("*.clusters")):
    for d, c in np.fromfile(f, dtype="<u4").reshape(-1, 2).tolist():
        member[int(f.stem) * per_file + d] = c
print(json.dumps({"seconds": secs, "steps": step_s, "member": member}))
'''


def datatrove(python: str | None, texts: list[str], tmp: Path, workers: int) -> tuple[float, dict[int, int]] | str:
    """(seconds, {doc: cluster}) of datatrove's MinHash steps 1-3 (signatures, buckets, clusters; the
    4th step only re-reads the documents to drop them) under ``python``; or why it was skipped."""
    if not python:
        return "no --datatrove-python given"
    probe = subprocess.run([python, "-c", "import datatrove.pipeline.dedup.minhash"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import datatrove: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    folder = tmp / "dt_in"
    folder.mkdir(exist_ok=True)
    per_file = -(-len(texts) // workers)  # one input file per worker: datatrove shards by file
    for r in range(workers):
        part = range(r * per_file, min(len(texts), (r + 1) * per_file))
        lines = (json.dumps({"id": str(i), "text": texts[i]}) + "\n" for i in part)
        (folder / f"{r:06d}.jsonl").write_text("".join(lines))
    work = tmp / "dt_work"
    shutil.rmtree(work, ignore_errors=True)
    out = subprocess.run([python, "-c", DATATROVE_SCRIPT, str(folder), str(work), str(workers), str(per_file)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return "datatrove failed: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"datatrove steps 1-3 (s): {res['steps']}")
    return res["seconds"], {int(k): int(v) for k, v in res["member"].items()}


# Runs under the --textdedup-python interpreter; argv: input jsonl, output dir, workers. Prints one JSON line:
# the seconds of text-dedup's minhash main() (load, MinHash, LSH clustering, filter, save) and the clusters
# read from its module-level union-find.
TEXTDEDUP_SCRIPT = r'''
import json, logging, sys, time
from collections import Counter
inp, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
import datasets
datasets.disable_progress_bars()
import text_dedup.minhash as tm
tm.logger.setLevel(logging.WARNING)
n = sum(1 for _ in open(inp))
t = time.perf_counter()
tm.main.main(args=["--path", "json", "--data_files", inp, "--split", "train", "--output", out, "--column", "text",
                   "--num_perm", "128", "--b", "20", "--r", "6", "--hash_func", "xxh3", "--hash_bits", "32",
                   "--num_proc", str(workers), "--cache_dir", out + "_cache"], standalone_mode=False)
secs = time.perf_counter() - t
roots = {i: tm.uf.find(i) for i in range(n)}
size = Counter(roots.values())
print(json.dumps({"seconds": secs, "member": {i: r for i, r in roots.items() if size[r] > 1}}))
'''


def textdedup(python: str | None, texts: list[str], tmp: Path, workers: int) -> tuple[float, dict[int, int]] | str:
    """(seconds, {doc: cluster}) of text-dedup's (PyPI 0.4) ``text_dedup.minhash`` at 128 perms, 20x6 bands, xxh3,
    no false-positive check, under ``python``; or why it was skipped."""
    if not python:
        return "no --textdedup-python given"
    probe = subprocess.run([python, "-c", "import text_dedup.minhash"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import text_dedup: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    inp = tmp / "td_in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = subprocess.run([python, "-c", TEXTDEDUP_SCRIPT, str(inp), str(tmp / "td_out"), str(workers)],
                         capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    if out.returncode != 0:
        return "text-dedup failed: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["seconds"], {int(k): int(v) for k, v in res["member"].items()}


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
    ap.add_argument("--chunk", type=int, default=500, help="documents per signature chunk (dedup.chunk_size)")
    ap.add_argument("--skip-build", action="store_true", help="only the dedup comparison")
    ap.add_argument("--datatrove-python", default=None,
                    help="python of a separate venv with datatrove installed (optional comparison)")
    ap.add_argument("--textdedup-python", default=None,
                    help="python of a separate venv with text-dedup installed (optional comparison)")
    args = ap.parse_args()
    words = real_words([DATA / "botchan.txt", DATA / "tinyshakespeare.txt"])
    fams = min(args.families, len(words) // 300)
    texts, _ = planted_corpus(words, fams, args.variants, max_edit_frac=0.08, seed=11)
    n = len(texts)
    tmp = Path(tempfile.mkdtemp(prefix="bench_corpus_"))
    load0 = os.getloadavg()
    try:
        # ---------------------------------------------------------------- 1. full build, per stage
        if not args.skip_build:
            inp = tmp / "planted.jsonl"
            inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            cfg = config_from_dict({"output_dir": str(tmp / "out"), "sources": [{"type": "jsonl", "path": str(inp)}],
                                    "workers": args.workers, "shard_size": 500, "progress": False,
                                    "tokenizer": {"vocab_size": 8000}, "dedup": {"chunk_size": args.chunk}})
            _, stats = build(cfg, force=True)
            print(f"\n## full build: {n} planted documents, workers={args.workers}")
            print(f"documents: {stats['documents']}")
            print("| stage | seconds | docs in | docs/s | peak RSS main (MiB) | peak RSS workers (MiB) |")
            print("|---|---|---|---|---|---|")
            for k, s in stats["stages"].items():
                print(f"| {k} | {s['seconds']:.2f} | {s['docs_in']} | {s['docs_per_s']:.0f} | {s['peak_rss_mib']:.0f} "
                      f"| {s['peak_rss_children_mib']:.0f} |")
            ded = stats["dedup"]
            print(f"dedup phases (s): {ded['phase_seconds']}; candidates {ded['candidate_pairs']}, measured "
                  f"{ded['measured_pairs']} (skipped {ded['skipped_candidates']}), merging edges "
                  f"{ded['verified_pairs']}, rejected {ded['rejected_candidates']}, removed {ded['removed']}")

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
        t_ours, t_base, c_ours, c_base = [], [], [], []
        load1 = os.getloadavg()
        for _ in range(args.reps):
            s, c, m_ours, res = ours(store, tmp, args.workers, args.chunk)
            t_ours.append(n / s)
            c_ours.append(c)
            s, c, m_base = baseline(texts)
            t_base.append(n / s)
            c_base.append(c)
        load2 = os.getloadavg()
        rows = [(f"ours: dedup_store, {args.workers} procs, 20x6 LSH, verify unjoined pairs", t_ours, c_ours, m_ours),
                ("datasketch MinHash+MinHashLSH(0.7) per doc, unverified", t_base, c_base, m_base)]
        for tool, fn, py, label in (
                ("datatrove", datatrove, args.datatrove_python,
                 f"datatrove 0.10 MinHash steps 1-3, 20x6, {args.workers} workers, unverified (1 run)"),
                ("text-dedup", textdedup, args.textdedup_python,
                 f"text-dedup 0.4 minhash (load..save), 128 perms 20x6, {args.workers} procs, unverified (1 run)")):
            got = fn(py, texts, tmp, args.workers)
            if isinstance(got, str):
                print(f"\n({tool} comparison skipped: {got})")
            else:
                rows.append((label, [n / got[0]], [float("nan")], got[1]))
        print(f"\n## dedup stage vs plain datasketch: {n} documents, {args.reps} interleaved reps")
        print("| method | docs/s median | min–max | CPU s median | recall J>=0.7 | recall J>=0.75 "
              "| pairs J<0.7 in one cluster (transitive) |")
        print("|---|---|---|---|---|---|---|")
        for name, ts, cs, mem in rows:
            r7, n7 = pair_quality(mem, truth, 0.7)
            r75, n75 = pair_quality(mem, truth, 0.75)
            low = sum(1 for (i, j), v in truth.items() if v < 0.7 and i in mem and mem.get(i) == mem.get(j))
            print(f"| {name} | {statistics.median(ts):.0f} | {min(ts):.0f}–{max(ts):.0f} "
                  f"| {statistics.median(cs):.2f} "
                  f"| {r7:.3f} (of {n7}) | {r75:.3f} (of {n75}) | {low} |")
        print(f"\nours: {res.candidates} candidate pairs, {res.verified} measured, {res.skipped} skipped (already "
              f"joined), {res.accepted} merging edges; phases (s, last rep): {res.seconds}")
        print(f"speed-up (median docs/s): {statistics.median(t_ours) / statistics.median(t_base):.2f}x; "
              f"CPU-time ratio (median): {statistics.median(c_base) / statistics.median(c_ours):.2f}x")
        print(f"load average (1/5/15 min): start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
              f"before reps {load1[0]:.1f}, after reps {load2[0]:.1f}")
        print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
              f"{os.cpu_count()} cores, numpy {np.__version__}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
