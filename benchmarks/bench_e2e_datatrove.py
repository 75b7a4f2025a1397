"""End-to-end corpus build: our builder against HuggingFace datatrove 0.10 on the same generated corpus.

The same steps with both, ``--workers`` processes each, on the documents of ``bench_corpus.markov_corpus``
(~300-word word-bigram Markov documents over real text; 10 % near-copies of an earlier document with up to
8 % of words replaced, 2 % exact copies), or with ``--corpus real`` on the real-text corpus of
``benchmarks.real_corpus`` (resampled real sentences, web-like lengths, non-ASCII and some mojibake; skipped
with a message when ../shared/data is absent), written as ``--workers`` jsonl files (datatrove shards by file):

* ours: ``python -m data_pipeline build --config C`` (ingest + ftfy + whitespace normalisation → length
  filter (tokens + EOD >= 128) → exact dedup, then MinHash 128 perms, LSH 20 bands x 6 rows, Jaccard >= 0.7
  verified → GPT-2 BPE tokens written as a Megatron .bin/.idx);
* datatrove (local executor, ``--workers`` tasks and processes per step):
  1. ``JsonlReader`` → ``FTFYFormatter`` → ``TokensCounter(count_eos_token=True)`` → ``LambdaFilter(token_count
     >= 128)`` → ``JsonlWriter`` (the filtered documents, uncompressed) → ``MinhashDedupSignature``
     (``MinhashConfig(n_grams=5, num_buckets=20, hashes_per_bucket=6)``, 64-bit xxhash);
  2. ``MinhashDedupBuckets`` (20 tasks); 3. ``MinhashDedupCluster`` (1 task, cluster ids saved);
  4. ``JsonlReader`` (the filtered documents) → ``MinhashDedupFilter`` → ``DocumentTokenizer`` (no shuffling,
     EOS appended; datatrove's own .ds/.ds.index token files).

Both use the same GPT-2 BPE (``../shared/data/tokenizers/gpt2``): ours loads ``gpt2-vocab.json`` +
``gpt2-merges.txt`` (``tokenizer.type=gpt2``); datatrove gets a ``tokenizer.json`` made from the same two files
with the ``tokenizers`` library (ByteLevel BPE, no prefix space, ``<|endoftext|>`` as EOS) in the temp dir.

Each tool runs as one subprocess under a small wrapper that makes itself the child subreaper (so the
forkserver and pool workers that datatrove leaves behind are reaped by it and their CPU time is counted) and
reports: wall seconds (until the tool's own process exits; reaping the orphans after it takes ~0.03 s), CPU
seconds (user + system of the whole process tree, ``RUSAGE_CHILDREN``; without the subreaper datatrove's
would read ~0.8 s instead of ~14 s at 2,000 documents, its workers' time lost with the forkserver), the peak
RSS of the largest single process (``ru_maxrss``) and the peak of the tree's summed RSS (sampled every
0.1 s from /proc). Then docs/s (input documents / wall), MB/s per core (input jsonl MB / wall / workers),
documents kept, tokens written, and pair recall: the fraction of the pairs with exact word-5-gram Jaccard
>= 0.7 (lower-cased ``\\w+`` words, as ours shingles; every such pair found by an exact prefix-filter
similarity join over 64-bit shingle fingerprints) that the tool put in one cluster; and the number of pairs
below 0.7 inside one cluster.

Where datatrove's steps differ from ours (all are datatrove's defaults or its documented pipeline):

* ftfy: ``FTFYFormatter`` turns off ftfy's ligature/width/quote/line-break fixes and NFC; ours runs ftfy's default
  config, then normalises whitespace.
* shingles: datatrove ``simplify_text`` (lower-case, digits → 0, punctuation removed, diacritics stripped) then
  spaCy's blank-English word tokenizer, 5-grams joined by spaces, 64-bit xxhash, permutations mod 2^61 - 1; ours
  lower-cased ``\\w+`` words, xxh64 per word mixed per 5-gram, datasketch's affine 32-bit permutations.
* no verification: every LSH bucket collision is a union-find edge (so transitive chains and false positives
  merge clusters); ours measures the Jaccard of each candidate pair not already joined and merges only >= 0.7.
* no exact-dedup step (exact copies collide in every band anyway); survivor: the union-find root, ours the
  lowest input index.
* stage 4 re-reads the documents in stage 1's order, so stage 1 also writes the filtered documents as jsonl.
* the token length is counted by a separate ``TokensCounter`` pass and the kept documents are tokenized again by
  ``DocumentTokenizer`` (ours tokenizes once: export writes the filter stage's ids).
* output: datatrove's own .ds + .ds.index per task (uint16 ids, uint64 document ends; no
  ``DocumentTokenizerMerger`` run), ours one Megatron .bin/.idx plus documents/duplicates/rejects jsonl.
* the ``tokenizer.json`` maps a literal ``<|endoftext|>`` in a text to id 50256; ours never makes EOD from text
  (the generated corpus has none: on it both give the same ids).

datatrove is not a project dependency: install it in a throwaway venv outside the repository (no torch
is needed or pulled by these extras; datatrove 0.10.1 passes ``str`` to ``xxh64_intdigest``, which xxhash 4
rejects)::

    python3 -m venv /tmp/dt/venv
    /tmp/dt/venv/bin/pip install 'datatrove[processing]' 'xxhash<4' orjson spacy tokenizers

Run (datatrove is skipped with a message when its python cannot import it)::

    .venv/bin/python -m benchmarks.bench_e2e_datatrove --docs 20000 --workers 2 \\
        --datatrove-python /tmp/dt/venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_corpus import corpus_texts
from data_pipeline import dedup as dd

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / ".." / "shared" / "data" / "tokenizers" / "gpt2"
THRESHOLD = 0.7
MIN_TOKENS = 128

# Runs COMMAND... as a child, reaps every descendant (child subreaper) and writes the measurements as JSON to
# argv[1]: wall seconds, CPU seconds of the tree, ru_maxrss of the largest process, sampled peak of the summed RSS.
WRAPPER = r'''
import ctypes, json, os, resource, subprocess, sys, threading, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
page = os.sysconf("SC_PAGE_SIZE")
def tree_rss(root):
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        todo += kids.get(pid, [])
    return total
peak, done = [0], threading.Event()
def sample():
    while not done.wait(0.1):
        peak[0] = max(peak[0], tree_rss(os.getpid()))
threading.Thread(target=sample, daemon=True).start()
c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
t = time.perf_counter()
rc = subprocess.call(sys.argv[2:])
wall = time.perf_counter() - t  # the command's own process has exited: its work is done
while True:  # orphans re-parented to us (datatrove's forkserver, ...)
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
reaped = time.perf_counter() - t
done.set()
c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"rc": rc, "wall": wall, "reaped": reaped, "cpu": c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime,
           "maxrss_mib": c1.ru_maxrss / 1024, "tree_rss_mib": peak[0] / 2**20}, open(sys.argv[1], "w"))
'''

# Runs under the --datatrove-python interpreter; writes tokenizer.json (argv[3]) from GPT-2's vocab + merges.
TOKENIZER_SCRIPT = r'''
import sys
from tokenizers import ByteLevelBPETokenizer
tok = ByteLevelBPETokenizer(sys.argv[1], sys.argv[2], add_prefix_space=False)
tok.add_special_tokens(["<|endoftext|>"])
assert tok.token_to_id("<|endoftext|>") == 50256
tok.save(sys.argv[3])
'''

# Runs under the --datatrove-python interpreter; argv: input folder, work dir, workers, tokenizer.json.
# Prints one JSON line: seconds per step (wall, and datatrove's own per pipeline step), {doc id: cluster id}, documents kept and tokens written.
DATATROVE_SCRIPT = r'''
import json, re, sys, time
from pathlib import Path
t_start = time.perf_counter()
import numpy as np
from loguru import logger
logger.remove()
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                               MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.filters import LambdaFilter
from datatrove.pipeline.formatters import FTFYFormatter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer, TokensCounter
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig
inp, work, workers, tok = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = MinhashConfig(n_grams=5, num_buckets=20, hashes_per_bucket=6, hash_config=HashConfig(precision=64))
steps = [
    ("read+ftfy+length filter+signatures",
     [JsonlReader(inp, glob_pattern="*.jsonl", id_key="id", text_key="text"), FTFYFormatter(),
      TokensCounter(tok, count_eos_token=True), LambdaFilter(lambda d: d.metadata["token_count"] >= 128),
      JsonlWriter(str(work / "filtered"), compression=None),
      MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg)], workers),
    ("buckets", [MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"),
                                     config=cfg)], cfg.num_buckets),
    ("cluster", [MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove_ids"),
                                     config=cfg, save_cluster_id=True)], 1),
    ("filter+tokenize", [JsonlReader(str(work / "filtered"), glob_pattern="*.jsonl", id_key="id", text_key="text"),
                         MinhashDedupFilter(input_folder=str(work / "remove_ids")),
                         DocumentTokenizer(output_folder=str(work / "tokenized"), tokenizer_name_or_path=tok,
                                           eos_token="<|endoftext|>", shuffle_documents=False)], workers),
]
step_s = {"import": round(time.perf_counter() - t_start, 3)}
for k, (name, pipe, tasks) in enumerate(steps):
    t = time.perf_counter()
    LocalPipelineExecutor(pipeline=pipe, tasks=tasks, workers=min(tasks, workers),
                          logging_dir=str(work / f"logs{k}"), skip_completed=False).run()
    step_s[name] = round(time.perf_counter() - t, 3)
member = {}
for f in sorted((work / "remove_ids").glob("*.clusters")):
    with open(work / "filtered" / f"{f.stem[-5:]}.jsonl") as g:
        ids = [json.loads(line)["id"] for line in g]
    for d, c in np.fromfile(f, dtype="<u4").reshape(-1, 2).tolist():
        member[ids[d]] = c
parts, counts = {}, {}  # datatrove's own time per pipeline step, summed over tasks
for k in range(len(steps)):
    for x in json.loads((work / f"logs{k}" / "stats.json").read_text()):
        name = f"{k + 1}. " + " ".join(re.sub(r"[^a-zA-Z0-9 ]", " ", x["name"]).split())
        parts[name] = round(parts.get(name, 0) + x["time_stats"]["total"], 3)
        if "Lambda" in name or "stage 4" in name:  # documents dropped by the length filter / by dedup
            counts[name] = x["stats"].get("dropped", 0)
tokenized = work / "tokenized"
kept = sum(p.stat().st_size // 8 for p in tokenized.rglob("*.ds.index"))
tokens = sum(p.stat().st_size // 2 for p in tokenized.rglob("*.ds"))
print(json.dumps({"steps": step_s, "parts": parts, "dropped": counts, "member": member, "kept": kept, "tokens": tokens}))
'''


def measured(cmd: list[str], tmp: Path, name: str, **kw) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``cmd`` under :data:`WRAPPER`; (its measurements, the completed process)."""
    rep = tmp / f"{name}.rusage.json"
    run = subprocess.run([sys.executable, "-c", WRAPPER, str(rep), *cmd], capture_output=True, text=True, **kw)
    return json.loads(rep.read_text()), run


