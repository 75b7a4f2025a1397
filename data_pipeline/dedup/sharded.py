"""Near-duplicate removal whose driver holds nothing per document: every step a worker task.

0. exact copies (the stage, :func:`dedup_stage_files`): key map/reduce and the survivors' store, per shard
   group and key partition (:mod:`~data_pipeline.dedup.exact_sharded`);
1. signatures: :func:`~data_pipeline.dedup.minhash.sign_chunk` per chunk (as before; nothing loaded back);
2. buckets: :func:`~data_pipeline.dedup.buckets.bucket_chunk` per chunk (band keys → partition files), then
   :func:`~data_pipeline.dedup.buckets.reduce_partition` per partition (buckets → candidate pairs, split by
   the range of their lower document);
3. verification: :func:`~data_pipeline.dedup.edges.verify_range` per document range (Jaccard of the pairs
   not already joined within the range → edge files);
4. components: :func:`~data_pipeline.dedup.components.replay_edges` streams the edge files in range order
   (memory: one range's edges + the clustered documents), then the Jaccard of each removed member to its
   survivor is reused from an accepted edge or measured. In the stage (:func:`dedup_stage_files`) this is
   one worker task, :func:`~data_pipeline.dedup.components.components_task`, which also merges the exact
   copies back and writes ``duplicates.jsonl`` and ``removed.npy``; :func:`dedup_sharded` (tests,
   benchmarks) replays on the calling process and returns the result.

The result (clusters, links, Jaccards to survivors, candidate / measured / accepted / rejected / skipped
counts) equals :func:`data_pipeline.dedup.dedup_store`'s, for any number of partitions and ranges (tested).
``pmap(fn, jobs)`` runs the tasks and returns their results in job order: the build's executor's ``map``
(:mod:`data_pipeline.executor`: forked workers or Ray tasks), or :func:`local_pmap` (tests, benchmarks). Intermediate files live in ``work`` and are removed
as soon as the next step has read them; they are written without ``fsync`` (a plain ``np.save``): ``work`` is
emptied at the start of every run, so an interrupted run's files are never read (the signature chunks, which
are reused on resume, are still written atomically).
"""
from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from data_pipeline.dedup.buckets import BucketJob, ReduceJob, bucket_chunk, reduce_partition
from data_pipeline.dedup.components import ComponentsJob, components_task, replay_edges
from data_pipeline.dedup.edges import MeasureJob, RangeJob, measure_pairs, verify_range
from data_pipeline.dedup.exact_sharded import (
    DOCS_PER_GROUP,
    KeyMapJob,
    KeyReduceJob,
    SubsetJob,
    key_map,
    key_reduce,
    shard_groups,
    write_subset_group,
)
from data_pipeline.dedup.hashing import ShingleSpec
from data_pipeline.dedup.lsh import LshSpec
from data_pipeline.dedup.minhash import sign_chunk, sign_jobs
from data_pipeline.dedup.verify import DedupResult, pair_blocks
from data_pipeline.doc_store import DocStore
from data_pipeline.executor import LocalExecutor
from data_pipeline.store import write_text_from

log = logging.getLogger(__name__)

PMap = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
#: bucket records per partition (32 bytes each at 6 rows): bounds a reduce task's memory
RECORDS_PER_PARTITION = 1_000_000
#: documents per verification range (by the lower document of a pair): bounds a verification task
DOCS_PER_RANGE = 100_000


def local_pmap(workers: int) -> PMap:
    """``pmap`` over ``workers`` forked processes: :meth:`data_pipeline.executor.LocalExecutor.map` (in this process
    when 1; the build's shared pool during a build; a single job runs in a worker too)."""
    return LocalExecutor(workers).map


