"""Connected components from the edge files, streamed range by range: the clusters, links and counts.

The edge files (:mod:`data_pipeline.dedup.edges`) hold every candidate pair, sorted within a range, and
the ranges partition the lower document ``i``, so reading them in range order is the global sorted order
of :func:`data_pipeline.dedup.verify.verify_and_cluster`. The replay repeats that visit: a pair union-find
already joins is skipped; otherwise its measured Jaccard (always present, see ``edges``) goes through the same
accept/reject step, :func:`data_pipeline.dedup.verify.visit_measured` (union; first merging edge of each end
recorded as its link; or rejected). Clusters, links and the measured / accepted / rejected / skipped counts
are therefore identical to the single-process result.

Memory: one range's edge arrays at a time, plus the union-find, links and accepted edges, which hold only
documents that are in a cluster (a document never joined is never stored); no signature and no bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.dedup.edges import edge_files
from data_pipeline.dedup.exact import merge_copies
from data_pipeline.dedup.exact_sharded import SubsetPositions, read_dups
from data_pipeline.dedup.minhash import ShingleCache
from data_pipeline.dedup.verify import (
    AcceptedEdges,
    DedupResult,
    UnionFind,
    duplicate_rows,
    jaccard_sorted,
    pair_blocks,
    visit_measured,
)
from data_pipeline.doc_store import DocStore
from data_pipeline.files import atomic_save_npy, write_jsonl_atomic


def replay_edges(edge_dir: Path, ranges: int, n: int, threshold: float) -> tuple[DedupResult, AcceptedEdges]:
    """(result without ``to_survivor``, the accepted edges (i, j) with their Jaccards)."""
    uf = UnionFind()
    find = uf.find
    accepted = AcceptedEdges()
    res = DedupResult({}, {}, {})
    for r in range(ranges):
        e_f, j_f = edge_files(edge_dir, r)
        keys, jac = np.load(e_f), np.load(j_f)
        res.candidates += len(keys)
        measured = ~np.isnan(jac)  # not measured in its range ⇒ already joined here too (edges docstring)
        keys, jac = keys[measured], jac[measured]
        for i, j, x in zip((keys // n).tolist(), (keys % n).tolist(), jac.tolist()):
            if find(i) == find(j):
                continue
            visit_measured(uf, res, accepted, i, j, x, threshold)
    res.skipped = res.candidates - res.verified
    res.clusters = uf.clusters()
    return res, accepted


@dataclass(frozen=True)
class ComponentsJob:
    """The components task of the sharded stage (:func:`components_task`)."""

    edge_dir: str
    ranges: int
    n: int  # documents of the store the fuzzy step ran on
    threshold: float
    sig_dir: str
    chunk_size: int
    max_docs: int
    store_dir: str  # the store whose documents the report names (the filter's)
    subset_dir: str | None  # the exact survivors' store the fuzzy step ran on (None: ``store_dir`` itself)
    dup_dir: str | None  # the exact copies (:mod:`data_pipeline.dedup.exact_sharded`)
    out_dir: str  # gets ``duplicates.jsonl`` and ``removed.npy``


def survivor_jaccards(res: DedupResult, accepted: AcceptedEdges, sig_dir: Path, n: int,
                      chunk_size: int, max_docs: int) -> None:
    """Fill ``res.to_survivor``: each removed member's Jaccard to its cluster's survivor, reused from an
    accepted edge (survivor, member) or measured from the fingerprint sets (blocks of at most ``max_docs``)."""
    need = [(root, m) for root, ms in res.clusters.items() for m in ms[1:]]
    accepted.reuse(res, need)
    cache = ShingleCache(sig_dir, n, chunk_size, lazy=True)
    for block in pair_blocks([p for p in need if p[1] not in res.to_survivor], max_docs):
        sets = cache.load(d for p in block for d in p)
        for root, m in block:
            res.to_survivor[m] = jaccard_sorted(sets[root], sets[m])


def components_task(job: ComponentsJob) -> dict[str, int]:
    """One worker task, after the verification tasks: the edge files replayed (:func:`replay_edges`), the
    survivor Jaccards (:func:`survivor_jaccards`), the exact copies merged back
    (:func:`data_pipeline.dedup.exact.merge_copies`), then ``duplicates.jsonl`` and ``removed.npy`` written
    (atomically) into ``out_dir``; returns the counts. The driver holds none of it: this task's memory is
    the union-find, links and rows of the documents in clusters (the report's own size), and one range's
    edges."""
    res, accepted = replay_edges(Path(job.edge_dir), job.ranges, job.n, job.threshold)
    survivor_jaccards(res, accepted, Path(job.sig_dir), job.n, job.chunk_size, job.max_docs)
    del accepted
    copies = read_dups(Path(job.dup_dir)) if job.dup_dir else np.zeros((0, 2), np.int64)
    if job.subset_dir is not None or len(copies):
        to_store = SubsetPositions(Path(job.subset_dir)) if job.subset_dir is not None else int
        res = merge_copies(res, to_store, copies)
    store = DocStore(Path(job.store_dir))
    try:
        rows, removed = duplicate_rows(store, res.clusters, res.link, lambda root, m: res.to_survivor[m])
    finally:
        store.close()
    out = Path(job.out_dir)
    atomic_save_npy(out / "removed.npy", np.asarray(sorted(removed), dtype=np.int64))
    write_jsonl_atomic(out / "duplicates.jsonl", rows)
    return {"candidates": res.candidates, "verified": res.verified, "accepted": res.accepted,
            "rejected": res.rejected, "skipped": res.skipped, "clusters": len(res.clusters),
            "removed": len(removed), "exact_copies": int(len(copies))}
