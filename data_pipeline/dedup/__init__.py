"""Near-duplicate removal: shingle fingerprints → MinHash → LSH candidates → Jaccard → union-find.

One module per step: :mod:`~data_pipeline.dedup.hashing` (shingles, 64-bit fingerprints),
:mod:`~data_pipeline.dedup.minhash` (signatures, chunked on-disk cache), :mod:`~data_pipeline.dedup.lsh`
(bands, candidate pairs), :mod:`~data_pipeline.dedup.verify` (exact Jaccard, union-find clusters) and
:mod:`~data_pipeline.dedup.exact` (exact duplicates first). :func:`dedup_store` runs the fuzzy steps on a
document store in one driver process (the reference); :mod:`~data_pipeline.dedup.sharded` runs them as worker
tasks over files with the same result — :mod:`~data_pipeline.dedup.buckets` (band keys → bucket partitions →
candidate pairs), :mod:`~data_pipeline.dedup.edges` (verification per document range) and
:mod:`~data_pipeline.dedup.components` (connected components streamed from the edge files). The names below
are re-exported so ``from data_pipeline import dedup as dd`` keeps working.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_pipeline.dedup.hashing import (
    FINGERPRINT_VERSION,
    ShingleSpec,
    jaccard,
    shingle_fingerprints_batch,
    shingle_hashes,
    shingle_hashes_batch,
    shingle_set,
    shingle_sets_batch,
    units,
    word_unit_hashes,
    xxh64_short,
)
from data_pipeline.dedup.lsh import (
    LshSpec,
    band_pairs,
    bucket_pairs,
    candidate_probability,
    candidates_in_memory,
    lsh_params,
    make_lsh,
)
from data_pipeline.dedup.minhash import (
    ShingleCache,
    Signer,
    chunk_files,
    compute_signatures,
    remove_stale_tmp,
    sign_chunk,
)
from data_pipeline.dedup.verify import (
    DedupResult,
    UnionFind,
    cluster,
    duplicate_rows,
    jaccard_sorted,
    verify_and_cluster,
    verify_block,
    verify_pairs,
    visit_measured,
)
from data_pipeline.doc_store import DocStore


def dedup_store(store: DocStore, sig_dir: Path, shingle: ShingleSpec, lsh: LshSpec, chunk_size: int,
                workers: int, max_docs: int = 20000, progress: bool = True,
                candidates: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> DedupResult:
    """The single-driver reference of the fuzzy steps, used only by tests and benchmarks (the build's stage runs
    :func:`data_pipeline.dedup.sharded.dedup_stage_files`, whose result equals this one's): signatures +
    fingerprint sets (parallel chunks, cached in ``sig_dir``) → candidate pairs (:func:`band_pairs`, or
    ``candidates(sigs, active)``) → :func:`verify_and_cluster`. Times per phase in ``result.seconds``."""
    t0 = time.perf_counter()
    sigs, nsh = compute_signatures(store, sig_dir, lsh.num_perm, lsh.seed, shingle, chunk_size, workers, progress)
    active = nsh > 0
    t1 = time.perf_counter()
    pairs = (band_pairs(sigs, active, lsh.bands, lsh.rows) if candidates is None
             else np.asarray(candidates(sigs, active), dtype=np.int64).reshape(-1, 2))
    del sigs
    t2 = time.perf_counter()
    res = verify_and_cluster(ShingleCache(sig_dir, len(store), chunk_size), pairs, lsh.threshold, max_docs,
                             progress=progress)
    t3 = time.perf_counter()
    res.active = active
    res.seconds = {"minhash": round(t1 - t0, 3), "lsh": round(t2 - t1, 3), "verify_cluster": round(t3 - t2, 3)}
    return res


__all__ = ["FINGERPRINT_VERSION", "DedupResult", "LshSpec", "ShingleCache", "ShingleSpec", "Signer", "UnionFind",
           "band_pairs", "bucket_pairs", "candidate_probability", "candidates_in_memory", "chunk_files", "cluster",
           "compute_signatures", "dedup_store", "duplicate_rows", "jaccard", "jaccard_sorted", "lsh_params",
           "make_lsh", "remove_stale_tmp", "shingle_fingerprints_batch", "shingle_hashes", "shingle_hashes_batch",
           "shingle_set", "shingle_sets_batch", "sign_chunk", "units", "verify_and_cluster", "verify_block",
           "verify_pairs", "visit_measured", "word_unit_hashes", "xxh64_short"]