def layout(n: int, bands: int, min_tasks: int, records_per_part: int = RECORDS_PER_PARTITION,
           docs_per_range: int = DOCS_PER_RANGE) -> tuple[int, int, int]:
    """(partitions, ranges, documents per range): enough tasks for ``min_tasks`` workers, and more as the
    corpus grows so each task's share stays bounded."""
    parts = max(1, min_tasks, -(-n * bands // records_per_part))
    ranges = max(1, min_tasks, -(-n // docs_per_range))
    range_docs = max(1, -(-n // ranges))
    return parts, -(-n // range_docs) if n else 1, range_docs


def fuzzy_edges(store: DocStore, sig_dir: Path, work: Path, shingle: ShingleSpec, lsh: LshSpec, chunk_size: int,
                max_docs: int, pmap: PMap, min_tasks: int = 1, records_per_part: int = RECORDS_PER_PARTITION,
                docs_per_range: int = DOCS_PER_RANGE) -> tuple[int, int, dict[str, float]]:
    """Steps 1-3 (module docstring): signatures, buckets, verification; the edge files end in ``work/edges``
    (``work`` is emptied first). Returns (ranges, documents without a signature, seconds per phase)."""
    t0 = time.perf_counter()
    n = len(store)
    if n >= 2**31:
        raise ValueError(f"dedup_sharded handles < 2^31 documents per store, got {n}")
    pmap(sign_chunk, sign_jobs(store, sig_dir, lsh.num_perm, lsh.seed, shingle, chunk_size))
    t1 = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    buckets, pairs, edges = work / "buckets", work / "pairs", work / "edges"
    for d in (buckets, pairs, edges):
        d.mkdir(parents=True)
    parts, ranges, range_docs = layout(n, lsh.bands, min_tasks, records_per_part, docs_per_range)
    starts = tuple(range(0, n, chunk_size))
    unsignatured = sum(pmap(bucket_chunk, [BucketJob(str(sig_dir), s, lsh.bands, lsh.rows, parts, str(buckets))
                                           for s in starts]))
    pmap(reduce_partition, [ReduceJob(str(buckets), p, starts, n, range_docs, str(pairs)) for p in range(parts)])
    shutil.rmtree(buckets)
    t2 = time.perf_counter()
    pmap(verify_range, [RangeJob(str(pairs), r, str(sig_dir), n, chunk_size, lsh.threshold, max_docs, str(edges))
                        for r in range(ranges)])
    shutil.rmtree(pairs)
    log.info("dedup (sharded): %d documents, %d partitions, %d ranges", n, parts, ranges)
    return ranges, unsignatured, {"minhash": round(t1 - t0, 3), "lsh": round(t2 - t1, 3),
                                  "verify_cluster": round(time.perf_counter() - t2, 3)}


def dedup_sharded(store: DocStore, sig_dir: Path, work: Path, shingle: ShingleSpec, lsh: LshSpec, chunk_size: int,
                  max_docs: int, pmap: PMap, min_tasks: int = 1, records_per_part: int = RECORDS_PER_PARTITION,
                  docs_per_range: int = DOCS_PER_RANGE) -> DedupResult:
    """The whole fuzzy stage as worker tasks (module docstring), the result returned to this process (the
    form tests and benchmarks compare; the build's stage uses :func:`dedup_stage_files`, whose driver holds
    no per-document result); ``work`` is emptied and removed."""
    n = len(store)
    ranges, unsignatured, seconds = fuzzy_edges(store, sig_dir, work, shingle, lsh, chunk_size, max_docs, pmap,
                                                min_tasks, records_per_part, docs_per_range)
    t2 = time.perf_counter()
    res, accepted = replay_edges(work / "edges", ranges, n, lsh.threshold)
    shutil.rmtree(work)
    need = [(root, m) for root, ms in res.clusters.items() for m in ms[1:]]
    accepted.reuse(res, need)
    del accepted
    blocks = [tuple(b) for b in pair_blocks([p for p in need if p[1] not in res.to_survivor], max_docs)]
    for block, jacs in zip(blocks, pmap(measure_pairs, [MeasureJob(str(sig_dir), n, chunk_size, b) for b in blocks])):
        for (_, m), jac in zip(block, jacs):
            res.to_survivor[m] = jac
    res.unsignatured = unsignatured
    res.seconds = {**seconds, "verify_cluster": round(seconds["verify_cluster"] + time.perf_counter() - t2, 3)}
    log.info("dedup (sharded): %d candidate pairs, %d clusters", res.candidates, len(res.clusters))
    return res


def dedup_stage_files(store: DocStore, sig_dir: Path, work: Path, out: Path, shingle: ShingleSpec, lsh: LshSpec,
                      chunk_size: int, max_docs: int, pmap: PMap, exact: bool, min_tasks: int = 1,
                      records_per_part: int = RECORDS_PER_PARTITION, docs_per_range: int = DOCS_PER_RANGE,
                      docs_per_group: int = DOCS_PER_GROUP) -> dict[str, Any]:
    """The dedup stage with a driver that holds nothing per document: exact copies by key map/reduce
    (:mod:`~data_pipeline.dedup.exact_sharded`), the fuzzy steps on the survivors (:func:`fuzzy_edges`), then
    one components task that writes ``out/duplicates.jsonl`` and ``out/removed.npy``
    (:func:`~data_pipeline.dedup.components.components_task`). The files equal those the stage writes from
    :func:`data_pipeline.dedup.dedup_store` + :func:`~data_pipeline.dedup.exact.merge_exact` (tested).
    Returns the counts and seconds per phase; ``work`` is emptied and removed."""
    t0 = time.perf_counter()
    n = len(store)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fuzzy_store, fuzzy_sig, subset_dir, dup_dir, copies = store, sig_dir, None, None, 0
    if exact:
        groups = shard_groups(store, docs_per_group)
        parts = max(1, min_tasks, -(-n // RECORDS_PER_PARTITION))
        kmap, dup_dir = work / "keys", work / "dups"
        kmap.mkdir()
        dup_dir.mkdir()
        pmap(key_map, [KeyMapJob(str(store.folder), g, lo, hi, parts, str(kmap)) for g, (lo, hi) in enumerate(groups)])
        group_starts = tuple(int(store.starts[lo]) for lo, _ in groups)
        copies = sum(pmap(key_reduce, [KeyReduceJob(str(kmap), p, len(groups), group_starts, str(dup_dir))
                                       for p in range(parts)]))
        shutil.rmtree(kmap)
        if copies:  # fuzzy dedup of the survivors only; the copies are merged back by the components task
            subset_dir = work / "exact-survivors"
            subset_dir.mkdir()
            write_text_from(subset_dir, store.text_folder)
            pmap(write_subset_group, [SubsetJob(str(store.folder), g, lo, hi, str(dup_dir), str(subset_dir))
                                      for g, (lo, hi) in enumerate(groups)])
            fuzzy_store, fuzzy_sig = DocStore(subset_dir), Path(str(sig_dir) + "-exact")
    t_exact = round(time.perf_counter() - t0, 3)
    edges_work = work / "fuzzy"
    ranges, unsignatured, seconds = fuzzy_edges(fuzzy_store, fuzzy_sig, edges_work, shingle, lsh, chunk_size,
                                                max_docs, pmap, min_tasks, records_per_part, docs_per_range)
    t2 = time.perf_counter()
    job = ComponentsJob(str(edges_work / "edges"), ranges, len(fuzzy_store), lsh.threshold, str(fuzzy_sig), chunk_size,
                        max_docs, str(store.folder), str(subset_dir) if subset_dir else None,
                        str(dup_dir) if dup_dir else None, str(out))
    (counts,) = pmap(components_task, [job])
    if fuzzy_store is not store:
        fuzzy_store.close()
    shutil.rmtree(work)
    seconds["verify_cluster"] = round(seconds["verify_cluster"] + time.perf_counter() - t2, 3)
    log.info("dedup (sharded): %d documents, %d exact copies, %d candidate pairs, %d clusters", n, copies,
             counts["candidates"], counts["clusters"])
    return {**counts, "exact_copies": copies, "unsignatured": unsignatured, "seconds": {"exact": t_exact, **seconds}}
