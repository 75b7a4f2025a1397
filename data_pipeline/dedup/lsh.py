"""LSH banding: candidate pairs of documents whose signatures agree on a whole band.

LSH: documents share a candidate bucket in band ``b`` iff their signatures are equal on rows
``[b·r, (b+1)·r)`` — datasketch ``MinHashLSH(params=(bands, rows))`` semantics. In memory this is one
sort per band of a 64-bit hash of the band (adjacent equal hashes are checked row by row, so a hash
collision can never add a pair; a collision makes that band fall back to an exact ``np.unique``); equal
to the buckets of datasketch's own in-memory ``MinHashLSH`` (tested).
Default bands×rows: the pair datasketch's ``_optimal_param(threshold, num_perm, 0.1, 0.9)`` picks (computed
here without scipy, :func:`lsh_params`) — biased to
recall: 20×6 at 0.7/128 finds a pair at exactly J=0.7 with probability 0.92 (equal weights: 14×9, 0.44).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from data_pipeline.dedup.hashing import POS_MULT, fmix64

if TYPE_CHECKING:  # datasketch (and the scipy it imports, ~0.3 s) is loaded only where it is used
    from datasketch import MinHashLSH


@dataclass(frozen=True)
class LshSpec:
    """Jaccard threshold, signature length, ``bands`` x ``rows`` banding and the MinHash seed."""

    threshold: float
    num_perm: int
    bands: int
    rows: int
    seed: int


def lsh_params(threshold: float, num_perm: int, bands: int | None, rows: int | None,
               weights: Iterable[float] = (0.1, 0.9)) -> tuple[int, int]:
    """(bands, rows): the explicit pair, or the pair datasketch's ``MinHashLSH`` picks for these
    (false-positive, false-negative) weights: the ``bands·rows <= num_perm`` minimising
    ``w_fp·∫_0^t P(s) ds + w_fn·∫_t^1 (1 − P(s)) ds`` with P(s) = 1 − (1 − s^rows)^bands, the first one
    (bands, then rows, ascending) on a tie, as ``datasketch.lsh._optimal_param`` scans them. P is a
    polynomial of degree bands·rows <= num_perm, so Gauss-Legendre with num_perm/2 + 1 nodes integrates it
    exactly (to rounding) where datasketch calls ``scipy.integrate.quad``; no scipy import (0.33 s).
    ``tests/unit/test_data_dedup.py`` checks the choice against datasketch's over thresholds, sizes and weights."""
    if bands is not None and rows is not None:
        return bands, rows
    fp_w, fn_w = list(weights)
    x, w = np.polynomial.legendre.leggauss(num_perm // 2 + 1)  # nodes and weights on [-1, 1]
    pairs = [(b, r) for b in range(1, num_perm + 1) for r in range(1, num_perm // b + 1)]
    bb = np.asarray([p[0] for p in pairs], dtype=np.float64)[:, None]
    rr = np.asarray([p[1] for p in pairs], dtype=np.float64)[:, None]

    def integral(lo: float, hi: float, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        s = (hi - lo) / 2 * x[None, :] + (hi + lo) / 2
        return (hi - lo) / 2 * (f(s) * w[None, :]).sum(axis=1)

    fp = integral(0.0, threshold, lambda s: 1 - (1 - s ** rr) ** bb)
    fn = integral(threshold, 1.0, lambda s: (1 - s ** rr) ** bb)
    return pairs[int(np.argmin(fp * fp_w + fn * fn_w))]  # argmin: the first minimum, as datasketch's scan


def candidate_probability(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s ** rows) ** bands


# ----------------------------------------------------------------------------------------- LSH candidates
def _band_groups(band: np.ndarray) -> np.ndarray:
    """Group label (uint64) per row of ``band`` (uint32[m, r]): equal labels ⇔ equal rows. A 64-bit
    mix of the rows, unless two different rows collide, then the exact ``np.unique`` inverse."""
    h = np.zeros(len(band), dtype=np.uint64)
    for c in range(band.shape[1]):
        h = fmix64((h + band[:, c].astype(np.uint64)) * POS_MULT[c])
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
    from datasketch import MinHashLSH

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
