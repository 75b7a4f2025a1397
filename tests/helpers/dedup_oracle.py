"""The single-driver dedup (retired from the build, issue 39): the test oracle of the sharded stage.

:func:`reference_dedup_files` is what the dedup stage did with ``dedup.sharded: false`` until issue 39: exact
representatives by one ``lexsort`` (:func:`data_pipeline.dedup.exact.exact_representatives`), then
:func:`data_pipeline.dedup.dedup_store` (signatures loaded here, ``band_pairs``, ``verify_and_cluster``) on the
survivors, the exact copies merged back (``merge_exact``) and the report rows (``duplicate_rows``). The build's
stage (:func:`data_pipeline.dedup.sharded.dedup_stage_files`, every step a worker task) must write the same
``removed.npy`` and ``duplicates.jsonl`` and count the same pairs (``tests/e2e/test_data_dedup_sharded.py``).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline import dedup as dd
from data_pipeline.dedup import exact as ex
from data_pipeline.doc_store import DocStore


def reference_dedup_files(store: DocStore, sig_dir: Path, work: Path, shingle: dd.ShingleSpec, lsh: dd.LshSpec,
                          chunk_size: int, max_docs: int, exact: bool, workers: int = 1
                          ) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, int]]:
    """(removed positions sorted, ``duplicates.jsonl`` rows, counts) of the single-driver path."""
    n = len(store)
    rep_of = ex.exact_representatives(ex.text_keys(store)) if exact else np.arange(n)
    reps = np.flatnonzero(rep_of == np.arange(n))
    if len(reps) < n:  # fuzzy dedup of the exact-group survivors only, then the copies are merged back
        sub = ex.write_subset(store, reps, work / "exact-survivors")
        res = ex.merge_exact(dd.dedup_store(sub, Path(str(sig_dir) + "-exact"), shingle, lsh, chunk_size, workers,
                                            max_docs, progress=False), reps, rep_of)
        sub.close()
        shutil.rmtree(sub.folder)
    else:
        res = dd.dedup_store(store, sig_dir, shingle, lsh, chunk_size, workers, max_docs, progress=False)
    rows, removed = dd.duplicate_rows(store, res.clusters, res.link, lambda root, m: res.to_survivor[m])
    counts = {"exact_duplicates": n - len(reps), "unsignatured": res.unsignatured_count(),
              "candidate_pairs": res.candidates, "verified_pairs": res.accepted,
              "rejected_candidates": res.rejected, "skipped_candidates": res.skipped,
              "measured_pairs": res.verified, "clusters": len(res.clusters), "removed": len(removed)}
    return np.asarray(sorted(removed), dtype=np.int64), rows, counts
