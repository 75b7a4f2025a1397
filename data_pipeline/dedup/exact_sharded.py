"""Exact deduplication by worker tasks: the driver holds no key, no position and no survivor list.

:mod:`data_pipeline.dedup.exact` groups every document's 128-bit key with one ``lexsort`` on one process
(16 bytes per document plus the sort). Here the same grouping is a map/reduce over files, in groups of
whole store shards (``groups``: consecutive shards holding about ``docs_per_group`` documents):

1. :func:`key_map` (one task per group): each document's key (the filter's ``docs-K.key.npy``, else hashed
   from the text) and store position, as ``uint64[k0, k1, position]`` records routed to partition
   ``k0 % parts`` (equal keys meet in one partition), one file per group sorted by partition, with offsets;
2. :func:`key_reduce` (one task per partition): the partition's records of every group, sorted by (key,
   position); in each run of equal keys every position after the first is an exact copy of the first (the
   lowest position: :func:`data_pipeline.dedup.exact.exact_representatives`). The (copy, survivor) pairs are
   written split by the shard group of the copy, ``dups/g<group>-p<part>.npy`` (int64[m, 2], sorted);
3. :func:`write_subset_group` (one task per group): the group's shards of the survivors' store (every
   document that is no copy), as the index-only store of :func:`data_pipeline.dedup.exact.write_subset`, plus
   ``docs-K.pos.npy``: the store position of each survivor row (the survivors' store position -> the
   store's, read by :class:`SubsetPositions`).

The survivors and copies are those of :func:`~data_pipeline.dedup.exact.exact_representatives` for any
number of partitions and groups (tested). Memory of a task: one group's keys (map, subset) or one
partition's records (reduce).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.dedup.exact import text_key
from data_pipeline.doc_store import DocStore
from data_pipeline.files import atomic_save_npy
from data_pipeline.store import REBUILD, ShardCheck, StoreError, seal_shard, shard_name

#: documents per shard group (map and subset tasks)
DOCS_PER_GROUP = 100_000


def shard_groups(store: DocStore, docs_per_group: int = DOCS_PER_GROUP) -> list[tuple[int, int]]:
    """Consecutive shard slots ``[lo, hi)`` holding about ``docs_per_group`` documents each (whole shards)."""
    groups, lo = [], 0
    for slot in range(len(store.shards)):
        if int(store.starts[slot + 1] - store.starts[lo]) >= docs_per_group:
            groups.append((lo, slot + 1))
            lo = slot + 1
    if lo < len(store.shards) or not groups:
        groups.append((lo, len(store.shards)))
    return groups


def _map_files(map_dir: Path, group: int) -> tuple[Path, Path]:
    return map_dir / f"km-{group:06d}.npy", map_dir / f"kmo-{group:06d}.npy"


def dup_file(dup_dir: Path, group: int, part: int) -> Path:
    return dup_dir / f"g{group:06d}-p{part:06d}.npy"


@dataclass(frozen=True)
class KeyMapJob:
    """Map task: the keys of shard slots [lo, hi) of the store in ``store_dir`` -> their partition file."""

    store_dir: str
    group: int
    lo: int
    hi: int
    parts: int
    map_dir: str


def key_map(job: KeyMapJob) -> int:
    """Map task (module docstring); returns the group's number of documents."""
    store = DocStore(Path(job.store_dir))
    check = ShardCheck()
    keys, pos = [], []
    for slot in range(job.lo, job.hi):
        start, stop = int(store.starts[slot]), int(store.starts[slot + 1])
        k = store.shards[slot]
        keys.append(np.load(check.file(store.folder, k, ".key.npy")) if (store.folder / f"{shard_name(k)}.key.npy").exists()
                    else np.asarray([text_key(t) for t in store.texts(start, stop)], np.uint64).reshape(-1, 2))
        if len(keys[-1]) != stop - start:
            raise StoreError(f"{store.folder / shard_name(k)}.key.npy holds {len(keys[-1])} keys for {stop - start} "
                             f"documents: {REBUILD}")
        pos.append(np.arange(start, stop, dtype=np.uint64))
    store.close()
    rec = np.column_stack([np.concatenate(keys), np.concatenate(pos)]) if keys else np.zeros((0, 3), np.uint64)
    part = (rec[:, 0] % np.uint64(job.parts)).astype(np.int64)
    order = np.argsort(part, kind="stable")
    out, off = _map_files(Path(job.map_dir), job.group)
    np.save(out, rec[order])
    np.save(off, np.concatenate([[0], np.cumsum(np.bincount(part, minlength=job.parts))]).astype(np.int64))
    return int(len(rec))


