"""Near-duplicate removal whose driver holds no signature, bucket or candidate list: every step a worker task.

1. signatures: :func:`~data_pipeline.dedup.minhash.sign_chunk` per chunk (as before; nothing loaded back);
2. buckets: :func:`~data_pipeline.dedup.buckets.bucket_chunk` per chunk (band keys → partition files), then
   :func:`~data_pipeline.dedup.buckets.reduce_partition` per partition (buckets → candidate pairs, split by
   the range of their lower document);
3. verification: :func:`~data_pipeline.dedup.edges.verify_range` per document range (Jaccard of the pairs
   not already joined within the range → edge files);
4. components: :func:`~data_pipeline.dedup.components.replay_edges` streams the edge files in range order
   on the driver (memory: one range's edges + the clustered documents), then the Jaccard of each removed
   member to its survivor is measured by :func:`~data_pipeline.dedup.edges.measure_pairs` tasks (or reused
   from an accepted edge).

The result (clusters, links, Jaccards to survivors, candidate / measured / accepted / rejected / skipped
counts) equals :func:`data_pipeline.dedup.dedup_store`'s, for any number of partitions and ranges (tested).
``pmap(fn, jobs)`` runs the tasks and returns their results in job order: :func:`local_pmap` (worker
processes) or ``ray_executor.ray_pmap`` (Ray tasks). Intermediate files live in ``work`` and are removed
as soon as the next step has read them; they are written without ``fsync`` (a plain ``np.save``): ``work`` is
emptied at the start of every run, so an interrupted run's files are never read (the signature chunks, which
are reused on resume, are still written atomically).
"""
from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from data_pipeline.dedup.buckets import BucketJob, ReduceJob, bucket_chunk, reduce_partition
from data_pipeline.dedup.components import replay_edges
from data_pipeline.dedup.edges import MeasureJob, RangeJob, measure_pairs, verify_range
from data_pipeline.dedup.hashing import ShingleSpec
from data_pipeline.dedup.lsh import LshSpec
from data_pipeline.dedup.minhash import sign_chunk, sign_jobs
from data_pipeline.dedup.verify import DedupResult, pair_blocks
from data_pipeline.store import DocStore

log = logging.getLogger(__name__)

PMap = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
#: bucket records per partition (32 bytes each at 6 rows): bounds a reduce task's memory
RECORDS_PER_PARTITION = 1_000_000
#: documents per verification range (by the lower document of a pair): bounds a verification task
DOCS_PER_RANGE = 100_000


def local_pmap(workers: int) -> PMap:
    """``pmap`` over ``workers`` forked processes (in this process when 1, or for a single job)."""
    def pmap(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
        jobs = list(jobs)
        if workers > 1 and len(jobs) > 1:
            with get_context("fork").Pool(min(workers, len(jobs))) as pool:
                return list(pool.imap(fn, jobs))
        return [fn(j) for j in jobs]
    return pmap


def layout(n: int, bands: int, min_tasks: int, records_per_part: int = RECORDS_PER_PARTITION,
           docs_per_range: int = DOCS_PER_RANGE) -> tuple[int, int, int]:
    """(partitions, ranges, documents per range): enough tasks for ``min_tasks`` workers, and more as the
    corpus grows so each task's share stays bounded."""
    parts = max(1, min_tasks, -(-n * bands // records_per_part))
    ranges = max(1, min_tasks, -(-n // docs_per_range))
    range_docs = max(1, -(-n // ranges))
    return parts, -(-n // range_docs) if n else 1, range_docs


def dedup_sharded(store: DocStore, sig_dir: Path, work: Path, shingle: ShingleSpec, lsh: LshSpec, chunk_size: int,
                  max_docs: int, pmap: PMap, min_tasks: int = 1, records_per_part: int = RECORDS_PER_PARTITION,
                  docs_per_range: int = DOCS_PER_RANGE) -> DedupResult:
    """The whole fuzzy stage as worker tasks (module docstring); ``work`` is emptied and removed."""
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
    res, accepted = replay_edges(edges, ranges, n, lsh.threshold)
    shutil.rmtree(work)
    need = [(root, m) for root, ms in res.clusters.items() for m in ms[1:]]
    for root, m in need:
        if (root, m) in accepted:
            res.to_survivor[m] = accepted[(root, m)]
    del accepted
    blocks = [tuple(b) for b in pair_blocks([p for p in need if p[1] not in res.to_survivor], max_docs)]
    for block, jacs in zip(blocks, pmap(measure_pairs, [MeasureJob(str(sig_dir), n, chunk_size, b) for b in blocks])):
        for (_, m), jac in zip(block, jacs):
            res.to_survivor[m] = jac
    t3 = time.perf_counter()
    res.unsignatured = unsignatured
    res.seconds = {"minhash": round(t1 - t0, 3), "lsh": round(t2 - t1, 3), "verify_cluster": round(t3 - t2, 3)}
    log.info("dedup (sharded): %d documents, %d partitions, %d ranges, %d candidate pairs, %d clusters",
             n, parts, ranges, res.candidates, len(res.clusters))
    return res
