"""Near-duplicate removal: shingle fingerprints → MinHash → LSH candidates → Jaccard → union-find.

Shingles (``dedup.shingle_unit``/``shingle_size``):
  * ``word`` (default): the document is lower-cased and split into Unicode ``\\w+`` words; a shingle is
    a tuple of ``n`` consecutive words (a document with 1..n-1 words is one shingle; with no word at
    all it has no shingles, gets no signature, is never a duplicate and is counted as
    ``unsignatured``). Word 5-grams give far fewer false candidates than character 5-grams
    (dedup.md §7: unrelated books reach char-5 Jaccard 0.36, word-5 < 0.001).
  * ``char``: ``n`` consecutive characters of the cleaned text, no normalisation (Megatron's choice).

Fingerprints (computed once per document, batched over a chunk of documents, no Python per word):
each unit gets a 64-bit hash — a word is ``xxh64`` of its UTF-8 bytes (computed by a vectorised numpy
xxh64 for words under 32 bytes, bit-identical to the ``xxhash`` library, tested; longer words call the
library), a character is ``fmix64(code point + 1)`` — and an n-gram is ``fmix64(n + Σ_k u[i+k]·P_k mod
2^64)`` with one odd multiplier ``P_k`` per position. ASCII documents are tokenised directly on their
bytes (``\\w`` = ``[0-9A-Za-z_]`` there, same as the Unicode regex); other documents go through the
``\\w+`` regex first. A document's shingle *set* is the sorted unique array of its uint64 fingerprints.

Signatures: datasketch's ``affine32`` MinHash computed in batch with numpy. The 32-bit element hash of a
shingle is the high half of its fingerprint; then exactly what ``MinHash.update_batch`` does
(``fmix32``, ``a·h+b mod 2^32`` with datasketch's own permutations for ``seed``, column minimum), so a
signature equals ``datasketch.MinHash(num_perm, seed).update_batch(...)`` fed the same 32-bit hashes
(tested). Chunks of ``chunk_size`` documents run in worker processes; each writes its signatures and its
fingerprint sets (``set-*.npy`` + ``seto-*.npy`` offsets) next to them, so verification re-reads the
sets from disk instead of re-tokenising texts: memory holds signatures (and 8 bytes of offsets per
document), not texts or shingles.

LSH: documents share a candidate bucket in band ``b`` iff their signatures are equal on rows
``[b·r, (b+1)·r)`` — datasketch ``MinHashLSH(params=(bands, rows))`` semantics. In memory this is one
sort per band of a 64-bit hash of the band (adjacent equal hashes are checked row by row, so a hash
collision can never add a pair; a collision makes that band fall back to an exact ``np.unique``); equal
to the buckets of datasketch's own in-memory ``MinHashLSH`` (tested).
Default bands×rows from datasketch's ``_optimal_param(threshold, num_perm, 0.1, 0.9)`` — biased to
recall: 20×6 at 0.7/128 finds a pair at exactly J=0.7 with probability 0.92 (equal weights: 14×9, 0.44).

Verification: the Jaccard of the fingerprint sets of every candidate pair whose two documents are not
already in one cluster (no sampling of one "main" document per bucket). Fingerprint Jaccard equals the
exact shingle Jaccard unless two distinct shingles of the pair share a 64-bit fingerprint: probability
≤ C(|A|+|B|, 2)/2^64 per pair (~1e-14 for two 300-word documents). Pairs are visited one by one in
sorted order; a pair is skipped only when union-find already joins its two documents (by edges verified
≥ threshold), which cannot change any cluster, nor the first merging edge of any member (that edge is
reported as ``linked_via``). So the clusters are exactly the connected components of the graph of
candidate pairs with ``J >= threshold``; the survivor of a cluster is its lowest input index; a
member linked through a chain can be below the threshold *to the survivor* (measured and reported),
every merging edge is at or above it. Skipping turns a bucket of k identical documents from k(k−1)/2
Jaccard measurements into k−1 (the k(k−1)/2 candidate pairs are still enumerated, as datasketch's
buckets would give them).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.lsh import _optimal_param

from data_pipeline.store import DocStore, atomic_save_npy

log = logging.getLogger(__name__)

#: bump when the fingerprint/signature definition changes: names the signature cache folder
FINGERPRINT_VERSION = 2

_WORD = re.compile(r"\w+")
_MASK64 = (1 << 64) - 1
_U64 = np.uint64
# odd multipliers, one per position in the n-gram (order matters: "a b" != "b a")
_POS_MULT = np.array([(0x9E3779B97F4A7C15 * (2 * k + 1) + 0x632BE59BD9B4E019 * k) & _MASK64 | 1
                      for k in range(64)], dtype=np.uint64)
# xxh64 primes
_P1, _P2, _P3, _P4, _P5 = (_U64(x) for x in (11400714785074694791, 14029467366897019727, 1609587929392839161,
                                              9650029242287828579, 2870177450012600261))
_M32 = _U64(0xFFFFFFFF)
# byte → 1 for bytes inside a word of the byte buffer: ASCII [0-9A-Za-z_], and every byte >= 0x80 (only
# the regex-tokenised non-ASCII documents contribute such bytes, and there every non-space is a word byte)
_WORD_BYTES = bytes(1 if (chr(c).isalnum() and c < 128) or c == 95 or c >= 128 else 0 for c in range(256))


@dataclass(frozen=True)
class ShingleSpec:
    n: int = 5
    unit: str = "word"


@dataclass(frozen=True)
class LshSpec:
    threshold: float
    num_perm: int
    bands: int
    rows: int
    seed: int


def lsh_params(threshold: float, num_perm: int, bands: int | None, rows: int | None,
               weights: Iterable[float] = (0.1, 0.9)) -> tuple[int, int]:
    """(bands, rows): the explicit pair, or datasketch's optimum for (false-positive, false-negative)
    weights. P(candidate | J=s) = 1 − (1 − s^rows)^bands."""
    if bands is not None and rows is not None:
        return bands, rows
    fp, fn = list(weights)
    return tuple(int(x) for x in _optimal_param(threshold, num_perm, fp, fn))  # type: ignore[return-value]


def candidate_probability(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s ** rows) ** bands


# ------------------------------------------------------------------------------- reference shingle sets
def units(text: str, spec: ShingleSpec) -> list[str] | str:
    return _WORD.findall(text.lower()) if spec.unit == "word" else text


def shingle_set(text: str, spec: ShingleSpec) -> set[Any]:
    """The exact shingle set (tuples of words, or substrings): the plain-Python reference."""
    u = units(text, spec)
    n = spec.n
    if len(u) == 0:
        return set()
    if len(u) < n:
        return {tuple(u) if spec.unit == "word" else u}
    if spec.unit == "word":
        return {tuple(u[i:i + n]) for i in range(len(u) - n + 1)}
    return {u[i:i + n] for i in range(len(u) - n + 1)}


def jaccard(a: set[Any], b: set[Any]) -> float:
    if not a and not b:
        return 0.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


# ------------------------------------------------------------------------------------ vectorised hashing
def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> _U64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U64(r)) | (x >> _U64(64 - r))


def xxh64_short(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``xxh64(buf[s:s+l], seed=0)`` for every (s, l) with ``l < 32``, vectorised: uint64[m].

    ``buf`` is a uint8 array with at least 8 readable bytes after every word. Words are grouped by
    length (a stable radix sort of the lengths), so each group runs xxh64's short-input path
    (8-byte lanes, one 4-byte lane, single bytes, avalanche) as a fixed sequence of whole-array
    operations; unaligned 8-byte loads come from a stride-1 uint64 view of the buffer."""
    u = np.ndarray(shape=(len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))
    order = np.argsort(lens.astype(np.uint8), kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(lens, minlength=32))])
    ss = starts[order]
    out = np.empty(len(starts), np.uint64)
    for length in range(32):
        a, b = int(bounds[length]), int(bounds[length + 1])
        if a == b:
            continue
        s = ss[a:b]
        h = np.full(b - a, _U64(length) + _P5, np.uint64)
        off = 0
        for _ in range(length >> 3):
            k = u[s + off]
            k *= _P2
            k = _rotl(k, 31)
            k *= _P1
            h ^= k
            h = _rotl(h, 27)
            h *= _P1
            h += _P4
            off += 8
        if length & 4:
            k = u[s + off] & _M32
            k *= _P1
            h ^= k
            h = _rotl(h, 23)
            h *= _P2
            h += _P3
            off += 4
        for _ in range(length & 3):
            k = buf[s + off].astype(np.uint64)
            k *= _P5
            h ^= k
            h = _rotl(h, 11)
            h *= _P1
            off += 1
        h ^= h >> _U64(33)
        h *= _P2
        h ^= h >> _U64(29)
        h *= _P3
        h ^= h >> _U64(32)
        out[a:b] = h
    res = np.empty_like(out)
    res[order] = out
    return res