@dataclass(frozen=True)
class KeyReduceJob:
    """Reduce task: partition ``part`` of every group's map file -> (copy, survivor) pairs per group."""

    map_dir: str
    part: int
    groups: int
    group_starts: tuple[int, ...]  # store position of each group's first document
    dup_dir: str


def key_reduce(job: KeyReduceJob) -> int:
    """Reduce task (module docstring); returns the number of exact copies in the partition."""
    pieces = []
    for g in range(job.groups):
        rec_f, off_f = _map_files(Path(job.map_dir), g)
        off = np.load(off_f)
        pieces.append(np.array(np.load(rec_f, mmap_mode="r")[off[job.part]:off[job.part + 1]]))
    rec = np.concatenate(pieces) if pieces else np.zeros((0, 3), np.uint64)
    del pieces
    if len(rec) < 2:
        return 0
    order = np.lexsort((rec[:, 2], rec[:, 1], rec[:, 0]))  # by key, then position
    rec = rec[order]
    new = np.ones(len(rec), dtype=bool)
    new[1:] = (rec[1:, :2] != rec[:-1, :2]).any(axis=1)
    first = rec[np.flatnonzero(new), 2]
    surv = first[np.cumsum(new) - 1].astype(np.int64)
    copies = ~new
    pairs = np.column_stack([rec[copies, 2].astype(np.int64), surv[copies]])
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    grp = np.searchsorted(np.asarray(job.group_starts, np.int64), pairs[:, 0], side="right") - 1
    bounds = np.searchsorted(grp, np.arange(job.groups + 1))
    for g in range(job.groups):
        if bounds[g + 1] > bounds[g]:
            np.save(dup_file(Path(job.dup_dir), g, job.part), pairs[bounds[g]:bounds[g + 1]])
    return int(len(pairs))


def read_dups(dup_dir: Path, group: int | None = None) -> np.ndarray:
    """(copy, survivor) pairs (int64[m, 2], sorted by copy) of one group, or of every group (``None``)."""
    files = sorted(dup_dir.glob(f"g{group:06d}-p*.npy" if group is not None else "g*-p*.npy"))
    pairs = np.concatenate([np.load(f) for f in files]) if files else np.zeros((0, 2), np.int64)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


@dataclass(frozen=True)
class SubsetJob:
    """Subset task: shard slots [lo, hi) of the store in ``store_dir``, less the group's exact copies."""

    store_dir: str
    group: int
    lo: int
    hi: int
    dup_dir: str
    out_dir: str


def write_subset_group(job: SubsetJob) -> int:
    """Subset task (module docstring); returns the number of survivors written."""
    store = DocStore(Path(job.store_dir))
    copies = read_dups(Path(job.dup_dir), job.group)[:, 0]
    out, kept = Path(job.out_dir), 0
    for slot in range(job.lo, job.hi):
        start, stop, k = int(store.starts[slot]), int(store.starts[slot + 1]), store.shards[slot]
        pos = np.arange(start, stop, dtype=np.int64)
        keep = ~np.isin(pos, copies[(copies >= start) & (copies < stop)])
        sums = {".idx.npy": atomic_save_npy(out / f"{shard_name(k)}.idx.npy", store.rows(slot)[keep].astype(np.int64)),
                ".pos.npy": atomic_save_npy(out / f"{shard_name(k)}.pos.npy", pos[keep])}
        seal_shard(out, k, {"kept": int(keep.sum())}, sums)
        kept += int(keep.sum())
    store.close()
    return kept


class SubsetPositions:
    """Survivors' store position -> the store's position, from the subset's ``docs-K.pos.npy`` files
    (memory-mapped per shard: only the pages of the positions asked for are read)."""

    def __init__(self, subset_dir: Path):
        self.store = DocStore(subset_dir)
        self._maps: dict[int, np.ndarray] = {}

    def __call__(self, pos: int) -> int:
        slot = self.store.slot_of(pos)
        m = self._maps.get(slot)
        if m is None:
            m = self._maps[slot] = np.load(self.store.folder / f"{shard_name(self.store.shards[slot])}.pos.npy",
                                           mmap_mode="r")
        return int(m[pos - int(self.store.starts[slot])])
