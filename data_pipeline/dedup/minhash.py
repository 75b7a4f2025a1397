"""MinHash signatures of the shingle sets, computed in parallel chunks cached on disk with the sets themselves.

Signatures: datasketch's ``affine32`` MinHash computed in batch with numpy. The 32-bit element hash of a
shingle is the high half of its fingerprint; then exactly what ``MinHash.update_batch`` does
(``fmix32``, ``a·h+b mod 2^32`` with datasketch's own permutations for ``seed``, column minimum), so a
signature equals ``datasketch.MinHash(num_perm, seed).update_batch(...)`` fed the same 32-bit hashes
(tested). Chunks of ``chunk_size`` documents run in worker processes; each writes its signatures and its
fingerprint sets (``set-*.npy`` + ``seto-*.npy`` offsets) next to them, so verification re-reads the
sets from disk instead of re-tokenising texts: memory holds signatures (and 8 bytes of offsets per
document), not texts or shingles.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data_pipeline.dedup.hashing import ShingleSpec, fmix32, shingle_sets_batch
from data_pipeline.doc_store import DocStore
from data_pipeline.files import atomic_save_npy
from data_pipeline.store import scan_names
from data_pipeline.workers import worker_pool

if TYPE_CHECKING:
    from datasketch import LeanMinHash

log = logging.getLogger(__name__)


def affine32_permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b), uint32[num_perm] each: datasketch's ``affine32`` permutations ``h -> a·h + b mod 2^32`` (odd
    ``a``) for ``seed``, drawn as datasketch 2.x draws them (``numpy.random.RandomState(seed)``: the halves
    of ``a``, then ``b``). Drawn here because importing datasketch imports scipy (0.33 s in every build);
    ``tests/unit/test_data_dedup_fast.py`` checks them against ``datasketch.MinHash(...).permutations``."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


class Signer:
    """Batch MinHash (datasketch ``affine32`` scheme, datasketch's permutations for ``seed``)."""

    def __init__(self, num_perm: int, seed: int, spec: ShingleSpec) -> None:
        self.a, self.b = affine32_permutations(num_perm, seed)
        self.num_perm, self.seed, self.spec = num_perm, seed, spec

    def signature_of_hashes(self, hv: np.ndarray) -> np.ndarray:
        """Signature of one document from its 32-bit element hashes (repeats allowed)."""
        sigs = self.sign_sets((hv.astype(np.uint64) << np.uint64(32)), np.array([0, len(hv)], dtype=np.int64))
        return sigs[0]

    def sign_sets(self, values: np.ndarray, offsets: np.ndarray, block_rows: int = 8192) -> np.ndarray:
        """Signatures uint32[n, num_perm] of the documents whose fingerprints are
        ``values[offsets[d]:offsets[d+1]]`` (element hash = high 32 bits).

        Documents are processed in groups of about ``block_rows`` shingles: the permutations and the
        per-document minimum (one ``np.minimum.reduceat``) run on the group's concatenated shingles in
        one preallocated [num_perm, rows] buffer, so numpy's per-call overhead is paid per group, not
        per document. The layout matters: reducing along the contiguous axis is ~20x faster than
        reducing [rows, num_perm] along axis 0. A document without shingles keeps 0xFFFFFFFF (datasketch's
        empty MinHash)."""
        n = len(offsets) - 1
        sigs = np.full((n, self.num_perm), 0xFFFFFFFF, dtype=np.uint32)
        hv = fmix32((values >> np.uint64(32)).astype(np.uint32))
        counts = np.diff(offsets)
        docs = np.flatnonzero(counts > 0)
        if not len(docs):
            return sigs
        a, b = self.a[:, None], self.b[:, None]
        work = np.empty((self.num_perm, max(block_rows, int(counts.max()))), dtype=np.uint32)
        ends = np.cumsum(counts[docs])
        s = 0
        while s < len(docs):
            # docs[s:e]: about block_rows shingles (at least one document)
            e = max(s + 1, int(np.searchsorted(ends, (ends[s - 1] if s else 0) + block_rows, side="right")))
            base, stop = int(offsets[docs[s]]), int(offsets[docs[e - 1] + 1])
            phv = work[:, :stop - base]
            np.multiply(a, hv[None, base:stop], out=phv)
            np.add(phv, b, out=phv)
            sigs[docs[s:e]] = np.minimum.reduceat(phv, offsets[docs[s:e]] - base, axis=1).T
            s = e
        return sigs

    def sign(self, text: str) -> tuple[np.ndarray, int]:
        """(signature, number of distinct shingles) of one document."""
        sigs, nsh = self.sign_batch([text])
        return sigs[0], int(nsh[0])

    def sign_batch(self, texts: list[str], block_rows: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """(signatures uint32[n, num_perm], distinct shingles per document int64[n])."""
        values, offsets = shingle_sets_batch(texts, self.spec)
        return self.sign_sets(values, offsets, block_rows), np.diff(offsets)

    def lean(self, sig: np.ndarray) -> LeanMinHash:
        from datasketch import LeanMinHash

        return LeanMinHash(seed=self.seed, hashvalues=sig, scheme="affine32")


def chunk_files(out_dir: Path, start: int) -> dict[str, Path]:
    """The files of the signature chunk starting at document ``start``: fingerprint sets (``set``), their
    offsets (``seto``), shingles per document (``nsh``) and MinHash signatures (``sig``)."""
    return {k: out_dir / f"{k}-{start:012d}.npy" for k in ("set", "seto", "nsh", "sig")}


@dataclass(frozen=True)
class SignJob:
    """What one signature worker does: documents [start, stop) of the store in ``store_dir`` -> the chunk's
    files (:func:`chunk_files`) in ``out_dir``."""

    store_dir: str
    start: int
    stop: int
    out_dir: str
    num_perm: int
    seed: int
    shingle: ShingleSpec


def sign_chunk(job: SignJob) -> tuple[int, int]:
    """Worker: store positions [start, stop) → ``set-<start>.npy`` (sorted unique uint64 fingerprints of
    each document, concatenated), ``seto-<start>.npy`` (offsets, int64[n+1]), ``nsh-<start>.npy``
    (distinct shingles; 0 = no signature) and ``sig-<start>.npy`` (uint32[n, num_perm], written last:
    the chunk's completion marker). Returns (start, n)."""
    store_dir, start, stop, out_dir = job.store_dir, job.start, job.stop, job.out_dir
    signer = Signer(job.num_perm, job.seed, job.shingle)
    store = DocStore(Path(store_dir))
    texts = store.texts(start, stop)
    values, offsets = shingle_sets_batch(texts, signer.spec)
    sigs = signer.sign_sets(values, offsets)
    f = chunk_files(Path(out_dir), start)
    atomic_save_npy(f["set"], values)
    atomic_save_npy(f["seto"], offsets)
    atomic_save_npy(f["nsh"], np.diff(offsets))
    atomic_save_npy(f["sig"], sigs)
    return start, stop - start


def remove_stale_tmp(folder: Path, min_age_s: float = 600.0) -> int:
    """Delete ``*.tmp*`` files that a killed run left in ``folder`` (atomic writes in progress are
    younger than ``min_age_s``: another live worker sharing the folder keeps its own). Returns how many."""
    now, n = time.time(), 0
    for name in scan_names(folder, "*.tmp*"):
        f = folder / name
        try:
            if f.is_file() and now - f.stat().st_mtime > min_age_s:
                f.unlink()
                n += 1
        except OSError:
            pass
    if n:
        log.info("removed %d leftover temporary file(s) of an interrupted run from %s", n, folder)
    return n


def sign_jobs(store: DocStore, sig_dir: Path, num_perm: int, seed: int, spec: ShingleSpec,
              chunk_size: int) -> list[SignJob]:
    """The signature chunks of ``store`` not finished yet in ``sig_dir`` (which is created, and cleared of
    an interrupted run's temporary files)."""
    sig_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(sig_dir)
    n = len(store)
    return [SignJob(str(store.folder), s, min(n, s + chunk_size), str(sig_dir), num_perm, seed, spec)
            for s in range(0, n, chunk_size) if not chunk_files(sig_dir, s)["sig"].exists()]


def compute_signatures(store: DocStore, sig_dir: Path, num_perm: int, seed: int, spec: ShingleSpec,
                       chunk_size: int, workers: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All signatures of a store (and the fingerprint sets, on disk in ``sig_dir``), computed in
    parallel chunks; finished chunks are reused (resume). Returns (sigs uint32[n, num_perm], nsh)."""
    from tqdm import tqdm

    n = len(store)
    starts = list(range(0, n, chunk_size))
    jobs = sign_jobs(store, sig_dir, num_perm, seed, spec, chunk_size)
    if len(jobs) < len(starts):
        log.info("signatures: reusing %d finished chunk(s), computing %d", len(starts) - len(jobs), len(jobs))
    bar = tqdm(total=n, initial=n - sum(j.stop - j.start for j in jobs), desc="dedup: minhash", unit="doc",
               disable=not progress)
    if workers > 1 and len(jobs) > 1:
        with worker_pool(min(workers, len(jobs))) as pool:
            for _, k in pool.imap_unordered(sign_chunk, jobs):
                bar.update(k)
    else:
        for j in jobs:
            bar.update(sign_chunk(j)[1])
    bar.close()
    sigs = np.empty((n, num_perm), dtype=np.uint32)
    nsh = np.empty(n, dtype=np.int64)
    for s in starts:
        e = min(n, s + chunk_size)
        f = chunk_files(sig_dir, s)
        sigs[s:e] = np.load(f["sig"])
        nsh[s:e] = np.load(f["nsh"])
    return sigs, nsh


class ShingleCache:
    """Read side of the fingerprint sets written by :func:`sign_chunk`: holds the per-chunk offsets
    (8 bytes per document); values are memory-mapped per call and copied out, so nothing but the
    requested documents' sets stays in memory."""

    def __init__(self, sig_dir: Path, n: int, chunk_size: int, lazy: bool = False) -> None:
        """``lazy``: memory-map each chunk's offsets when a call needs them instead of holding every
        chunk's (8 bytes per document) — what the sharded verification workers use."""
        self.sig_dir, self.n, self.chunk_size, self.lazy = sig_dir, n, chunk_size, lazy
        self.starts = np.arange(0, n, chunk_size, dtype=np.int64)
        self.offsets = [] if lazy else [np.load(chunk_files(sig_dir, int(s))["seto"]) for s in self.starts]

    def load(self, docs: Iterable[int]) -> dict[int, np.ndarray]:
        """{document position: its sorted unique fingerprint array} for the given positions."""
        out: dict[int, np.ndarray] = {}
        docs = np.unique(np.fromiter(docs, dtype=np.int64))
        chunk = docs // self.chunk_size
        for c in np.unique(chunk).tolist():
            values = np.load(chunk_files(self.sig_dir, int(self.starts[c]))["set"], mmap_mode="r")
            off = (np.load(chunk_files(self.sig_dir, int(self.starts[c]))["seto"], mmap_mode="r") if self.lazy
                   else self.offsets[c])
            base = int(self.starts[c])
            for d in docs[chunk == c].tolist():
                out[d] = np.array(values[off[d - base]:off[d - base + 1]])
            del values
        return out
