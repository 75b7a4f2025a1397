"""Exact deduplication before the fuzzy (MinHash) stage, as NeMo Curator runs it.

Key of a document: BLAKE2b-128 of the UTF-8 bytes of its *cleaned* text (after ftfy and whitespace
normalisation, so texts differing only in mojibake, entities, line breaks or runs of spaces share a key).
Keys are held as a ``uint64[n, 2]`` array (16 bytes per document) and grouped with one ``lexsort``; the
lowest store position of each group survives. Two documents with equal text have equal shingle sets, so
equal signatures and Jaccard 1: the fuzzy stage would join them anyway, and clustering the exact-group
survivors then adding each removed copy to its survivor's cluster gives the same kept documents as the
fuzzy stage on everything (tested), for the price of one hash per document instead of a MinHash
signature. Collision probability for n documents: about n^2 / 2^129.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_pipeline.dedup.verify import DedupResult
from data_pipeline.doc_store import DocStore
from data_pipeline.files import atomic_save_npy, reset_dir
from data_pipeline.store import REBUILD, ShardCheck, StoreError, seal_shard, shard_name, write_text_from

KEY = "blake2b-128 of the cleaned text's UTF-8 bytes"


def text_key(text: str) -> np.ndarray:
    """uint64[2]: the key of one cleaned text."""
    return np.frombuffer(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest(), np.uint64)


def text_keys(store: DocStore) -> np.ndarray:
    """uint64[n, 2]: the key of every stored document, in store order — from the ``docs-K.key.npy`` files
    the filter stage writes (hashed while it had the text), else by reading the texts again."""
    files = [store.folder / f"{shard_name(k)}.key.npy" for k in store.shards]
    if all(f.exists() for f in files):  # a key file (a cache: the texts give it again) is checked before it is used
        check = ShardCheck()
        files = [check.file(store.folder, k, ".key.npy") for k in store.shards]
        keys = np.concatenate([np.load(f) for f in files]) if files else np.zeros((0, 2), np.uint64)
        if len(keys) != len(store):
            raise StoreError(f"{store.folder}: its key files hold {len(keys)} keys for {len(store)} documents: {REBUILD}")
        return keys
    keys = np.empty((len(store), 2), dtype=np.uint64)
    for pos, text in enumerate(store.iter_texts()):
        keys[pos] = text_key(text)
    return keys


def exact_representatives(keys: np.ndarray) -> np.ndarray:
    """int64[n]: for each position, the lowest position with the same key (itself when unique)."""
    n = len(keys)
    rep = np.arange(n, dtype=np.int64)
    if n < 2:
        return rep
    order = np.lexsort((np.arange(n), keys[:, 1], keys[:, 0]))  # by key, then position
    k = keys[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (k[1:] != k[:-1]).any(axis=1)
    first = order[np.flatnonzero(new)]
    rep[order] = first[np.cumsum(new) - 1]
    return rep


def write_subset(store: DocStore, keep: np.ndarray, folder: Path) -> DocStore:
    """A store of the documents at positions ``keep`` (sorted), one shard per source shard, in order: only
    the shard indexes are written (their offsets point into ``store``'s shard files, named in the subset's
    ``_text_from.json``), so no text is copied."""
    reset_dir(folder)
    want = np.zeros(len(store), dtype=bool)
    want[keep] = True
    write_text_from(folder, store.text_folder)
    for slot, k in enumerate(store.shards):
        lo, hi = int(store.starts[slot]), int(store.starts[slot + 1])
        rows = store.rows(slot)[np.flatnonzero(want[lo:hi])]
        idx = atomic_save_npy(folder / f"{shard_name(k)}.idx.npy", rows.astype(np.int64))
        seal_shard(folder, k, {"kept": int(len(rows))}, {".idx.npy": idx})
    return DocStore(folder)


def merge_exact(res: DedupResult, reps: np.ndarray, rep_of: np.ndarray) -> DedupResult:
    """Fuzzy result on the exact-group survivors (positions ``0..len(reps)-1`` of the subset store, whose
    store positions are ``reps``) → the result in store positions with each exact copy added to its
    survivor's cluster: linked via its survivor at Jaccard 1, its Jaccard to the cluster's kept document
    equal to its survivor's."""
    copies = np.flatnonzero(rep_of != np.arange(len(rep_of)))
    return merge_copies(res, lambda r: int(reps[r]), np.column_stack([copies, rep_of[copies]]))


def merge_copies(res: DedupResult, to_store: Callable[[int], int], copies: np.ndarray) -> DedupResult:
    """:func:`merge_exact` with the survivors' positions mapped by ``to_store`` and the exact copies given as
    (copy, survivor) store positions (int64[m, 2], sorted by copy): what the sharded stage's components task
    uses (the copies from :mod:`data_pipeline.dedup.exact_sharded`)."""
    clusters = {to_store(r): [to_store(m) for m in ms] for r, ms in res.clusters.items()}
    link = {to_store(m): (to_store(v), j) for m, (v, j) in res.link.items()}
    to_surv = {to_store(m): j for m, j in res.to_survivor.items()}
    root_of = {m: r for r, ms in clusters.items() for m in ms}
    for m, g in copies.tolist():
        root = root_of.setdefault(g, g)
        clusters.setdefault(root, [root]).append(m)
        link[m] = (g, 1.0)
        to_surv[m] = to_surv.get(g, 1.0) if g != root else 1.0
    clusters = {r: sorted(ms) for r, ms in clusters.items()}
    return DedupResult(clusters, link, to_surv, res.candidates, res.verified, res.accepted, res.rejected,
                       res.skipped, res.active, res.seconds, res.unsignatured)