def similar_pairs(texts: list[str], threshold: float) -> dict[tuple[int, int], float]:
    """Every pair (i < j) with word-5-gram Jaccard >= ``threshold``, with its Jaccard: an exact prefix-filter
    join (shingles ordered rarest first; two sets with J >= t share a token among the first
    ``|A| - ceil(t |A|) + 1`` of each) over the 64-bit fingerprint sets of lower-cased ``\\w+`` words."""
    vals, offs = dd.shingle_sets_batch(texts, dd.ShingleSpec(5, "word"))
    sizes = np.diff(offs)
    uniq, inv, freq = np.unique(vals, return_inverse=True, return_counts=True)
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[np.lexsort((uniq, freq))] = np.arange(len(uniq))  # global order: rarest first
    tok_rank = rank[inv]
    doc_of = np.repeat(np.arange(len(texts)), sizes)
    order = np.lexsort((tok_rank, doc_of))  # within each document, rarest first
    pos = np.arange(len(vals)) - np.repeat(offs[:-1], sizes)
    plen = np.array([s - math.ceil(threshold * s - 1e-9) + 1 if s else 0 for s in sizes.tolist()])
    in_prefix = pos < np.repeat(plen, sizes)
    keys, docs = tok_rank[order][in_prefix], doc_of[order][in_prefix]
    by = np.lexsort((docs, keys))
    keys, docs = keys[by], docs[by]
    cuts = np.flatnonzero(np.diff(keys)) + 1
    cand: set[tuple[int, int]] = set()
    for group in np.split(docs, cuts):
        if len(group) > 1:
            g = np.unique(group).tolist()
            cand.update((a, b) for k, a in enumerate(g) for b in g[k + 1:])
    out = {}
    for i, j in cand:
        a, b = vals[offs[i]:offs[i + 1]], vals[offs[j]:offs[j + 1]]
        inter = len(np.intersect1d(a, b, assume_unique=True))
        jac = inter / (len(a) + len(b) - inter)
        if jac >= threshold:
            out[(i, j)] = jac
    return out


