"""Exact Jaccard verification of candidate pairs and union-find clustering (connected components).

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

import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.dedup.hashing import ShingleSpec, shingle_sets_batch
from data_pipeline.dedup.minhash import ShingleCache
from data_pipeline.doc_store import DocStore
from data_pipeline.workers import worker_pool


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


def pair_blocks(pairs: list[tuple[int, int]], max_docs: int) -> Iterator[list[tuple[int, int]]]:
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
        texts = [store.text(d) for d in docs]
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
    blocks = list(pair_blocks(pairs, max_docs))
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
        with worker_pool(min(workers, len(jobs))) as pool:
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
        """The root of ``x``; a document never unioned is its own root and is not stored, so the
        structure holds only documents joined to another (memory grows with the clustered documents)."""
        parent = self.parent
        root = x
        while (up := parent.get(root, root)) != root:
            root = up
        while x != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.parent.setdefault(lo, lo)
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
                   to_survivor: Callable[[int, int], float]) -> tuple[Iterator[dict[str, Any]], list[int]]:
    """The rows of ``work/dedup/duplicates.jsonl`` and the removed store positions, clusters in survivor order.

    One row per cluster: ``{"kept": source id, "kept_i": input index, "removed": [{"id", "i", "jaccard"
    (to the survivor, 6 decimals), "linked_via" (input index of the other end of the first merging edge
    touching it), "link_jaccard"}, ...]}`` (members in store order). ``to_survivor(root, member)`` gives
    the Jaccard of a removed member to its survivor.

    The rows are made one at a time as they are consumed (``write_jsonl_atomic`` takes the iterator), from
    each member's source id and input index, read here in store order (a few shard indexes open at a time;
    the store is not read again, so it may be closed before the rows are): no dictionary per member or per
    row is held, which was most of the components task's memory at 10^7 documents.
    """
    roots = sorted(clusters)
    sizes = [len(clusters[r]) for r in roots]
    flat = np.fromiter(itertools.chain.from_iterable(clusters[r] for r in roots), dtype=np.int64, count=sum(sizes))
    members = np.unique(flat)  # store order
    src: list[str] = []
    inputs = array("q")
    for p in members.tolist():
        m = store.meta(p)
        src.append(m["src"])
        inputs.append(m["i"])
    at = np.searchsorted(members, flat)  # row of each member (in cluster order) in src / inputs
    removed = [m for r in roots for m in clusters[r][1:]]
    vias = np.fromiter((link[m][0] for m in removed), dtype=np.int64, count=len(removed))
    via_at = np.searchsorted(members, vias)
    if len(vias) and not np.array_equal(members[np.minimum(via_at, len(members) - 1)], vias):
        raise ValueError("a removed document's link is not a member of any cluster")

    def rows() -> Iterator[dict[str, Any]]:
        pos = r_pos = 0
        for root, size in zip(roots, sizes):
            ms, ks = clusters[root], at[pos:pos + size].tolist()
            rem = []
            for m, k, v in zip(ms[1:], ks[1:], via_at[r_pos:r_pos + size - 1].tolist()):
                rem.append({"id": src[k], "i": inputs[k], "jaccard": round(to_survivor(root, m), 6),
                            "linked_via": inputs[v], "link_jaccard": round(link[m][1], 6)})
            yield {"kept": src[ks[0]], "kept_i": inputs[ks[0]], "removed": rem}
            pos, r_pos = pos + size, r_pos + size - 1

    return rows(), removed


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
    unsignatured: int | None = None  # counted by the sharded path, which keeps no per-document ``active``

    def unsignatured_count(self) -> int:
        return self.unsignatured if self.unsignatured is not None else int((~self.active).sum())


class AcceptedEdges:
    """The merging edges of a visit, (i, j) -> Jaccard, in two flat arrays: 16 bytes an edge instead of a
    dictionary entry with a tuple and a float (~180). :func:`visit_measured` adds to it; :meth:`reuse` looks
    the survivors' edges up once the visit is over."""

    def __init__(self) -> None:
        self.keys = array("q")  # i << 32 | j
        self.jac = array("d")

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, i: int, j: int, jac: float) -> None:
        if i < 0 or j >> 32 or i >> 31:
            raise ValueError(f"document numbers must be < 2^31, got ({i}, {j})")
        self.keys.append(i << 32 | j)
        self.jac.append(jac)

    def reuse(self, res: DedupResult, need: list[tuple[int, int]]) -> None:
        """``res.to_survivor[m]`` = the Jaccard of the accepted edge (root, m), for the pairs of ``need`` that
        are one, in ``need``'s order (the others are measured by the caller)."""
        if not len(self.keys) or not need:
            return
        keys = np.frombuffer(self.keys, dtype=np.int64)
        order = np.argsort(keys)
        ordered = keys[order]
        want = np.fromiter((r << 32 | m for r, m in need), dtype=np.int64, count=len(need))
        at = np.minimum(np.searchsorted(ordered, want), len(ordered) - 1)
        jac = np.frombuffer(self.jac, dtype=np.float64)[order]
        for k in np.flatnonzero(ordered[at] == want).tolist():
            res.to_survivor[need[k][1]] = float(jac[at[k]])


def visit_measured(uf: UnionFind, res: DedupResult, accepted: AcceptedEdges, i: int, j: int,
                   jac: float, threshold: float) -> None:
    """The accept/reject step of the sorted visit, for a pair (i < j) whose ends ``uf`` does not join yet and
    whose Jaccard ``jac`` was measured: counted in ``res.verified``; at or above ``threshold`` it is a merging
    edge (union, the first merging edge of each end kept in ``res.link``, the edge in ``accepted``, counted
    in ``res.accepted``), below it only counted in ``res.rejected``. The one definition used by
    :func:`verify_and_cluster` (measuring as it goes) and
    :func:`data_pipeline.dedup.components.replay_edges` (replaying Jaccards measured by the workers), so
    the two visits cannot drift apart."""
    res.verified += 1
    if jac >= threshold:
        uf.union(i, j)
        res.link.setdefault(j, (i, jac))
        res.link.setdefault(i, (j, jac))
        accepted.add(i, j, jac)
        res.accepted += 1
    else:
        res.rejected += 1


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
    accepted = AcceptedEdges()
    res = DedupResult({}, {}, {}, candidates=len(pairs))
    bar = tqdm(total=len(pairs), desc="dedup: verify", unit="pair", disable=not progress)
    find = uf.find
    for part in pair_blocks(list(map(tuple, pairs.tolist())), max_docs):  # type: ignore[arg-type]
        todo = [(i, j) for i, j in part if find(i) != find(j)]
        sets = cache.load(d for p in todo for d in p) if todo else {}
        for i, j in todo:
            if find(i) == find(j):  # joined by an earlier pair of this part
                continue
            visit_measured(uf, res, accepted, i, j, jaccard_sorted(sets[i], sets[j]), threshold)
        bar.update(len(part))
    bar.close()
    res.skipped = len(pairs) - res.verified
    res.clusters = uf.clusters()
    need = [(root, m) for root, ms in res.clusters.items() for m in ms[1:]]
    accepted.reuse(res, need)
    for part in pair_blocks([p for p in need if p[1] not in res.to_survivor], max_docs):
        sets = cache.load(d for p in part for d in p)
        for (_, m), jac in zip(part, _jaccards(sets, part)):
            res.to_survivor[m] = jac
    return res
