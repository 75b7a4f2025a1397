"""Candidate pairs verified by workers, one document range at a time: the edge files.

:func:`verify_range` (one task per range of lower documents ``i``): the range's candidate pairs (from every
bucket partition, :mod:`data_pipeline.dedup.buckets`) made unique and sorted, then visited in that order
exactly as :func:`data_pipeline.dedup.verify.verify_and_cluster` visits them, with a union-find over the
range's own accepted edges: a pair that union-find already joins is not measured (Jaccard ``NaN``),
otherwise its fingerprint-set Jaccard is measured. Written: ``e-<range>.npy`` (int64 keys ``i * n + j``,
sorted) and ``j-<range>.npy`` (float64 Jaccard, ``NaN`` = not measured).

Why the global result can be rebuilt from these files (:mod:`data_pipeline.dedup.components`): a pair
skipped here was joined by earlier pairs of the same range with J >= threshold; those come earlier in the
global sorted order too, so the global visit also finds the pair joined and skips it. Every pair the global
visit measures therefore has its Jaccard in an edge file. Memory of a task: its range's pairs and at most
``max_docs`` fingerprint sets.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.dedup.minhash import ShingleCache
from data_pipeline.dedup.verify import UnionFind, jaccard_sorted, pair_blocks


def edge_files(edge_dir: Path, rng: int) -> tuple[Path, Path]:
    """(pair keys, Jaccard) of document range ``rng``."""
    return edge_dir / f"e-{rng:06d}.npy", edge_dir / f"j-{rng:06d}.npy"


@dataclass(frozen=True)
class RangeJob:
    """Verification task of document range ``rng``."""

    pair_dir: str
    rng: int
    sig_dir: str
    n: int
    chunk_size: int
    threshold: float
    max_docs: int
    edge_dir: str


def verify_range(job: RangeJob) -> int:
    """Verification task (module docstring); returns the number of candidate pairs of the range."""
    files = sorted(Path(job.pair_dir).glob(f"r{job.rng:06d}-p*.npy"))
    keys = np.unique(np.concatenate([np.load(f) for f in files])) if files else np.zeros(0, np.int64)
    jac = np.full(len(keys), np.nan)
    cache = ShingleCache(Path(job.sig_dir), job.n, job.chunk_size, lazy=True)
    uf = UnionFind()
    find = uf.find
    pos = 0
    pairs = list(zip((keys // job.n).tolist(), (keys % job.n).tolist()))
    for part in pair_blocks(pairs, job.max_docs):
        todo = [(i, j) for i, j in part if find(i) != find(j)]
        sets = cache.load(d for p in todo for d in p) if todo else {}
        for k, (i, j) in enumerate(part, start=pos):
            if find(i) == find(j):
                continue
            jac[k] = jaccard_sorted(sets[i], sets[j])
            if jac[k] >= job.threshold:
                uf.union(i, j)
        pos += len(part)
    out_e, out_j = edge_files(Path(job.edge_dir), job.rng)
    np.save(out_e, keys)
    np.save(out_j, jac)
    return int(len(keys))


@dataclass(frozen=True)
class MeasureJob:
    """Jaccard of given pairs (a block touching at most ``max_docs`` documents)."""

    sig_dir: str
    n: int
    chunk_size: int
    pairs: tuple[tuple[int, int], ...]


def measure_pairs(job: MeasureJob) -> list[float]:
    """The Jaccard of each pair of the job, in order."""
    sets = ShingleCache(Path(job.sig_dir), job.n, job.chunk_size, lazy=True).load(d for p in job.pairs for d in p)
    return [jaccard_sorted(sets[i], sets[j]) for i, j in job.pairs]