def _word_unit_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(xxh64 of every ``\\w+`` word of the lower-cased documents, in order: uint64[W]; words per
    document: int64[len(texts)]). Equal to ``[xxh64(w.encode()) for w in re.findall(r"\\w+", t.lower())]``.

    All documents of the batch are joined (``\\n``-separated) into one byte buffer: ASCII documents as
    they are (``bytes.lower`` and a ``bytes.translate`` word-byte table do the regex's job), non-ASCII
    documents as their regex words joined by spaces. Word boundaries are the edges of the word-byte
    mask; words are hashed by :func:`xxh64_short`."""
    parts = [t.encode("ascii") if t.isascii() else " ".join(_WORD.findall(t.lower())).encode("utf-8")
             for t in texts]
    plen = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    raw = b"\n".join(parts).lower()
    total = len(raw)
    raw += b"\0" * (16 + (-(total + 16)) % 8)
    buf = np.frombuffer(raw, np.uint8)
    edge = np.diff(np.frombuffer(raw.translate(_WORD_BYTES), np.int8), prepend=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    lens = np.flatnonzero(edge == -1) - starts
    doc_start = np.concatenate([[0], np.cumsum(plen + 1)[:-1]]).astype(np.int64)
    nwords = np.diff(np.searchsorted(starts, np.append(doc_start, total + 1)))
    long_words = np.flatnonzero(lens >= 32)
    h = xxh64_short(buf, starts, np.where(lens >= 32, 0, lens) if len(long_words) else lens)
    for k in long_words.tolist():
        h[k] = xxhash.xxh64_intdigest(raw[starts[k]:starts[k] + lens[k]])
    return h, nwords.astype(np.int64)


def _char_unit_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(``fmix64(code point + 1)`` of every character, in order; characters per document)."""
    cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return _fmix64(cps + _U64(1)), np.array([len(t) for t in texts], dtype=np.int64)


def shingle_fingerprints_batch(texts: list[str], spec: ShingleSpec) -> tuple[np.ndarray, np.ndarray]:
    """64-bit fingerprint of every shingle of every document, with repeats, concatenated in document
    order: (uint64[S], shingles per document int64[len(texts)]).

    fingerprint = fmix64(n' + Σ_{k<n'} u[i+k]·P_k mod 2^64) with n' = n, or n' = the number of units
    for a document with 1..n-1 units (one shingle); no units → no shingle."""
    uh, lens = (_word_unit_hashes if spec.unit == "word" else _char_unit_hashes)(texts)
    n = spec.n
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    m = np.where(lens >= n, lens - n + 1, np.minimum(lens, 1))  # shingles per document
    short = (lens > 0) & (lens < n)
    first = np.repeat(offs - np.concatenate([[0], np.cumsum(m)[:-1]]), m) + np.arange(int(m.sum()))
    width = np.repeat(np.where(short, lens, n), m)  # units in each shingle
    h = width.astype(np.uint64)
    for k in range(n):
        if k == 0 or not short.any():
            h += uh[first + k] * _POS_MULT[k]
        else:  # short documents' single shingle stops at their last unit
            take = width > k
            h[take] += uh[first[take] + k] * _POS_MULT[k]
    return _fmix64(h), m.astype(np.int64)


def shingle_sets_batch(texts: list[str], spec: ShingleSpec) -> tuple[np.ndarray, np.ndarray]:
    """Each document's shingle set as a sorted unique uint64 array, concatenated: (values, offsets
    int64[len(texts)+1]); document d is ``values[offsets[d]:offsets[d+1]]``."""
    fp, m = shingle_fingerprints_batch(texts, spec)
    bounds = np.concatenate([[0], np.cumsum(m)]).astype(np.int64)
    for d in np.flatnonzero(m > 1).tolist():
        fp[bounds[d]:bounds[d + 1]].sort()
    keep = np.ones(len(fp), dtype=bool)
    if len(fp):
        keep[1:] = fp[1:] != fp[:-1]
        keep[bounds[:-1][m > 0]] = True  # a document's first value is always new
    kept_before = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
    return fp[keep], kept_before[bounds]


def shingle_hashes(text: str, spec: ShingleSpec) -> np.ndarray:
    """32-bit element hash (high half of the fingerprint) of every shingle, with repeats, uint32[k]."""
    fp, _ = shingle_fingerprints_batch([text], spec)
    return (fp >> _U64(32)).astype(np.uint32)


def shingle_hashes_batch(texts: list[str], spec: ShingleSpec) -> list[np.ndarray]:
    """:func:`shingle_hashes` of many documents, vectorised over their concatenation."""
    fp, m = shingle_fingerprints_batch(texts, spec)
    h = (fp >> _U64(32)).astype(np.uint32)
    return np.split(h, np.cumsum(m)[:-1]) if len(texts) else []


# -------------------------------------------------------------------------------------------- signatures
class Signer:
    """Batch MinHash (datasketch ``affine32`` scheme, datasketch's permutations for ``seed``)."""

    def __init__(self, num_perm: int, seed: int, spec: ShingleSpec):
        a, b = MinHash(num_perm=num_perm, seed=seed).permutations
        self.a = np.asarray(a, dtype=np.uint32)
        self.b = np.asarray(b, dtype=np.uint32)
        self.num_perm, self.seed, self.spec = num_perm, seed, spec

    def signature_of_hashes(self, hv: np.ndarray) -> np.ndarray:
        """Signature of one document from its 32-bit element hashes (repeats allowed)."""
        sigs = self.sign_sets((hv.astype(np.uint64) << _U64(32)), np.array([0, len(hv)], dtype=np.int64))
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
        hv = _fmix32((values >> _U64(32)).astype(np.uint32))
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
        return LeanMinHash(seed=self.seed, hashvalues=sig, scheme="affine32")


def _chunk_files(out_dir: Path, start: int) -> dict[str, Path]:
    return {k: out_dir / f"{k}-{start:012d}.npy" for k in ("set", "seto", "nsh", "sig")}


def sign_chunk(args: tuple[str, int, int, str, int, int, int, str]) -> tuple[int, int]:
    """Worker: store positions [start, stop) → ``set-<start>.npy`` (sorted unique uint64 fingerprints of
    each document, concatenated), ``seto-<start>.npy`` (offsets, int64[n+1]), ``nsh-<start>.npy``
    (distinct shingles; 0 = no signature) and ``sig-<start>.npy`` (uint32[n, num_perm], written last:
    the chunk's completion marker). Returns (start, n)."""
    store_dir, start, stop, out_dir, num_perm, seed, n, unit = args
    signer = Signer(num_perm, seed, ShingleSpec(n, unit))
    store = DocStore(Path(store_dir))
    texts = [rec["text"] for rec in store.iter_range(start, stop)]
    values, offsets = shingle_sets_batch(texts, signer.spec)
    sigs = signer.sign_sets(values, offsets)
    f = _chunk_files(Path(out_dir), start)
    atomic_save_npy(f["set"], values)
    atomic_save_npy(f["seto"], offsets)
    atomic_save_npy(f["nsh"], np.diff(offsets))
    atomic_save_npy(f["sig"], sigs)
    return start, stop - start


def remove_stale_tmp(folder: Path, min_age_s: float = 600.0) -> int:
    """Delete ``*.tmp*`` files that a killed run left in ``folder`` (atomic writes in progress are
    younger than ``min_age_s``: another live worker sharing the folder keeps its own). Returns how many."""
    now, n = time.time(), 0
    for f in folder.glob("*.tmp*"):
        try:
            if f.is_file() and now - f.stat().st_mtime > min_age_s:
                f.unlink()
                n += 1
        except OSError:
            pass
    if n:
        log.info("removed %d leftover temporary file(s) of an interrupted run from %s", n, folder)
    return n


def compute_signatures(store: DocStore, sig_dir: Path, num_perm: int, seed: int, spec: ShingleSpec,
                       chunk_size: int, workers: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All signatures of a store (and the fingerprint sets, on disk in ``sig_dir``), computed in
    parallel chunks; finished chunks are reused (resume). Returns (sigs uint32[n, num_perm], nsh)."""
    from tqdm import tqdm

    sig_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(sig_dir)
    n = len(store)
    starts = list(range(0, n, chunk_size))
    todo = [s for s in starts if not _chunk_files(sig_dir, s)["sig"].exists()]
    if len(todo) < len(starts):
        log.info("signatures: reusing %d finished chunk(s), computing %d", len(starts) - len(todo), len(todo))
    jobs = [(str(store.folder), s, min(n, s + chunk_size), str(sig_dir), num_perm, seed, spec.n, spec.unit)
            for s in todo]
    bar = tqdm(total=n, initial=n - sum(j[2] - j[1] for j in jobs), desc="dedup: minhash", unit="doc",
               disable=not progress)
    if workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(min(workers, len(jobs))) as pool:
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
        f = _chunk_files(sig_dir, s)
        sigs[s:e] = np.load(f["sig"])
        nsh[s:e] = np.load(f["nsh"])
    return sigs, nsh


class ShingleCache:
    """Read side of the fingerprint sets written by :func:`sign_chunk`: holds the per-chunk offsets
    (8 bytes per document); values are memory-mapped per call and copied out, so nothing but the
    requested documents' sets stays in memory."""

    def __init__(self, sig_dir: Path, n: int, chunk_size: int):
        self.sig_dir, self.n, self.chunk_size = sig_dir, n, chunk_size
        self.starts = np.arange(0, n, chunk_size, dtype=np.int64)
        self.offsets = [np.load(_chunk_files(sig_dir, int(s))["seto"]) for s in self.starts]

    def load(self, docs: Iterable[int]) -> dict[int, np.ndarray]:
        """{document position: its sorted unique fingerprint array} for the given positions."""
        out: dict[int, np.ndarray] = {}
        docs = np.unique(np.fromiter(docs, dtype=np.int64))
        chunk = docs // self.chunk_size
        for c in np.unique(chunk).tolist():
            values = np.load(_chunk_files(self.sig_dir, int(self.starts[c]))["set"], mmap_mode="r")
            off = self.offsets[c]
            base = int(self.starts[c])
            for d in docs[chunk == c].tolist():
                out[d] = np.array(values[off[d - base]:off[d - base + 1]])
            del values
        return out


# ----------------------------------------------------------------------------------------- LSH candidates
def _band_groups(band: np.ndarray) -> np.ndarray:
    """Group label (uint64) per row of ``band`` (uint32[m, r]): equal labels ⇔ equal rows. A 64-bit
    mix of the rows, unless two different rows collide, then the exact ``np.unique`` inverse."""
    h = np.zeros(len(band), dtype=np.uint64)
    for c in range(band.shape[1]):
        h = _fmix64((h + band[:, c].astype(np.uint64)) * _POS_MULT[c])
    order = np.argsort(h, kind="stable")
    hs = h[order]
    same = np.flatnonzero(hs[1:] == hs[:-1])
    if len(same) and not np.array_equal(band[order[same]], band[order[same + 1]]):
        _, inv = np.unique(band, axis=0, return_inverse=True)
        return inv.reshape(-1).astype(np.uint64)
    return h


def band_pairs(sigs: np.ndarray, active: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Every pair (i, j), i < j, of active documents whose signatures agree on all ``rows`` rows of
    at least one of ``bands`` bands, as a sorted int64[k, 2] array — the pairs that share a bucket of
    ``MinHashLSH(params=(bands, rows))``. Per band: one sort of the band labels; each run of r equal
    labels yields its r(r−1)/2 pairs (vectorised); pairs of all bands are merged with ``np.unique``."""
    idx = np.flatnonzero(active).astype(np.int64)
    n = int(len(active))
    keys: list[np.ndarray] = []
    for b in range(bands):
        lab = _band_groups(np.ascontiguousarray(sigs[idx, b * rows:(b + 1) * rows]))
        order = np.argsort(lab, kind="stable")
        ls = lab[order]
        new = np.ones(len(ls), dtype=bool)
        new[1:] = ls[1:] != ls[:-1]
        run_start = np.flatnonzero(new)
        run_len = np.diff(np.append(run_start, len(ls)))
        if not (run_len > 1).any():
            continue
        run_of = np.cumsum(new) - 1
        # position p pairs with every later position of its run
        partners = (run_start[run_of] + run_len[run_of]) - np.arange(len(ls)) - 1
        total = int(partners.sum())
        p = np.repeat(np.arange(len(ls)), partners)
        q = p + 1 + np.arange(total) - np.repeat(np.cumsum(partners) - partners, partners)
        i, j = idx[order[p]], idx[order[q]]
        keys.append(np.minimum(i, j) * n + np.maximum(i, j))
    if not keys:
        return np.zeros((0, 2), dtype=np.int64)
    k = np.unique(np.concatenate(keys))
    return np.stack([k // n, k % n], axis=1)


def candidates_in_memory(sigs: np.ndarray, active: np.ndarray, lsh: LshSpec, progress: bool = True
                         ) -> set[tuple[int, int]]:
    """:func:`band_pairs` as a set of (i, j) tuples."""
    return set(map(tuple, band_pairs(sigs, active, lsh.bands, lsh.rows).tolist()))  # type: ignore[arg-type]


def make_lsh(lsh: LshSpec) -> MinHashLSH:
    """datasketch's in-memory index with the same (bands, rows): the reference :func:`band_pairs` is tested against."""
    return MinHashLSH(threshold=lsh.threshold, num_perm=lsh.num_perm, params=(lsh.bands, lsh.rows))


def bucket_pairs(index: MinHashLSH, bands: Iterable[int] | None = None) -> set[tuple[int, int]]:
    """Every pair (i, j), i < j, of keys that share a bucket in one of ``bands`` (all by default),
    read from the index's own in-memory storage."""
    pairs: set[tuple[int, int]] = set()
    for b in range(index.b) if bands is None else bands:
        table = index.hashtables[b]
        for members in (table.get(k) for k in list(table.keys())):
            if len(members) < 2:
                continue
            ids = sorted(int(m) for m in set(members))
            pairs.update((ids[x], ids[y]) for x in range(len(ids)) for y in range(x + 1, len(ids)))
    return pairs


# ------------------------------------------------------------------------------------------ verification
def jaccard_sorted(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two sorted arrays of distinct values: |a∩b| by binary search of the smaller in the
    larger, then |a∩b| / (|a| + |b| − |a∩b|); 0 for two empty sets."""
    if len(a) > len(b):
        a, b = b, a
    if len(a) == 0:
        return 0.0
    k = np.searchsorted(b, a)
    np.minimum(k, len(b) - 1, out=k)
    inter = int(np.count_nonzero(b[k] == a))
    return inter / (len(a) + len(b) - inter)


def _blocks(pairs: list[tuple[int, int]], max_docs: int) -> Iterator[list[tuple[int, int]]]:
    """Consecutive runs of ``pairs`` that touch at most ``max_docs`` distinct documents each."""
    block: list[tuple[int, int]] = []
    docs: set[int] = set()
    for p in pairs:
        new = {p[0], p[1]} - docs
        if block and len(docs) + len(new) > max_docs:
            yield block
            block, docs = [], set()
            new = {p[0], p[1]}
        block.append(p)
        docs |= new
    if block:
        yield block


def verify_block(args: tuple[str, list[tuple[int, int]], int, str]) -> list[tuple[int, int, float]]:
    """Worker: Jaccard of each pair of a block, fingerprint sets computed from the texts read from the
    store by position (the path used without a fingerprint cache)."""
    store_dir, block, n, unit = args
    store = DocStore(Path(store_dir))
    try:
        docs = sorted({d for p in block for d in p})
        texts = [store.get(d)["text"] for d in docs]
    finally:
        store.close()
    values, offsets = shingle_sets_batch(texts, ShingleSpec(n, unit))
    sets = {d: values[offsets[k]:offsets[k + 1]] for k, d in enumerate(docs)}
    return [(i, j, jaccard_sorted(sets[i], sets[j])) for i, j in block]


def verify_pairs(store: DocStore, pairs: Iterable[tuple[int, int]], spec: ShingleSpec, max_docs: int,
                 workers: int, progress: bool = True, desc: str = "dedup: verify") -> list[tuple[int, int, float]]:
    """Jaccard of **every** given pair (sorted), texts re-read from the store in blocks of at most
    ``max_docs`` documents. The stage itself uses :func:`verify_and_cluster` (cached fingerprints,
    union-find skipping); this is the exhaustive form, kept for checks and callers without a cache."""
    from tqdm import tqdm

    pairs = sorted((int(i), int(j)) for i, j in pairs)
    blocks = list(_blocks(pairs, max_docs))
    # parallel only when it pays: split blocks re-read their documents, pool start-up costs ~0.1 s
    if len(pairs) < 50_000:
        workers = 1
    if workers > 1 and len(blocks) < 4 * workers and pairs:
        per = max(1, -(-len(pairs) // (4 * workers)))
        blocks = [b[s:s + per] for b in blocks for s in range(0, len(b), per)]
    jobs = [(str(store.folder), b, spec.n, spec.unit) for b in blocks]
    out: list[tuple[int, int, float]] = []
    bar = tqdm(total=len(pairs), desc=desc, unit="pair", disable=not progress)
    if workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(min(workers, len(jobs))) as pool:
            for res in pool.imap(verify_block, jobs):
                out.extend(res)
                bar.update(len(res))
    else:
        for j in jobs:
            res = verify_block(j)
            out.extend(res)
            bar.update(len(res))
    bar.close()
    return out


# ------------------------------------------------------------------------------------------- clustering
class UnionFind:
    """Union-find whose root is always the smallest member (so the survivor is the lowest index)."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        root = self.parent.setdefault(x, x)
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.parent[hi] = lo

    def clusters(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for x in sorted(self.parent):
            out.setdefault(self.find(x), []).append(x)
        return {r: m for r, m in out.items() if len(m) > 1}


def cluster(verified: Iterable[tuple[int, int, float]], threshold: float
            ) -> tuple[dict[int, list[int]], dict[int, tuple[int, float]]]:
    """Clusters {survivor: sorted members} over edges with J >= threshold, and for each removed member
    the first edge (in sorted order) that touches it: {member: (other end, J)}."""
    uf = UnionFind()
    link: dict[int, tuple[int, float]] = {}
    for i, j, jac in sorted(verified):
        if jac >= threshold:
            uf.union(i, j)
            link.setdefault(j, (i, jac))
            link.setdefault(i, (j, jac))
    return uf.clusters(), link


def duplicate_rows(store: DocStore, clusters: dict[int, list[int]], link: dict[int, tuple[int, float]],
                   to_survivor: Callable[[int, int], float]) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of ``work/dedup/duplicates.jsonl`` and the removed store positions, clusters in survivor order.

    One row per cluster: ``{"kept": source id, "kept_i": input index, "removed": [{"id", "i", "jaccard"
    (to the survivor, 6 decimals), "linked_via" (input index of the other end of the first merging edge
    touching it), "link_jaccard"}, ...]}`` (members in store order). ``to_survivor(root, member)`` gives
    the Jaccard of a removed member to its survivor.
    """
    rows: list[dict[str, Any]] = []
    removed: list[int] = []
    for root, ms in sorted(clusters.items()):
        rem = []
        for m in ms[1:]:
            via, via_j = link[m]
            rem.append({"id": store.get(m)["src"], "i": int(store.input_index[m]),
                        "jaccard": round(to_survivor(root, m), 6),
                        "linked_via": int(store.input_index[via]), "link_jaccard": round(via_j, 6)})
            removed.append(m)
        rows.append({"kept": store.get(root)["src"], "kept_i": int(store.input_index[root]), "removed": rem})
    return rows, removed


@dataclass
class DedupResult:
    """Outcome of :func:`verify_and_cluster` / :func:`dedup_store`."""

    clusters: dict[int, list[int]]  # survivor → sorted members (survivor first)
    link: dict[int, tuple[int, float]]  # member → (other end, J) of the first merging edge touching it
    to_survivor: dict[int, float]  # removed member → Jaccard to its cluster's survivor
    candidates: int = 0
    verified: int = 0  # candidate pairs measured
    accepted: int = 0  # measured with J >= threshold (merging edges)
    rejected: int = 0  # measured with J < threshold
    skipped: int = 0  # not measured: both ends already in one cluster
    active: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    seconds: dict[str, float] = field(default_factory=dict)


def _jaccards(sets: dict[int, np.ndarray], pairs: list[tuple[int, int]]) -> list[float]:
    return [jaccard_sorted(sets[i], sets[j]) for i, j in pairs]


def verify_and_cluster(cache: ShingleCache, pairs: np.ndarray, threshold: float, max_docs: int = 20000,
                       progress: bool = True) -> DedupResult:
    """Clusters of the candidate graph restricted to edges with J >= ``threshold``.

    ``pairs`` (int64[k, 2], i < j) are visited one by one in sorted order: a pair whose two documents
    union-find already joins is skipped; otherwise it is measured and unioned when J >= threshold.
    Fingerprint sets are read from ``cache`` for runs of pairs touching at most ``max_docs`` documents
    (the documents of pairs not yet joined when the run starts), so memory is bounded by ``max_docs``
    sets and the result does not depend on it. Equal to ``cluster(verify_pairs(all pairs))`` — clusters
    and links (tested) — because a skipped pair joins nothing new and is never the first merging edge of
    either end.
    Then the Jaccard of every removed member to its survivor is measured (or reused)."""
    from tqdm import tqdm

    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
    uf = UnionFind()
    link: dict[int, tuple[int, float]] = {}
    accepted: dict[tuple[int, int], float] = {}
    res = DedupResult({}, link, {}, candidates=len(pairs))
    bar = tqdm(total=len(pairs), desc="dedup: verify", unit="pair", disable=not progress)
    find = uf.find
    for part in _blocks(list(map(tuple, pairs.tolist())), max_docs):  # type: ignore[arg-type]
        todo = [(i, j) for i, j in part if find(i) != find(j)]
        sets = cache.load(d for p in todo for d in p) if todo else {}
        for i, j in todo:
            if find(i) == find(j):  # joined by an earlier pair of this part
                continue
            jac = jaccard_sorted(sets[i], sets[j])
            res.verified += 1
            if jac >= threshold:
                uf.union(i, j)
                link.setdefault(j, (i, jac))
                link.setdefault(i, (j, jac))
                accepted[(i, j)] = jac
                res.accepted += 1
            else:
                res.rejected += 1
        bar.update(len(part))
    bar.close()
    res.skipped = len(pairs) - res.verified
    res.clusters = uf.clusters()
    need = [(root, m) for root, ms in res.clusters.items() for m in ms[1:]]
    for root, m in need:
        if (root, m) in accepted:
            res.to_survivor[m] = accepted[(root, m)]
    for part in _blocks([p for p in need if p[1] not in res.to_survivor], max_docs):
        sets = cache.load(d for p in part for d in p)
        for (_, m), jac in zip(part, _jaccards(sets, part)):
            res.to_survivor[m] = jac
    return res


def dedup_store(store: DocStore, sig_dir: Path, shingle: ShingleSpec, lsh: LshSpec, chunk_size: int,
                workers: int, max_docs: int = 20000, progress: bool = True,
                candidates: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> DedupResult:
    """The whole stage on a document store: signatures + fingerprint sets (parallel chunks, cached in
    ``sig_dir``) → candidate pairs (:func:`band_pairs`, or ``candidates(sigs, active)``) →
    :func:`verify_and_cluster`. Times per phase in ``result.seconds``."""
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