def quality(member: dict[int, int], truth: dict[tuple[int, int], float], texts: list[str]) -> tuple[float, int]:
    """(recall of the ``truth`` pairs, pairs below the threshold inside one cluster)."""
    recall = sum(1 for i, j in truth if i in member and member[i] == member.get(j)) / max(1, len(truth))
    clusters: dict[int, list[int]] = {}
    for d, c in member.items():
        clusters.setdefault(c, []).append(d)
    spec = dd.ShingleSpec(5, "word")
    low = 0
    for ms in clusters.values():
        ms.sort()
        sets = {d: dd.shingle_set(texts[d], spec) for d in ms}
        low += sum(1 for k, a in enumerate(ms) for b in ms[k + 1:]
                   if (a, b) not in truth and dd.jaccard(sets[a], sets[b]) < THRESHOLD)
    return recall, low


def run_ours(inp: Path, tmp: Path, workers: int) -> tuple[dict, dict[int, int], dict, list[str]]:
    out = tmp / "ours_out"
    cfg = tmp / "ours.yaml"
    cfg.write_text(json.dumps({
        "output_dir": str(out), "sources": [{"type": "jsonl", "path": str(inp), "id_field": "id"}],
        "workers": workers, "shard_size": 2000, "progress": False,
        "tokenizer": {"type": "gpt2", "vocab_file": str((GPT2 / "gpt2-vocab.json").resolve()),
                      "merges_file": str((GPT2 / "gpt2-merges.txt").resolve())},
        "length": {"min_tokens": MIN_TOKENS, "count_eod": True},
        "dedup": {"threshold": THRESHOLD, "num_perm": 128, "bands": 20, "rows": 6, "shingle_size": 5,
                  "shingle_unit": "word", "chunk_size": 2000}}))
    cmd = [sys.executable, "-m", "data_pipeline", "build", "--config", str(cfg)]
    m, run = measured(cmd, tmp, "ours", cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if m["rc"] != 0:
        raise SystemExit(f"our build failed:\n{run.stderr[-3000:]}")
    member: dict[int, int] = {}
    for line in open(out / "duplicates.jsonl"):
        row = json.loads(line)
        for d in [row["kept_i"]] + [r["i"] for r in row["removed"]]:
            member[d] = row["kept_i"]
    stats = json.loads((out / "stats.json").read_text())
    return m, member, stats, cmd


def run_datatrove(python: str, folder: Path, tmp: Path, workers: int) -> tuple[dict, dict[int, int], dict, list[str]] | str:
    probe = subprocess.run([python, "-c", "import datatrove.pipeline.dedup.minhash, datatrove.pipeline.formatters, "
                                          "datatrove.pipeline.tokens, spacy, tokenizers"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import datatrove: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    tok = tmp / "tokenizer.json"
    made = subprocess.run([python, "-c", TOKENIZER_SCRIPT, str(GPT2 / "gpt2-vocab.json"),
                           str(GPT2 / "gpt2-merges.txt"), str(tok)], capture_output=True, text=True)
    if made.returncode != 0:
        return "could not build tokenizer.json: " + (made.stderr.strip().splitlines() or ["?"])[-1]
    work = tmp / "dt_work"
    cmd = [python, "-c", DATATROVE_SCRIPT, str(folder), str(work), str(workers), str(tok)]
    m, run = measured(cmd, tmp, "datatrove")
    if m["rc"] != 0:
        return "datatrove failed: " + run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    member = {int(k.rsplit("-", 1)[1]): int(v) for k, v in res["member"].items()}
    shown = cmd[:2] + ["$DATATROVE_SCRIPT"] + cmd[3:]
    return m, member, res, shown


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--datatrove-python", default=None, help="python of a venv with datatrove (see the docstring)")
    ap.add_argument("--corpus", choices=("generated", "real"), default="generated",
                    help="the Markov corpus or the real-text corpus (benchmarks.real_corpus)")
    ap.add_argument("--skip-ours", action="store_true", help="run only datatrove")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (inputs, configs, both outputs)")
    args = ap.parse_args(argv)
    texts = corpus_texts(args.corpus, args.docs)
    if texts is None:
        print(f"(skipped: the {args.corpus} corpus needs ../shared/data, which is absent)")
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_e2e_dt_"))
    try:
        load0 = os.getloadavg()
        folder = tmp / "input"
        folder.mkdir()
        per = -(-len(texts) // args.workers)  # one input file per worker: datatrove shards by file
        for r in range(args.workers):
            with open(folder / f"{r:05d}.jsonl", "w", encoding="utf-8") as f:
                for i in range(r * per, min(len(texts), (r + 1) * per)):
                    f.write(json.dumps({"id": f"doc-{i}", "text": texts[i]}) + "\n")
        mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        t = time.perf_counter()
        truth = similar_pairs(texts, THRESHOLD)
        print(f"command: {shlex.join([Path(sys.executable).name, '-m', 'benchmarks.bench_e2e_datatrove', *sys.argv[1:]])}")
        print(f"## end to end vs datatrove: {args.docs} {args.corpus} documents, {mb:.1f} MB jsonl in {args.workers} files, "
              f"workers={args.workers}; {len(truth)} pairs with word-5-gram Jaccard >= {THRESHOLD} "
              f"(found in {time.perf_counter() - t:.1f} s)")
        rows, cmds, notes = [], [], []
        if not args.skip_ours:
            m, member, stats, cmd = run_ours(folder, tmp, args.workers)
            ded = stats["dedup"]
            stages = ", ".join(f"{k} {s['seconds']:.2f}" for k, s in stats["stages"].items())
            notes.append(f"ours stages (s): {stages}; too short {stats['documents']['too_short']}, exact duplicates "
                         f"{ded.get('exact_duplicates')}, removed by dedup {ded['removed']}")
            rows.append(("ours (data_pipeline build)", m, member, stats["documents"]["kept"], stats["tokens"]["kept"]))
            cmds.append(f"(cd {ROOT} && PYTHONPATH={ROOT} {shlex.join(cmd)})  # config: {tmp / 'ours.yaml'}")
        got = run_datatrove(args.datatrove_python, folder, tmp, args.workers) if args.datatrove_python \
            else "no --datatrove-python given"
        if isinstance(got, str):
            print(f"\n(datatrove skipped: {got})")
        else:
            m, member, res, cmd = got
            notes.append(f"datatrove steps, wall (s): {res['steps']}")
            notes.append(f"datatrove pipeline steps, its own time summed over tasks (s): {res['parts']}")
            notes.append(f"datatrove documents dropped: {res['dropped']}")
            rows.append(("datatrove 0.10 (local executor)", m, member, res["kept"], res["tokens"]))
            cmds.append(shlex.join(cmd))
        print(f"\n| tool | wall s | CPU s | docs/s | MB/s per core | peak RSS largest process (MiB) "
              f"| peak RSS process tree (MiB) | docs kept | tokens | recall J>={THRESHOLD} (of {len(truth)}) "
              f"| pairs J<{THRESHOLD} in one cluster |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, m, member, kept, tokens in rows:
            recall, low = quality(member, truth, texts)
            print(f"| {name} | {m['wall']:.2f} | {m['cpu']:.1f} | {args.docs / m['wall']:,.0f} "
                  f"| {mb / m['wall'] / args.workers:.2f} | {m['maxrss_mib']:.0f} | {m['tree_rss_mib']:.0f} "
                  f"| {kept} | {tokens if tokens is not None else '-'} | {recall:.4f} | {low} |")
        print()
        for n in notes:
            print(n)
        print(f"\ncommands, each run under WRAPPER ($DATATROVE_SCRIPT: the string in {Path(__file__).name}; temp dir "
              f"{'kept' if args.keep_tmp else 'removed afterwards'}):")
        for c in cmds:
            print(f"    {c}")
        load1 = os.getloadavg()
        print(f"load average (1 min): start {load0[0]:.1f}, end {load1[0]:.1f}; machine: {os.cpu_count()} cores, "
              f"python {platform.python_version()}")
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
