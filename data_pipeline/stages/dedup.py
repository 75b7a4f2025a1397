"""Stage ``dedup``: exact duplicates, then MinHash + LSH + Jaccard + union-find → ``work/dedup/``."""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.report import StageTimer
from data_pipeline.stages.bookkeeping import begin_stage, digest, finish_stage, fingerprint, open_store, work_dir
from data_pipeline.store import DocStore, atomic_save_npy, write_jsonl_atomic

if TYPE_CHECKING:
    from data_pipeline.dedup import LshSpec, ShingleSpec

log = logging.getLogger(__name__)


def dedup_specs(cfg: BuildConfig) -> tuple[ShingleSpec, LshSpec]:
    """The shingle and LSH settings of ``cfg.dedup`` (bands x rows resolved)."""
    from data_pipeline.dedup import LshSpec, ShingleSpec, lsh_params

    d = cfg.dedup
    b, r = lsh_params(d.threshold, d.num_perm, d.bands, d.rows, d.lsh_weights)
    return ShingleSpec(d.shingle_size, d.shingle_unit), LshSpec(d.threshold, d.num_perm, b, r, d.seed)


def run_dedup(cfg: BuildConfig) -> dict[str, Any]:
    """Exact duplicates first, then fuzzy dedup of the survivors; writes ``removed.npy`` and ``duplicates.jsonl``."""
    from data_pipeline import dedup as dd

    timer = StageTimer("dedup")
    store = open_store(cfg, "filter")  # finished, whole (shards and documents as its stage wrote them)
    store.close()
    folder = begin_stage(cfg, "dedup")
    store = DocStore(work_dir(cfg, "filter"))
    d = cfg.dedup
    shingle, lsh = dedup_specs(cfg)
    n = len(store)
    info: dict[str, Any] = {"enabled": d.enabled, "threshold": d.threshold, "num_perm": d.num_perm,
                            "bands": lsh.bands, "rows": lsh.rows, "seed": d.seed,
                            "shingles": f"{shingle.unit} {shingle.n}-grams" + (
                                " of lower-cased \\w+ words" if shingle.unit == "word" else " of raw characters"),
                            "hash": "xxh64 per word / fmix64(code point + 1) per char, n-gram mix + fmix64 → "
                                    "64-bit fingerprint; its high 32 bits → datasketch affine32 permutations",
                            "verification": "Jaccard of the 64-bit shingle-fingerprint sets of every candidate pair "
                                            "whose documents union-find has not already joined",
                            "survivor": "lowest input index of each union-find cluster",
                            "p_candidate": {str(s): round(dd.candidate_probability(s, lsh.bands, lsh.rows), 4)
                                            for s in (0.5, 0.6, 0.7, 0.75, 0.8, 0.9)},
                            "storage": "files" if d.sharded else "dict", "executor": cfg.executor}
    removed: list[int] = []
    clusters: dict[int, list[int]] = {}
    rows: list[dict[str, Any]] = []
    times: dict[str, float] = {}
    if d.enabled and n:
        sig_dir = cfg.out / "work" / ("signatures-" + digest([fingerprint(cfg, "filter"), d.num_perm, d.seed,
                                                                 d.shingle_size, d.shingle_unit,
                                                                 dd.FINGERPRINT_VERSION, d.chunk_size]))
        candidates = None
        from data_pipeline.dedup import exact as ex

        def fuzzy(st: DocStore, sdir: Path) -> Any:  # dedup.sharded false: the single-driver reference path
            cand = candidates
            if cfg.executor == "ray":  # signature chunks and the LSH band shuffle as Ray tasks
                from data_pipeline.ray_executor import band_shuffle_pairs, ray_sign_chunks

                ray_sign_chunks(cfg, st, sdir, lsh.num_perm, lsh.seed, shingle, d.chunk_size)

                def cand(sigs: np.ndarray, active: np.ndarray) -> np.ndarray:
                    return band_shuffle_pairs(cfg, sdir, len(st), d.chunk_size, lsh.bands, lsh.rows)
            return dd.dedup_store(st, sdir, shingle, lsh, d.chunk_size, cfg.num_workers, d.verify_block_docs,
                                  cfg.progress, cand)

        if d.sharded:  # every step a worker task, the report written by one: the driver holds nothing per document
            from data_pipeline.dedup.sharded import dedup_stage_files, local_pmap

            if cfg.executor == "ray":
                from data_pipeline.ray_executor import ray_pmap, shuffle_tasks

                pmap, tasks = ray_pmap(cfg), shuffle_tasks(cfg)
            else:
                pmap, tasks = local_pmap(cfg.num_workers), cfg.num_workers
            got = dedup_stage_files(store, sig_dir, folder / "lsh", folder, shingle, lsh, d.chunk_size,
                                    d.verify_block_docs, pmap, d.exact, tasks)
            store.close()
            copies = got["exact_copies"]
            info["exact"] = {"enabled": d.exact, "key": ex.KEY, "duplicates": copies}
            info.update(exact_duplicates=copies, fuzzy_removed=got["removed"] - copies)
            info.update(documents=n, unsignatured=got["unsignatured"], candidate_pairs=got["candidates"],
                        verified_pairs=got["accepted"], rejected_candidates=got["rejected"],
                        skipped_candidates=got["skipped"], measured_pairs=got["verified"],
                        clusters=got["clusters"], removed=got["removed"], phase_seconds=got["seconds"])
            log.info("dedup: %d docs, %d exact duplicates, %d candidate pairs, %d verified, %d clusters, %d removed "
                     "%s", n, copies, got["candidates"], got["accepted"], got["clusters"], got["removed"],
                     got["seconds"])
            return finish_stage(cfg, "dedup", timer.finish(n, **info))
        t_exact = time.perf_counter()
        rep_of = ex.exact_representatives(ex.text_keys(store)) if d.exact else np.arange(n)
        reps = np.flatnonzero(rep_of == np.arange(n))
        info["exact"] = {"enabled": d.exact, "key": ex.KEY, "duplicates": n - len(reps)}
        if len(reps) < n:  # fuzzy dedup of the exact-group survivors only, then the copies are merged back
            sub = ex.write_subset(store, reps, folder / "exact-survivors")
            exact_s = round(time.perf_counter() - t_exact, 3)
            res = ex.merge_exact(fuzzy(sub, Path(str(sig_dir) + "-exact")), reps, rep_of)
            sub.close()
            shutil.rmtree(sub.folder)  # only the signature step reads it; its fingerprint cache stays
        else:
            exact_s = round(time.perf_counter() - t_exact, 3)
            res = fuzzy(store, sig_dir)
        res.seconds = {"exact": exact_s, **res.seconds}
        clusters = res.clusters
        rows, removed = dd.duplicate_rows(store, clusters, res.link, lambda root, m: res.to_survivor[m])
        store.close()
        info.update(exact_duplicates=n - len(reps), fuzzy_removed=len(removed) - (n - len(reps)))
        info.update(documents=n, unsignatured=res.unsignatured_count(), candidate_pairs=res.candidates,
                    verified_pairs=res.accepted, rejected_candidates=res.rejected,
                    skipped_candidates=res.skipped, measured_pairs=res.verified,
                    clusters=len(clusters), removed=len(removed), phase_seconds=res.seconds)
        times = info["phase_seconds"]
    else:
        info.update(exact_duplicates=0, fuzzy_removed=0)
        info.update(documents=n, unsignatured=0, candidate_pairs=0, verified_pairs=0, rejected_candidates=0,
                    skipped_candidates=0, measured_pairs=0, clusters=0, removed=0)
    atomic_save_npy(folder / "removed.npy", np.asarray(sorted(removed), dtype=np.int64))
    write_jsonl_atomic(folder / "duplicates.jsonl", rows)
    log.info("dedup: %d docs, %d exact duplicates, %d candidate pairs, %d verified, %d clusters, %d removed %s",
             n, info["exact_duplicates"], info["candidate_pairs"], info["verified_pairs"], info["clusters"],
             info["removed"], times)
    return finish_stage(cfg, "dedup", timer.finish(n, **info))
