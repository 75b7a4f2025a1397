"""Stage ``dedup``: exact duplicates, then MinHash + LSH + Jaccard + union-find → ``work/dedup/``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.doc_store import DocStore
from data_pipeline.executor import Executor
from data_pipeline.files import atomic_save_npy, write_jsonl_atomic
from data_pipeline.stages.bookkeeping import StageRun, digest, fingerprint, open_store, work_dir

if TYPE_CHECKING:
    from data_pipeline.dedup import LshSpec, ShingleSpec

log = logging.getLogger(__name__)


def dedup_specs(cfg: BuildConfig) -> tuple[ShingleSpec, LshSpec]:
    """The shingle and LSH settings of ``cfg.dedup`` (bands x rows resolved)."""
    from data_pipeline.dedup import LshSpec, ShingleSpec, lsh_params

    d = cfg.dedup
    b, r = lsh_params(d.threshold, d.num_perm, d.bands, d.rows, d.lsh_weights)
    return ShingleSpec(d.shingle_size, d.shingle_unit), LshSpec(d.threshold, d.num_perm, b, r, d.seed)


def settings_info(cfg: BuildConfig, shingle: ShingleSpec, lsh: LshSpec, executor: Executor) -> dict[str, Any]:
    """The stage's stats that describe its settings (``stats.json`` ``dedup``: what was compared, and how)."""
    from data_pipeline.dedup import candidate_probability

    d = cfg.dedup
    return {"enabled": d.enabled, "threshold": d.threshold, "num_perm": d.num_perm, "bands": lsh.bands,
            "rows": lsh.rows, "seed": d.seed,
            "shingles": f"{shingle.unit} {shingle.n}-grams" + (
                " of lower-cased \\w+ words" if shingle.unit == "word" else " of raw characters"),
            "hash": "xxh64 per word / fmix64(code point + 1) per char, n-gram mix + fmix64 → "
                    "64-bit fingerprint; its high 32 bits → datasketch affine32 permutations",
            "verification": "Jaccard of the 64-bit shingle-fingerprint sets of every candidate pair "
                            "whose documents union-find has not already joined",
            "survivor": "lowest input index of each union-find cluster",
            "p_candidate": {str(s): round(candidate_probability(s, lsh.bands, lsh.rows), 4)
                            for s in (0.5, 0.6, 0.7, 0.75, 0.8, 0.9)},
            "storage": "files", "executor": executor.name}


def signature_dir(cfg: BuildConfig) -> Path:
    """The signature chunks' folder (``work/signatures-<hash>``): kept across builds whose filter output and
    signature settings are the same, so a rerun with another threshold or band layout re-signs nothing."""
    from data_pipeline.dedup import FINGERPRINT_VERSION

    d = cfg.dedup
    return cfg.out / "work" / ("signatures-" + digest([fingerprint(cfg, "filter"), d.num_perm, d.seed, d.shingle_size,
                                                          d.shingle_unit, FINGERPRINT_VERSION, d.chunk_size]))


NOTHING_FOUND = {"exact_duplicates": 0, "fuzzy_removed": 0, "unsignatured": 0, "candidate_pairs": 0,
                 "verified_pairs": 0, "rejected_candidates": 0, "skipped_candidates": 0, "measured_pairs": 0,
                 "clusters": 0, "removed": 0}
"""The counts of a stage that compared nothing (``dedup.enabled: false`` or no document)."""


def run_dedup(cfg: BuildConfig, executor: Executor) -> dict[str, Any]:
    """Exact duplicates first, then fuzzy dedup of the survivors, every step a task of ``executor``
    (:func:`data_pipeline.dedup.sharded.dedup_stage_files`: the driver holds nothing per document); writes
    ``removed.npy`` and ``duplicates.jsonl``."""
    from data_pipeline.dedup.exact import KEY
    from data_pipeline.dedup.sharded import dedup_stage_files

    with StageRun(cfg, "dedup") as stage:
        open_store(cfg, "filter").close()  # finished, whole (shards and documents as its stage wrote them)
        folder = stage.begin()
        d = cfg.dedup
        shingle, lsh = dedup_specs(cfg)
        info = settings_info(cfg, shingle, lsh, executor)
        with DocStore(work_dir(cfg, "filter")) as store:
            n = len(store)
            if not (d.enabled and n):
                atomic_save_npy(folder / "removed.npy", np.zeros(0, dtype=np.int64))
                write_jsonl_atomic(folder / "duplicates.jsonl", [])
                log.info("dedup: %d docs, nothing compared", n)
                return stage.finish(stage.stats(n, **info, documents=n, **NOTHING_FOUND))
            got = dedup_stage_files(store, signature_dir(cfg), folder / "lsh", folder, shingle, lsh, d.chunk_size,
                                    d.verify_block_docs, executor.map, d.exact, executor.min_tasks)
        copies = got["exact_copies"]
        info["exact"] = {"enabled": d.exact, "key": KEY, "duplicates": copies}
        info.update(exact_duplicates=copies, fuzzy_removed=got["removed"] - copies, documents=n,
                    unsignatured=got["unsignatured"], candidate_pairs=got["candidates"], verified_pairs=got["accepted"],
                    rejected_candidates=got["rejected"], skipped_candidates=got["skipped"],
                    measured_pairs=got["verified"], clusters=got["clusters"], removed=got["removed"],
                    phase_seconds=got["seconds"])
        log.info("dedup: %d docs, %d exact duplicates, %d candidate pairs, %d verified, %d clusters, %d removed %s",
                 n, copies, got["candidates"], got["accepted"], got["clusters"], got["removed"], got["seconds"])
        return stage.finish(stage.stats(n, **info))
