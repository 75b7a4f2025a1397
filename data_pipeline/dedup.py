"""Near-duplicate removal: MinHash signatures → LSH candidates → exact Jaccard → union-find.

Shingles (``dedup.shingle_unit``/``shingle_size``):
  * ``word`` (default): the document is lower-cased and split into Unicode ``\\w+`` words; a shingle is
    a tuple of ``n`` consecutive words (a document with 1..n-1 words is one shingle; with no word at
    all it has no shingles, gets no signature, is never a duplicate and is counted as
    ``unsignatured``). Word 5-grams give far fewer false candidates than character 5-grams
    (dedup.md §7: unrelated books reach char-5 Jaccard 0.36, word-5 < 0.001).
  * ``char``: ``n`` consecutive characters of the cleaned text, no normalisation (Megatron's choice).

Signatures: datasketch's ``affine32`` MinHash scheme computed in batch with numpy. Each shingle is
hashed to 32 bits (units hashed with xxh64 — words — or taken as code points — chars — then combined
position-wise as ``sum_k u[i+k]·P_k mod 2^64`` and finished with the MurmurHash3 64-bit finaliser,
high 32 bits kept). The per-shingle hashes then go through exactly what ``MinHash.update_batch`` does
(``fmix32``, ``a·h+b mod 2^32`` with datasketch's own permutations for ``seed``, column minimum), so
a signature equals ``datasketch.MinHash(num_perm, seed).update_batch(...)`` fed the same 32-bit
hashes (tested), and is indexed as a ``LeanMinHash``.

LSH: ``datasketch.MinHashLSH`` with ``params=(bands, rows)``; by default the pair chosen by datasketch's
``_optimal_param(threshold, num_perm, 0.1, 0.9)`` — biased to recall: 20×6 at 0.7/128 finds a pair at
exactly J=0.7 with probability 0.92 and at 0.75 with 0.98 (equal weights give 14×9: 0.44).
Storage is the in-process dict or Redis (shared by several worker processes/machines).

Verification: the **exact** Jaccard of the shingle sets of every candidate pair (no sampling of one
"main" document per bucket); texts are re-read from the document store in blocks of at most
``verify_block_docs`` documents, so memory holds signatures, not texts. Union-find over pairs with
``J >= threshold``; the survivor of a cluster is its lowest input index; every other member is removed.
A member can be linked through a chain, so its Jaccard *to the survivor* (measured exactly, reported)
may be below the threshold while every merging edge is at or above it.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.lsh import _optimal_param

from .store import DocStore, atomic_save_npy

log = logging.getLogger(__name__)

_WORD = re.compile(r"\w+")
_MASK64 = (1 << 64) - 1
# odd multipliers, one per position in the n-gram (order matters: "a b" != "b a")
_POS_MULT = np.array([(0x9E3779B97F4A7C15 * (2 * k + 1) + 0x632BE59BD9B4E019 * k) & _MASK64 | 1
                      for k in range(64)], dtype=np.uint64)


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


# ---------------------------------------------------------------------------------------------- shingles
def units(text: str, spec: ShingleSpec) -> list[str] | str:
    return _WORD.findall(text.lower()) if spec.unit == "word" else text


def shingle_set(text: str, spec: ShingleSpec) -> set[Any]:
    """The exact shingle set (tuples of words, or substrings), used for verification."""
    u = units(text, spec)
    n = spec.n
    if len(u) == 0:
        return set()
    if len(u) < n:
        return {tuple(u) if spec.unit == "word" else u}
    if spec.unit == "word":
        return {tuple(u[i:i + n]) for i in range(len(u) - n + 1)}
    return {u[i:i + n] for i in range(len(u) - n + 1)}


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


_WORD_CACHE: dict[str, int] = {}
_WORD_CACHE_MAX = 500_000


def _word_hashes(words: list[str]) -> list[int]:
    """xxh64 of each word's UTF-8 bytes, memoised per process (word frequencies are Zipfian, so most
    lookups hit; the cache is cleared when it reaches ``_WORD_CACHE_MAX`` entries)."""
    cache = _WORD_CACHE
    try:
        return [cache[w] for w in words]
    except KeyError:
        if len(cache) > _WORD_CACHE_MAX:
            cache.clear()
        for w in set(words).difference(cache):
            cache[w] = xxhash.xxh64_intdigest(w.encode("utf-8"))
        return [cache[w] for w in words]


def shingle_hashes(text: str, spec: ShingleSpec) -> np.ndarray:
    """32-bit hash of every shingle (with repeats; MinHash is insensitive to them), uint32[k]."""
    u = units(text, spec)
    if len(u) == 0:
        return np.zeros(0, np.uint32)
    if spec.unit == "word":
        uh = np.array(_word_hashes(u), dtype=np.uint64)
    else:
        uh = np.frombuffer(u.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n = min(spec.n, len(uh))
    m = len(uh) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    for k in range(n):
        h += uh[k:k + m] * _POS_MULT[k]
    h += np.uint64(n)  # short documents (fewer than n units) hash differently from an n-gram
    return (_fmix64(h) >> np.uint64(32)).astype(np.uint32)


def shingle_hashes_batch(texts: list[str], spec: ShingleSpec) -> list[np.ndarray]:
    """:func:`shingle_hashes` of many documents, vectorised over their concatenation."""
    all_units = [units(t, spec) for t in texts]
    lens = np.array([len(u) for u in all_units], dtype=np.int64)
    if spec.unit == "word":
        flat: list[str] = [w for u in all_units for w in u]
        uh = np.array(_word_hashes(flat), dtype=np.uint64)
    else:
        joined = "".join(all_units)  # type: ignore[arg-type]
        uh = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n = spec.n
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    m = np.maximum(lens - n + 1, 0)  # shingles of the documents with >= n units
    starts = np.repeat(offs - np.concatenate([[0], np.cumsum(m)[:-1]]), m) + np.arange(int(m.sum()))
    h = np.full(len(starts), np.uint64(n), dtype=np.uint64)
    for k in range(n):
        h += uh[starts + k] * _POS_MULT[k]
    full = (_fmix64(h) >> np.uint64(32)).astype(np.uint32)
    out = np.split(full, np.cumsum(m)[:-1]) if len(texts) else []
    for d in np.flatnonzero((lens > 0) & (lens < n)).tolist():  # short documents: one shingle
        k = int(lens[d])
        hs = np.uint64(k) + (uh[offs[d]:offs[d] + k] * _POS_MULT[:k]).sum(dtype=np.uint64)
        out[d] = (_fmix64(np.array([hs], dtype=np.uint64)) >> np.uint64(32)).astype(np.uint32)
    return out


# -------------------------------------------------------------------------------------------- signatures
class Signer:
    """Batch MinHash (datasketch ``affine32`` scheme, datasketch's permutations for ``seed``)."""

    def __init__(self, num_perm: int, seed: int, spec: ShingleSpec):
        a, b = MinHash(num_perm=num_perm, seed=seed).permutations
        self.a = np.asarray(a, dtype=np.uint32)
        self.b = np.asarray(b, dtype=np.uint32)
        self.num_perm, self.seed, self.spec = num_perm, seed, spec

    def signature_of_hashes(self, hv: np.ndarray) -> np.ndarray:
        if len(hv) == 0:
            return np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        hv = np.unique(hv)  # fewer rows in the [k, num_perm] product
        out = np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        step = max(1, (1 << 16) // self.num_perm)  # bound the temporary to ~64k cells
        for s in range(0, len(hv), step):
            x = _fmix32(hv[s:s + step])[:, None]
            np.minimum(out, (x * self.a + self.b).min(axis=0), out=out)
        return out

    def sign(self, text: str) -> tuple[np.ndarray, int]:
        hv = shingle_hashes(text, self.spec)
        return self.signature_of_hashes(hv), len(hv)

    def sign_batch(self, texts: list[str], block_rows: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Signatures of many documents at once: the n-gram mixing, fmix and permutations run on the
        concatenated shingles of a group of documents (``block_rows`` shingles) and the per-document
        minimum is one ``np.minimum.reduceat`` — numpy's per-call overhead is paid per group, not per
        document. Equal to :meth:`sign` for every document (tested)."""
        sigs = np.full((len(texts), self.num_perm), 0xFFFFFFFF, dtype=np.uint32)
        nsh = np.zeros(len(texts), dtype=np.int64)
        group: list[np.ndarray] = []
        members: list[int] = []
        rows = 0

        def flush() -> None:
            nonlocal rows
            if not group:
                return
            hv = _fmix32(np.concatenate(group))[:, None]
            bounds = np.cumsum([0] + [len(g) for g in group[:-1]])
            phv = hv * self.a + self.b
            sigs[members] = np.minimum.reduceat(phv, bounds, axis=0)
            group.clear()
            members.clear()
            rows = 0

        for d, hv in enumerate(shingle_hashes_batch(texts, self.spec)):
            nsh[d] = len(hv)
            if len(hv) == 0:
                continue
            group.append(hv)
            members.append(d)
            rows += len(hv)
            if rows >= block_rows:
                flush()
        flush()
        return sigs, nsh

    def lean(self, sig: np.ndarray) -> LeanMinHash:
        return LeanMinHash(seed=self.seed, hashvalues=sig, scheme="affine32")


def sign_chunk(args: tuple[str, int, int, str, int, int, int, str]) -> tuple[int, int]:
    """Worker: signatures of store positions [start, stop) → ``sig-<start>.npy`` (uint32[n, num_perm])
    and ``nsh-<start>.npy`` (shingle counts; 0 = no signature). Returns (start, n)."""
    store_dir, start, stop, out_dir, num_perm, seed, n, unit = args
    signer = Signer(num_perm, seed, ShingleSpec(n, unit))
    store = DocStore(Path(store_dir))
    texts = [rec["text"] for rec in store.iter_range(start, stop)]
    sigs, nsh = signer.sign_batch(texts)
    atomic_save_npy(Path(out_dir) / f"nsh-{start:012d}.npy", nsh)
    atomic_save_npy(Path(out_dir) / f"sig-{start:012d}.npy", sigs)  # written last: completion marker
    return start, stop - start


def compute_signatures(store: DocStore, sig_dir: Path, num_perm: int, seed: int, spec: ShingleSpec,
                       chunk_size: int, workers: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All signatures of a store, computed in parallel chunks; finished chunks are reused (resume)."""
    from tqdm import tqdm

    sig_dir.mkdir(parents=True, exist_ok=True)
    n = len(store)
    starts = list(range(0, n, chunk_size))
    todo = [s for s in starts if not (sig_dir / f"sig-{s:012d}.npy").exists()]
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
        sigs[s:e] = np.load(sig_dir / f"sig-{s:012d}.npy")
        nsh[s:e] = np.load(sig_dir / f"nsh-{s:012d}.npy")
    return sigs, nsh


# ----------------------------------------------------------------------------------------- LSH candidates
def make_lsh(lsh: LshSpec, storage_config: dict[str, Any] | None = None) -> MinHashLSH:
    return MinHashLSH(threshold=lsh.threshold, num_perm=lsh.num_perm, params=(lsh.bands, lsh.rows),
                      storage_config=storage_config)


def bucket_pairs(index: MinHashLSH, bands: Iterable[int] | None = None) -> set[tuple[int, int]]:
    """Every pair (i, j), i < j, of keys that share a bucket in one of ``bands`` (all by default),
    read from the index's own storage (dict or Redis; Redis buckets fetched with pipelined ``getmany``)."""
    import pickle

    pairs: set[tuple[int, int]] = set()
    for b in range(index.b) if bands is None else bands:
        table = index.hashtables[b]
        keys = list(table.keys())
        groups = table.getmany(*keys) if hasattr(table, "getmany") and keys else [table.get(k) for k in keys]
        for members in groups:
            if len(members) < 2:
                continue
            ids = sorted(pickle.loads(m) if index.prepickle else m for m in set(members))
            pairs.update((ids[x], ids[y]) for x in range(len(ids)) for y in range(x + 1, len(ids)))
    return pairs


def candidates_in_memory(sigs: np.ndarray, active: np.ndarray, lsh: LshSpec, progress: bool = True
                         ) -> set[tuple[int, int]]:
    """Pairs (i, j), i < j, that share at least one LSH band: every signed document is inserted into
    a ``MinHashLSH`` (dict storage), then each band's buckets are enumerated — the same set that
    querying every document would return, without one query per document."""
    from tqdm import tqdm

    index = make_lsh(lsh)
    with index.insertion_session(buffer_size=50000) as session:
        for j in tqdm(np.flatnonzero(active).tolist(), desc="dedup: lsh", unit="doc", disable=not progress):
            session.insert(j, LeanMinHash(seed=lsh.seed, hashvalues=sigs[j], scheme="affine32"),
                           check_duplication=False)
    return bucket_pairs(index)


def redis_storage_config(host: str, port: int, db: int, basename: str) -> dict[str, Any]:
    return {"type": "redis", "basename": basename.encode(), "redis": {"host": host, "port": port, "db": db}}


def redis_clear(host: str, port: int, db: int, basename: str) -> int:
    """Delete every key of one shared index (a previous, possibly crashed, run)."""
    import redis

    r = redis.Redis(host=host, port=port, db=db)
    n = 0
    for k in r.scan_iter(match=basename + "*", count=1000):
        n += r.delete(k)
    return n


def redis_insert_worker(args: tuple[str, dict[str, Any], LshSpec, int, int]) -> int:
    """Worker ``rank`` of ``world``: insert its share (positions ≡ rank mod world, in chunks) of the
    signatures into the shared Redis index through datasketch's storage backend."""
    sig_file, storage, lsh, rank, world = args
    sigs = np.load(sig_file, mmap_mode="r")
    active = np.load(sig_file.replace("sigs.npy", "active.npy"))
    index = make_lsh(lsh, storage)
    n = 0
    with index.insertion_session(buffer_size=10000) as session:
        for j in np.flatnonzero(active).tolist():
            if j % world != rank:
                continue
            session.insert(j, LeanMinHash(seed=lsh.seed, hashvalues=np.array(sigs[j]), scheme="affine32"),
                           check_duplication=False)
            n += 1
    return n


def redis_query_worker(args: tuple[str, dict[str, Any], LshSpec, int, int]) -> list[tuple[int, int]]:
    """Worker ``rank`` of ``world``: after every worker has inserted, enumerate the buckets of bands
    ``rank, rank + world, ...`` of the shared index and return the pairs (i, j), i < j, found there."""
    sig_file, storage, lsh, rank, world = args
    index = make_lsh(lsh, storage)
    return sorted(bucket_pairs(index, range(rank, index.b, world)))


def candidates_redis(sig_file: Path, lsh: LshSpec, storage: dict[str, Any], workers: int
                     ) -> set[tuple[int, int]]:
    """Same candidate set as :func:`candidates_in_memory`, from ``workers`` processes sharing one
    Redis-backed index: all insert their share, then (after the barrier) each enumerates its bands."""
    jobs = [(str(sig_file), storage, lsh, r, workers) for r in range(workers)]
    with get_context("spawn").Pool(workers) as pool:
        inserted = sum(pool.map(redis_insert_worker, jobs))
        log.info("redis lsh: %d signatures inserted by %d workers", inserted, workers)
        pairs: set[tuple[int, int]] = set()
        for part in pool.map(redis_query_worker, jobs):
            pairs.update(part)
    return pairs


# ------------------------------------------------------------------------------------------ verification
def jaccard(a: set[Any], b: set[Any]) -> float:
    if not a and not b:
        return 0.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


def _blocks(pairs: list[tuple[int, int]], max_docs: int) -> Iterator[list[tuple[int, int]]]:
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


class ExactShingles:
    """Exact shingle sets as sorted arrays: units are numbered with a block-local vocabulary (exact,
    no hashing), a shingle is the row of ``n`` unit ids (short documents padded with -1), and the set is
    ``np.unique`` of the rows viewed as fixed-size byte strings. Same sets as :func:`shingle_set`."""

    def __init__(self, spec: ShingleSpec):
        self.spec = spec
        self.vocab: dict[str, int] = {}

    def rows(self, text: str) -> np.ndarray:
        """All shingles of a document (with repeats) as ``V{4n}`` byte strings of n int32 unit ids."""
        n = self.spec.n
        if self.spec.unit == "word":
            vocab = self.vocab
            u = units(text, self.spec)
            try:
                ids = np.array([vocab[w] for w in u], dtype=np.int32)
            except KeyError:
                for w in u:
                    if w not in vocab:
                        vocab[w] = len(vocab)
                ids = np.array([vocab[w] for w in u], dtype=np.int32)
        else:
            ids = np.frombuffer(text.encode("utf-32-le"), dtype=np.int32)
        if len(ids) == 0:
            return np.zeros(0, dtype=f"V{4 * n}")
        if len(ids) < n:
            ids = np.concatenate([ids, np.full(n - len(ids), -1, dtype=np.int32)])
        rows = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(ids, n))
        return rows.view(f"V{4 * n}").ravel()

    def __call__(self, text: str) -> np.ndarray:
        """The sorted set of a document's shingles."""
        return np.unique(self.rows(text))


def jaccard_sorted(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) == 0 and len(b) == 0:
        return 0.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def verify_block(args: tuple[str, list[tuple[int, int]], int, str]) -> list[tuple[int, int, float]]:
    """Worker: exact Jaccard of each pair of a block, texts read from the store by position.

    The block's distinct shingles (fixed-size rows of exact unit ids) are numbered once with
    ``np.unique(..., return_inverse=True)``; each document becomes a sorted array of int64 shingle
    numbers and a pair's intersection is ``np.intersect1d`` on those — exact, no hashing."""
    store_dir, block, n, unit = args
    exact = ExactShingles(ShingleSpec(n, unit))
    store = DocStore(Path(store_dir))
    try:
        docs = sorted({d for p in block for d in p})
        rows = [exact.rows(store.get(d)["text"]) for d in docs]
    finally:
        store.close()
    lens = [len(r) for r in rows]
    if sum(lens):
        _, inv = np.unique(np.concatenate(rows), return_inverse=True)
        parts = np.split(inv.astype(np.int64), np.cumsum(lens)[:-1])
    else:
        parts = [np.zeros(0, np.int64) for _ in docs]
    ids = {d: np.unique(p) for d, p in zip(docs, parts)}
    out = []
    for i, j in block:
        a, b = ids[i], ids[j]
        if len(a) == 0 and len(b) == 0:
            out.append((i, j, 0.0))
            continue
        inter = len(np.intersect1d(a, b, assume_unique=True))
        out.append((i, j, inter / (len(a) + len(b) - inter)))
    return out


def verify_pairs(store: DocStore, pairs: Iterable[tuple[int, int]], spec: ShingleSpec, max_docs: int,
                 workers: int, progress: bool = True, desc: str = "dedup: verify") -> list[tuple[int, int, float]]:
    from tqdm import tqdm

    pairs = sorted(pairs)
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
