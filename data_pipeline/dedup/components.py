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

from pathlib import Path

import numpy as np

from data_pipeline.dedup.edges import edge_files
from data_pipeline.dedup.verify import DedupResult, UnionFind, visit_measured


def replay_edges(edge_dir: Path, ranges: int, n: int, threshold: float
                 ) -> tuple[DedupResult, dict[tuple[int, int], float]]:
    """(result without ``to_survivor``, {accepted edge (i, j): Jaccard})."""
    uf = UnionFind()
    find = uf.find
    accepted: dict[tuple[int, int], float] = {}
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
