"""LSH buckets built by workers: band keys shuffled to bucket partitions on disk, candidate pairs per partition.

Map (:func:`bucket_chunk`, one task per signature chunk): every active document of the chunk gets one
record per band, ``uint32[doc, band, r_0 .. r_{rows-1}]`` (its band's rows of the signature), routed to
one of ``parts`` partitions by a 64-bit hash of (band, rows) (:func:`key_hash`) — so all documents of one
LSH bucket land in one partition — and written as one file per chunk, ``bk-<start>.npy``, sorted by
partition, with the partition offsets in ``bko-<start>.npy`` (datatrove writes bucket files per band; NeMo
Curator shuffles buckets by band: the same shape, on files).

Reduce (:func:`reduce_partition`, one task per partition): the partition's slices of every chunk file are
sorted by the hash of (band, rows); each run of equal (band, rows) — a bucket — yields all its pairs
(i < j). Equality is checked on the rows themselves (an exact ``lexsort`` if two different keys share a
hash), so the union over partitions is exactly :func:`data_pipeline.dedup.lsh.band_pairs` (tested). The
pairs are written split by the *range* of their lower document (``i // range_docs``),
``pairs/r<range>-p<part>.npy`` (int64 keys ``i * n + j``), for the per-range verification of
:mod:`data_pipeline.dedup.edges`. Memory of a task: one chunk's signatures (map), one partition's records
and pairs (reduce).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.dedup.hashing import POS_MULT, fmix64
from data_pipeline.dedup.minhash import chunk_files


def key_hash(key: np.ndarray) -> np.ndarray:
    """uint64 mix of the columns of ``key`` (uint32[m, k]) per row: routes a bucket to its partition and groups
    records in the reducer (equal rows ⇒ equal hash; equality itself is always checked on the rows)."""
    h = np.zeros(len(key), dtype=np.uint64)
    for c in range(key.shape[1]):
        h = fmix64((h + key[:, c].astype(np.uint64)) * POS_MULT[c])
    return h


def equal_key_pairs(key: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) with i < j for every two records with equal rows of ``key`` (int[m, k]); ``docs``: int64[m].
    Records are sorted by :func:`key_hash`; runs of equal hashes are the groups unless two different rows
    share a hash (checked on the rows), then by an exact ``lexsort`` of the rows."""
    if len(key) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    h = key_hash(key)
    order = np.argsort(h)
    hs = h[order]
    new = np.ones(len(hs), dtype=bool)
    new[1:] = hs[1:] != hs[:-1]
    same = np.flatnonzero(~new[1:])
    if len(same) and not np.array_equal(key[order[same]], key[order[same + 1]]):  # a hash collision
        order = np.lexsort(tuple(key[:, c] for c in range(key.shape[1] - 1, -1, -1)))
        ks = key[order]
        new[1:] = (ks[1:] != ks[:-1]).any(axis=1)
    ds = docs[order]
    start = np.flatnonzero(new)
    length = np.diff(np.append(start, len(ds)))
    run_of = np.cumsum(new) - 1
    partners = start[run_of] + length[run_of] - np.arange(len(ds)) - 1  # later members of the same run
    total = int(partners.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    p = np.repeat(np.arange(len(ds)), partners)
    q = p + 1 + np.arange(total) - np.repeat(np.cumsum(partners) - partners, partners)
    i, j = ds[p], ds[q]
    return np.minimum(i, j), np.maximum(i, j)


def bucket_files(bucket_dir: Path, start: int) -> tuple[Path, Path]:
    """(records, partition offsets) of the signature chunk starting at ``start``."""
    return bucket_dir / f"bk-{start:012d}.npy", bucket_dir / f"bko-{start:012d}.npy"


@dataclass(frozen=True)
class BucketJob:
    """Map task: signature chunk ``start`` of ``sig_dir`` → its bucket file in ``bucket_dir``."""

    sig_dir: str
    start: int
    bands: int
    rows: int
    parts: int
    bucket_dir: str


def bucket_chunk(job: BucketJob) -> int:
    """Map task (module docstring); returns the chunk's documents without a signature (``nsh == 0``)."""
    f = chunk_files(Path(job.sig_dir), job.start)
    sigs, nsh = np.load(f["sig"]), np.load(f["nsh"])
    docs = np.flatnonzero(nsh > 0)
    m, width = len(docs) * job.bands, job.bands * job.rows
    rec = np.empty((len(docs), job.bands, 2 + job.rows), np.uint32)  # per (document, band): doc, band, rows
    rec[:, :, 0] = (docs + job.start).astype(np.uint32)[:, None]
    rec[:, :, 1] = np.arange(job.bands, dtype=np.uint32)[None, :]
    rec[:, :, 2:] = sigs[docs, :width].reshape(len(docs), job.bands, job.rows)
    rec = rec.reshape(m, 2 + job.rows)
    d = (key_hash(rec[:, 1:]) % np.uint64(job.parts)).astype(np.int64)
    order = np.argsort(d, kind="stable")
    out, off = bucket_files(Path(job.bucket_dir), job.start)
    np.save(out, rec[order])
    np.save(off, np.concatenate([[0], np.cumsum(np.bincount(d, minlength=job.parts))]).astype(np.int64))
    return int(len(nsh) - len(docs))


@dataclass(frozen=True)
class ReduceJob:
    """Reduce task: partition ``part`` of every chunk's bucket file → pair files per document range."""

    bucket_dir: str
    part: int
    chunk_starts: tuple[int, ...]
    n: int
    range_docs: int
    pair_dir: str


def pair_file(pair_dir: Path, rng: int, part: int) -> Path:
    return pair_dir / f"r{rng:06d}-p{part:06d}.npy"


def reduce_partition(job: ReduceJob) -> int:
    """Reduce task (module docstring); returns the number of distinct pairs it found."""
    pieces = []
    for s in job.chunk_starts:
        rec_f, off_f = bucket_files(Path(job.bucket_dir), s)
        off = np.load(off_f)
        pieces.append(np.array(np.load(rec_f, mmap_mode="r")[off[job.part]:off[job.part + 1]]))
    recs = np.concatenate(pieces) if pieces else np.zeros((0, 2), np.uint32)
    del pieces
    i, j = equal_key_pairs(recs[:, 1:], recs[:, 0].astype(np.int64))  # key (band, rows...), document
    del recs
    keys = np.unique(i * job.n + j)
    del i, j
    rng = keys // job.n // job.range_docs
    bounds = np.searchsorted(rng, np.arange(int(rng[-1]) + 2)) if len(keys) else np.zeros(1, np.int64)
    for r in range(len(bounds) - 1):
        if bounds[r + 1] > bounds[r]:
            np.save(pair_file(Path(job.pair_dir), r, job.part), keys[bounds[r]:bounds[r + 1]])
    return int(len(keys))
