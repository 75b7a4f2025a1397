"""The five stages of a corpus build and their bookkeeping.

    ingest    read every source, reject malformed records, clean (ftfy + whitespace)  → work/ingest/
    tokenizer train sentencepiece on the cleaned documents, or load GPT-2 BPE files   → tokenizer/
    filter    count tokens per document, drop those under length.min_tokens           → work/filter/
    dedup     shingle fingerprints + MinHash + LSH + Jaccard + union-find             → work/dedup/
    export    kept documents, indexed datasets, rejects, duplicates, stats, manifest  → <output_dir>/

Each stage records ``work/<stage>/_stage.json`` = {fingerprint, status, stats}. The fingerprint hashes
the config keys that change the stage's result together with the upstream fingerprint, so ``build``
skips a finished stage whose inputs did not change and recomputes everything downstream of a change
(``dedup.threshold=0.8`` reruns dedup and export only; signatures are even reused, they do not depend
on the threshold). Inside ingest, filter and dedup's signature step the unit of work is a shard or
chunk with its own completion marker, so a crashed run resumes without recomputing finished shards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.clean import clean_text
from data_pipeline.config import BuildConfig, ConfigError
from data_pipeline.report import StageTimer, peak_rss_mib, summary_table
from data_pipeline.sources import REJECT_REASONS, RawRecord, input_fingerprint, iter_records
from data_pipeline.store import (DocStore, ShardWriter, atomic_save_npy, atomic_write_json, done_shards, iter_shard,
                    read_json, reset_dir, shard_counts, shard_name, write_jsonl_atomic)

log = logging.getLogger(__name__)

STAGES = ("ingest", "tokenizer", "filter", "dedup", "export")


class StageError(RuntimeError):
    """A stage cannot run (e.g. its upstream stage has not finished); one line."""


# ------------------------------------------------------------------------------------------ bookkeeping
def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def work_dir(cfg: BuildConfig, stage: str) -> Path:
    return cfg.out / "work" / stage


#: config fields of the retired Redis LSH flow: never part of a fingerprint (unchanged stage fingerprints)
_RETIRED_DEDUP_KEYS = ("storage", "redis_host", "redis_port", "redis_db", "basename", "redis_password_env",
                       "redis_username", "redis_tls", "redis_ca_certs")


def _dedup_result_keys(cfg: BuildConfig) -> dict[str, Any]:
    """``dedup.*`` settings that change the result (the retired Redis keys are dropped while config has them)."""
    d = dataclasses.asdict(cfg.dedup)
    for k in ("chunk_size", "verify_block_docs", *_RETIRED_DEDUP_KEYS):
        d.pop(k, None)
    return d


def fingerprint(cfg: BuildConfig, stage: str) -> str:
    """Hash of everything that determines a stage's output."""
    if stage == "ingest":
        return _digest(["ingest", [dataclasses.asdict(s) for s in cfg.sources], input_fingerprint(cfg),
                        dataclasses.asdict(cfg.clean), cfg.shard_size])
    if stage == "tokenizer":
        t = dataclasses.asdict(cfg.tokenizer)
        if cfg.tokenizer.type != "sentencepiece":
            t = {k: t[k] for k in ("type", "model_file", "vocab_file", "merges_file")
                 + (("lowercase",) if cfg.tokenizer.type == "wordpiece" else ())}
            return _digest(["tokenizer", t, _file_stats(cfg)])
        return _digest(["tokenizer", fingerprint(cfg, "ingest"), t, cfg.seed])
    if stage == "filter":
        return _digest(["filter", fingerprint(cfg, "ingest"), fingerprint(cfg, "tokenizer"),
                        dataclasses.asdict(cfg.length)])
    if stage == "dedup":
        return _digest(["dedup", fingerprint(cfg, "filter"), _dedup_result_keys(cfg)])
    if stage == "export":
        parts = ["export", fingerprint(cfg, "dedup"), dataclasses.asdict(cfg.dataset)]
        if cfg.decontaminate.against:  # unchanged fingerprint when decontamination is off
            parts.append([cfg.decontaminate.ngram, _decontam_files(cfg)])
        return _digest(parts)
    raise ValueError(stage)


def _file_stats(cfg: BuildConfig) -> list[Any]:
    out = []
    for k in ("model_file", "vocab_file", "merges_file"):
        v = getattr(cfg.tokenizer, k)
        if v:
            st = os.stat(cfg.resolve(v))
            out.append([k, st.st_size, int(st.st_mtime)])
    return out


def _decontam_files(cfg: BuildConfig) -> list[Any]:
    out = []
    for item in cfg.decontaminate.against:
        name, _, path = item.partition("=")
        st = os.stat(cfg.resolve(path))
        out.append([name, str(cfg.resolve(path)), st.st_size, int(st.st_mtime)])
    return out


def stage_record(cfg: BuildConfig, stage: str) -> dict[str, Any] | None:
    p = work_dir(cfg, stage) / "_stage.json"
    return read_json(p) if p.exists() else None


def is_done(cfg: BuildConfig, stage: str) -> bool:
    rec = stage_record(cfg, stage)
    return bool(rec and rec.get("status") == "done" and rec.get("fingerprint") == fingerprint(cfg, stage))


def _begin(cfg: BuildConfig, stage: str) -> Path:
    """Prepare a stage folder: keep finished shards of the same fingerprint (resume), else wipe it."""
    folder = work_dir(cfg, stage)
    rec = stage_record(cfg, stage)
    fp = fingerprint(cfg, stage)
    if rec is None or rec.get("fingerprint") != fp or rec.get("status") == "done":
        reset_dir(folder)
    atomic_write_json(folder / "_stage.json", {"fingerprint": fp, "status": "started"})
    return folder


def _finish(cfg: BuildConfig, stage: str, stats: dict[str, Any]) -> dict[str, Any]:
    atomic_write_json(work_dir(cfg, stage) / "_stage.json",
                      {"fingerprint": fingerprint(cfg, stage), "status": "done", "stats": stats})
    log.info("stage %s done in %.2fs", stage, stats.get("seconds", 0.0))
    return stats


def _require(cfg: BuildConfig, stage: str) -> dict[str, Any]:
    if not is_done(cfg, stage):
        raise StageError(f"stage '{stage}' has not finished for this config in {cfg.out}: run "
                         f"`python -m data_pipeline build --config ...` (or `stage {stage}`) first")
    return stage_record(cfg, stage)["stats"]  # type: ignore[index]


def _bar(cfg: BuildConfig, **kw: Any) -> Any:
    from tqdm import tqdm

    return tqdm(disable=not cfg.progress, **kw)


# ------------------------------------------------------------------------------------------------ ingest
def _ingest_shard(args: tuple[str, int, list[RawRecord], int, bool, bool]) -> dict[str, Any]:
    folder_s, k, records, first, use_ftfy, ws = args
    folder = Path(folder_s)
    writer = ShardWriter(folder, k)
    counts: Counter[str] = Counter()
    rejects = []
    try:
        for n, rec in enumerate(records):
            i = first + n
            if rec.text is not None:
                text = clean_text(rec.text, use_ftfy, ws)
                if text:
                    writer.add(i, rec.src, text, **_uid_of(rec))
                    counts["clean"] += 1
                    continue
                rec = RawRecord(rec.src, None, "empty", "no text left after cleaning: " + repr(rec.text[:100]))
            counts[rec.reason or "unknown"] += 1
            rejects.append({"i": i, "src": rec.src, "reason": rec.reason, "detail": rec.detail})
        write_jsonl_atomic(folder / f"{shard_name(k)}.rejects.jsonl", rejects)
        info = {"read": len(records), "first": first, "clean": counts.pop("clean", 0), "rejected": dict(counts)}
        writer.commit(info)
        return info
    except BaseException:
        writer.abort()
        raise


def _uid_of(rec: RawRecord) -> dict[str, Any]:
    """``{"uid": id}`` for a record with a user id (JSON scalars kept as they are, anything else as str)."""
    if rec.uid is None:
        return {}
    return {"uid": rec.uid if isinstance(rec.uid, (str, int, float, bool)) else str(rec.uid)}


def _shards_of(records: Iterator[RawRecord], size: int) -> Iterator[tuple[int, int, list[RawRecord]]]:
    buf: list[RawRecord] = []
    k = first = 0
    for rec in records:
        buf.append(rec)
        if len(buf) == size:
            yield k, first, buf
            k, first, buf = k + 1, first + size, []
    if buf:
        yield k, first, buf


def run_ingest(cfg: BuildConfig) -> dict[str, Any]:
    timer = StageTimer("ingest")
    folder = _begin(cfg, "ingest")
    done = set(done_shards(folder))
    if done:
        log.info("ingest: resuming, %d shard(s) already finished", len(done))
    workers = cfg.num_workers
    bar = _bar(cfg, desc="ingest: read+clean", unit="doc")
    pending: list[Any] = []

    def drain(limit: int) -> None:
        while len(pending) > limit:
            bar.update(pending.pop(0).get()["read"])

    if cfg.executor == "ray":  # one Ray task per shard; same shard function, same files
        from data_pipeline.ray_executor import ray_map

        def ray_jobs() -> Iterator[tuple[str, int, list[RawRecord], int, bool, bool]]:
            for k, first, recs in _shards_of(iter_records(cfg), cfg.shard_size):
                if k in done:
                    bar.update(len(recs))
                    continue
                yield (str(folder), k, recs, first, cfg.clean.ftfy, cfg.clean.normalize_whitespace)

        try:
            for info in ray_map(cfg, _ingest_shard, ray_jobs()):
                bar.update(info["read"])
        finally:
            bar.close()
    ctx = get_context("fork")
    pool = ctx.Pool(workers) if workers > 1 and cfg.executor == "local" else None
    try:
        for k, first, recs in (_shards_of(iter_records(cfg), cfg.shard_size) if cfg.executor == "local" else ()):
            if k in done:
                bar.update(len(recs))
                continue
            job = (str(folder), k, recs, first, cfg.clean.ftfy, cfg.clean.normalize_whitespace)
            if pool is None:
                bar.update(_ingest_shard(job)["read"])
            else:
                pending.append(pool.apply_async(_ingest_shard, (job,)))
                drain(2 * workers)  # bounded: at most ~2 shards per worker in flight
        drain(0)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        bar.close()
    read = clean = 0
    by_reason: Counter[str] = Counter()
    for k in done_shards(folder):
        c = shard_counts(folder, k)
        read += c["read"]
        clean += c["clean"]
        by_reason.update(c["rejected"])
    stats = timer.finish(read, read=read, clean=clean, rejected=sum(by_reason.values()),
                         rejected_by_reason={r: by_reason.get(r, 0) for r in REJECT_REASONS})
    if clean == 0:
        raise StageError(f"no usable document in the inputs ({read} records read, all rejected: "
                         f"{dict(by_reason)}); see {folder}/*.rejects.jsonl")
    return _finish(cfg, "ingest", stats)


# --------------------------------------------------------------------------------------------- tokenizer
def run_tokenizer(cfg: BuildConfig) -> dict[str, Any]:
    from megatron_ds_suite.core.corpus import copy_tokenizer_files
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, train_sentencepiece

    timer = StageTimer("tokenizer")
    t = cfg.tokenizer
    _begin(cfg, "tokenizer")
    tok_dir = cfg.out / "tokenizer"
    n_docs = 0
    if t.type == "sentencepiece":
        _require(cfg, "ingest")
        store = DocStore(work_dir(cfg, "ingest"))

        def texts() -> Iterator[str]:
            nonlocal n_docs
            for rec in store:
                if n_docs >= t.train_max_docs:
                    return
                n_docs += 1
                yield rec["text"]

        tok = train_sentencepiece(texts(), tok_dir / f"spm_{t.flavor}_{t.vocab_size}", t.vocab_size,
                                  flavor=t.flavor, seed=cfg.seed)  # type: ignore[arg-type]
        spec = tok.spec()
    elif t.type == "sentencepiece_model":
        spec = copy_tokenizer_files(SentencePieceTokenizer(cfg.resolve(t.model_file or "")).spec(), cfg.out)
    elif t.type in ("wordpiece", "hf"):  # a BERT vocab.txt / a tokenizer.json users already have
        from megatron_ds_suite.core.hf_tokenizers import HFTokenizer, WordPieceTokenizer

        tok = (WordPieceTokenizer(cfg.resolve(t.vocab_file or ""), t.lowercase) if t.type == "wordpiece"
               else HFTokenizer(cfg.resolve(t.model_file or "")))
        spec = copy_tokenizer_files(tok.spec(), cfg.out)
    else:
        spec = copy_tokenizer_files(GPT2BPETokenizer(cfg.resolve(t.vocab_file or ""),
                                                     cfg.resolve(t.merges_file or "")).spec(), cfg.out)
    spec = {k: (str(Path(v).resolve()) if k.endswith("_file") else v) for k, v in spec.items()}
    return _finish(cfg, "tokenizer", timer.finish(n_docs, spec=spec, trained_on_docs=n_docs))


def load_stage_tokenizer(cfg: BuildConfig) -> Any:
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    return load_tokenizer(_require(cfg, "tokenizer")["spec"])


# ------------------------------------------------------------------------------------------------ filter
def _uid_extra(rec: dict[str, Any]) -> dict[str, Any]:
    """The user's id of a store record (``id_field``), carried from ingest to export when there is one."""
    return {"uid": rec["uid"]} if "uid" in rec else {}


def save_token_ids(folder: Path, k: int, ids: list[list[int]], dtype: Any) -> None:
    """Shard ``k``'s token ids, one row per stored document: ``docs-K.tok.npy`` (concatenated, EOD not
    included) and ``docs-K.tokoff.npy`` (int64 offsets, len = documents + 1). Written before the shard's
    ``.done.json`` marker, so a finished shard always has them."""
    off = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=off[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(off[-1]))  # one pass, no per-doc array
    atomic_save_npy(folder / f"{shard_name(k)}.tok.npy", flat)
    atomic_save_npy(folder / f"{shard_name(k)}.tokoff.npy", off)


class TokenIds:
    """Random access to the filter stage's token ids by store position (``None`` when the filter output
    predates the token files; export then tokenizes again, with the same result)."""

    def __init__(self, store: DocStore):
        self.folder = store.folder
        self.ok = all((store.folder / f"{shard_name(k)}.tokoff.npy").exists() for k in store.shards)
        counts = np.bincount(np.searchsorted(store.shards, store.shard_of), minlength=len(store.shards)) \
            if len(store) else np.zeros(len(store.shards), np.int64)
        self.first = dict(zip(store.shards, np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()))
        self.shard_of = store.shard_of
        self._k: int | None = None
        self._tok: np.ndarray | None = None
        self._off: np.ndarray | None = None

    def get(self, pos: int) -> np.ndarray:
        k = int(self.shard_of[pos])
        if k != self._k:  # export reads in order: one shard's arrays at a time
            self._tok = np.load(self.folder / f"{shard_name(k)}.tok.npy", mmap_mode="r")
            self._off = np.load(self.folder / f"{shard_name(k)}.tokoff.npy")
            self._k = k
        j = pos - self.first[k]
        return self._tok[self._off[j]:self._off[j + 1]]  # type: ignore[index]


def _filter_shard(args: tuple[str, str, int, dict[str, Any], int, bool, int]) -> dict[str, Any]:
    src_s, dst_s, k, spec, min_tokens, count_eod, batch = args
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    from data_pipeline.dedup.exact import text_key
    from megatron_ds_suite.core.indexed_dataset import best_dtype

    tok = load_tokenizer(spec)
    writer = ShardWriter(Path(dst_s), k)
    too_short, kept, tokens = 0, 0, 0
    kept_ids: list[list[int]] = []  # the kept documents' token ids, reused by export (tokenized once)
    keys: list[np.ndarray] = []  # exact-dedup keys of the kept documents (hashed while the text is at hand)
    dtype = best_dtype(tok.vocab_size)
    examples, short_rows = [], []
    try:
        recs = list(iter_shard(Path(src_s), k))
        for s in range(0, len(recs), batch):
            part = recs[s:s + batch]
            for rec, ids in zip(part, tok.encode_batch([r["text"] for r in part])):
                n = len(ids) + (1 if count_eod else 0)
                if n >= min_tokens:
                    writer.add(rec["i"], rec["src"], rec["text"], **_uid_extra(rec), ntok=n)
                    kept_ids.append(ids)
                    keys.append(text_key(rec["text"]))
                    kept += 1
                    tokens += n
                else:
                    too_short += 1
                    short_rows.append({"i": rec["i"], "src": rec["src"], "reason": "too_short",
                                       "detail": f"{n} tokens < length.min_tokens={min_tokens}"})
                    if len(examples) < 3:
                        examples.append({"i": rec["i"], "src": rec["src"], "tokens": n})
        info = {"in": len(recs), "kept": kept, "too_short": too_short, "tokens": tokens, "examples": examples}
        save_token_ids(Path(dst_s), k, kept_ids, dtype)
        atomic_save_npy(Path(dst_s) / f"{shard_name(k)}.key.npy",
                        np.stack(keys) if keys else np.zeros((0, 2), np.uint64))
        write_jsonl_atomic(Path(dst_s) / f"{shard_name(k)}.too_short.jsonl", short_rows)  # for rejects.jsonl
        writer.commit(info)
        return info
    except BaseException:
        writer.abort()
        raise


def run_filter(cfg: BuildConfig) -> dict[str, Any]:
    timer = StageTimer("filter")
    _require(cfg, "ingest")
    spec = _require(cfg, "tokenizer")["spec"]
    src = work_dir(cfg, "ingest")
    dst = _begin(cfg, "filter")
    todo = [k for k in done_shards(src) if k not in set(done_shards(dst))]
    jobs = [(str(src), str(dst), k, spec, cfg.length.min_tokens, cfg.length.count_eod,
             cfg.dataset.tokenize_batch) for k in todo]
    bar = _bar(cfg, desc="filter: count tokens", unit="doc")
    if cfg.executor == "ray":
        from data_pipeline.ray_executor import ray_map

        for info in ray_map(cfg, _filter_shard, jobs):
            bar.update(info["in"])
    elif cfg.num_workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(min(cfg.num_workers, len(jobs))) as pool:
            for info in pool.imap_unordered(_filter_shard, jobs):
                bar.update(info["in"])
    else:
        for j in jobs:
            bar.update(_filter_shard(j)["in"])
    bar.close()
    tot: Counter[str] = Counter()
    examples: list[Any] = []
    for k in done_shards(dst):
        c = shard_counts(dst, k)
        tot.update({x: c[x] for x in ("in", "kept", "too_short", "tokens")})
        examples += c["examples"][: max(0, 5 - len(examples))]
    tok_spec = {k: v for k, v in spec.items()}
    stats = timer.finish(tot["in"], kept=tot["kept"], too_short=tot["too_short"], tokens=tot["tokens"],
                         min_tokens=cfg.length.min_tokens, count_eod=cfg.length.count_eod,
                         tokenizer=tok_spec, too_short_examples=examples)
    return _finish(cfg, "filter", stats)


# ------------------------------------------------------------------------------------------------- dedup
def dedup_specs(cfg: BuildConfig) -> tuple[Any, Any]:
    from data_pipeline.dedup import LshSpec, ShingleSpec, lsh_params

    d = cfg.dedup
    b, r = lsh_params(d.threshold, d.num_perm, d.bands, d.rows, d.lsh_weights)
    return ShingleSpec(d.shingle_size, d.shingle_unit), LshSpec(d.threshold, d.num_perm, b, r, d.seed)


def run_dedup(cfg: BuildConfig) -> dict[str, Any]:
    from data_pipeline import dedup as dd

    timer = StageTimer("dedup")
    _require(cfg, "filter")
    folder = _begin(cfg, "dedup")
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
                            "storage": "dict", "executor": cfg.executor}
    removed: list[int] = []
    clusters: dict[int, list[int]] = {}
    rows: list[dict[str, Any]] = []
    times: dict[str, float] = {}
    if d.enabled and n:
        sig_dir = cfg.out / "work" / ("signatures-" + _digest([fingerprint(cfg, "filter"), d.num_perm, d.seed,
                                                                 d.shingle_size, d.shingle_unit,
                                                                 dd.FINGERPRINT_VERSION, d.chunk_size]))
        candidates = None
        from data_pipeline.dedup import exact as ex

        def fuzzy(st: DocStore, sdir: Path) -> Any:
            cand = candidates
            if cfg.executor == "ray":  # signature chunks and the LSH band shuffle as Ray tasks
                from data_pipeline.ray_executor import band_shuffle_pairs, ray_sign_chunks

                ray_sign_chunks(cfg, st, sdir, lsh.num_perm, lsh.seed, shingle, d.chunk_size)

                def cand(sigs: np.ndarray, active: np.ndarray) -> np.ndarray:
                    return band_shuffle_pairs(cfg, sdir, len(st), d.chunk_size, lsh.bands, lsh.rows)
            return dd.dedup_store(st, sdir, shingle, lsh, d.chunk_size, cfg.num_workers, d.verify_block_docs,
                                  cfg.progress, cand)

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
        info.update(documents=n, unsignatured=int((~res.active).sum()), candidate_pairs=res.candidates,
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
    return _finish(cfg, "dedup", timer.finish(n, **info))


# ------------------------------------------------------------------------------------------------ export
def document_row(rec: dict[str, Any]) -> dict[str, Any]:
    """A ``documents.jsonl`` row. With the user's id (``id_field``): ``id`` is that id, unchanged, and
    ``source`` the provenance (``path:line``, ``path[row]``, ...); without one, ``id`` is the provenance."""
    if "uid" in rec:
        suffix = f"#{rec['uid']}"
        src = rec["src"][:-len(suffix)] if rec["src"].endswith(suffix) else rec["src"]
        return {"id": rec["uid"], "i": rec["i"], "source": src, "text": rec["text"]}
    return {"id": rec["src"], "i": rec["i"], "text": rec["text"]}


def _decontaminate(cfg: BuildConfig, store: DocStore, removed: set[int]) -> dict[int, list[str]]:
    """Store positions of documents kept by dedup that share a ``decontaminate.ngram``-gram with an
    evaluation set → the sets' names; written to ``contaminated.jsonl`` (always, empty when off)."""
    from data_pipeline.overlap import contaminated_positions, load_eval_set

    found: dict[int, list[str]] = {}
    if cfg.decontaminate.against:
        sets = [load_eval_set(name, cfg.resolve(p), cfg.decontaminate.ngram)
                for name, _, p in (x.partition("=") for x in cfg.decontaminate.against)]
        texts = (rec["text"] for rec in store)
        found = {pos: names for pos, names in contaminated_positions(texts, sets, cfg.num_workers, cfg.progress)
                 if pos not in removed}
    rows = []
    for pos in sorted(found):
        rec = store.get(pos)
        rows.append({"id": document_row(rec)["id"], "i": rec["i"], "sets": found[pos]})
    write_jsonl_atomic(cfg.out / "contaminated.jsonl", rows)
    return found


def run_export(cfg: BuildConfig) -> dict[str, Any]:
    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
    from data_pipeline.sentences import split_sentences

    timer = StageTimer("export")
    ing = _require(cfg, "ingest")
    tok_stats = _require(cfg, "tokenizer")
    flt = _require(cfg, "filter")
    ded = _require(cfg, "dedup")
    _begin(cfg, "export")
    out = cfg.out
    tok = load_stage_tokenizer(cfg)
    store = DocStore(work_dir(cfg, "filter"))
    removed = set(np.load(work_dir(cfg, "dedup") / "removed.npy").tolist())
    contaminated = _decontaminate(cfg, store, removed)
    dtype = best_dtype(tok.vocab_size)
    gpt = MMapIndexedDatasetBuilder(out / cfg.dataset.gpt_prefix, dtype) if cfg.dataset.gpt else None
    bert = MMapIndexedDatasetBuilder(out / cfg.dataset.bert_prefix, dtype) if cfg.dataset.bert else None
    docs_tmp = out / f"documents.jsonl.tmp{os.getpid()}"
    kept = tokens = sentences = 0
    batch: list[dict[str, Any]] = []
    batch_pos: list[int] = []
    bar = _bar(cfg, total=len(store), desc="export: tokenize+write", unit="doc")

    cached = TokenIds(store)
    eod = np.asarray([tok.eod], dtype=dtype)

    def flush(f: Any) -> None:
        nonlocal tokens, sentences
        texts = [r["text"] for r in batch]
        if gpt is not None:
            if cached.ok:  # the filter's ids: each document is tokenized once per build
                for pos in batch_pos:
                    ids = cached.get(pos)
                    gpt.add_item(np.concatenate([ids, eod]))
                    gpt.end_document()
                    tokens += len(ids) + 1
            else:
                for ids in tok.encode_batch(texts):
                    gpt.add_item(np.asarray(ids + [tok.eod], dtype=np.int64))
                    gpt.end_document()
                    tokens += len(ids) + 1
        if bert is not None:
            for text in texts:
                sents = split_sentences(text)
                items = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(sents) if ids]
                bert.add_document(items)
                sentences += len(items)
                if gpt is None:
                    tokens += sum(len(x) for x in items)
        for r in batch:
            f.write(json.dumps(document_row(r), ensure_ascii=False) + "\n")
        bar.update(len(batch))
        batch.clear()
        batch_pos.clear()

    try:
        with open(docs_tmp, "w", encoding="utf-8") as f:
            for pos, rec in enumerate(store):
                if pos in removed or pos in contaminated:
                    bar.update(1)
                    continue
                batch.append(rec)
                batch_pos.append(pos)
                kept += 1
                if len(batch) >= cfg.dataset.tokenize_batch:
                    flush(f)
            if batch:
                flush(f)
        for b in (gpt, bert):
            if b is not None:
                b.finalize()
        os.replace(docs_tmp, out / "documents.jsonl")
    finally:
        docs_tmp.unlink(missing_ok=True)
        bar.close()
    # rejects (all of them, in input order) and the duplicates report
    ingest_dir = work_dir(cfg, "ingest")
    tmp = out / f"rejects.jsonl.tmp{os.getpid()}"
    filter_dir = work_dir(cfg, "filter")
    with open(tmp, "wb") as f:
        for k in done_shards(ingest_dir):
            short = filter_dir / f"{shard_name(k)}.too_short.jsonl"
            with open(ingest_dir / f"{shard_name(k)}.rejects.jsonl", "rb") as r:
                if not short.is_file():  # a filter stage finished before too-short rows were listed
                    shutil.copyfileobj(r, f)
                    continue
                # malformed (ingest) and too-short (filter) records of one shard, in input order
                rows = [json.loads(x) for x in r] + [json.loads(x) for x in open(short, "rb")]
            for row in sorted(rows, key=lambda x: x["i"]):
                f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    os.replace(tmp, out / "rejects.jsonl")
    tmp = out / f"duplicates.jsonl.tmp{os.getpid()}"
    shutil.copyfile(work_dir(cfg, "dedup") / "duplicates.jsonl", tmp)
    os.replace(tmp, out / "duplicates.jsonl")

    exp = timer.finish(len(store), kept=kept, tokens=tokens, sentences=sentences, contaminated=len(contaminated),
                       decontaminate={"ngram": cfg.decontaminate.ngram, "against": cfg.decontaminate.against}
                       if cfg.decontaminate.against else None)
    _finish(cfg, "export", exp)
    stats = assemble_stats(cfg)
    atomic_write_json(out / "stats.json", stats)
    write_manifest(out, tok_stats["spec"], cfg.dataset.gpt_prefix if gpt else None,
                   cfg.dataset.bert_prefix if bert else None,
                   extra={"documents": stats["documents"], "tokens": stats["tokens"],
                          "length_filter": stats["length_filter"], "dedup": stats["dedup"],
                          "sources": [dataclasses.asdict(s) for s in cfg.sources]})
    del ing, flt, ded
    return exp


def assemble_stats(cfg: BuildConfig, reused: set[str] | None = None) -> dict[str, Any]:
    ing = _require(cfg, "ingest")
    flt = _require(cfg, "filter")
    ded = _require(cfg, "dedup")
    exp = _require(cfg, "export")
    read, malformed = ing["read"], ing["rejected"]
    too_short, dups, kept = flt["too_short"], ded["removed"], exp["kept"]
    contaminated = exp.get("contaminated", 0)
    stage_stats = {s: {**{k: _require(cfg, s)[k] for k in ("seconds", "docs_in", "docs_per_s", "peak_rss_mib",
                                                             "peak_rss_children_mib")},
                       "reused": s in (reused or set())} for s in STAGES}
    tok = flt["tokenizer"]
    return {
        "output_dir": str(cfg.out),
        "documents": {"read": read, "malformed": malformed, "too_short": too_short, "duplicates": dups,
                      "contaminated": contaminated, "kept": kept,
                      "reconciles": read == malformed + too_short + dups + contaminated + kept},
        "malformed_by_reason": ing["rejected_by_reason"],
        "tokens": {"kept": exp["tokens"], "includes_eod": bool(cfg.dataset.gpt), "sentences": exp["sentences"]},
        "length_filter": {"min_tokens": flt["min_tokens"], "count_eod": flt["count_eod"],
                          "rule": "drop if len(encode(text)) + (1 if count_eod else 0) < min_tokens; "
                                  "every document is tokenised (no 1024-character shortcut)",
                          "tokenizer": {k: v for k, v in tok.items()}, "examples": flt["too_short_examples"]},
        "dedup": {k: v for k, v in ded.items() if k not in ("docs_in", "docs_per_s", "peak_rss_mib",
                                                            "peak_rss_children_mib")},
        "stages": stage_stats,
        "peak_rss_mib": max(s["peak_rss_mib"] for s in stage_stats.values()),
        "peak_rss_children_mib": max(s["peak_rss_children_mib"] for s in stage_stats.values()),
        "config": cfg.to_dict(),
        "python": sys.version.split()[0],
    }


RUNNERS = {"ingest": run_ingest, "tokenizer": run_tokenizer, "filter": run_filter, "dedup": run_dedup,
           "export": run_export}


def run_stage(cfg: BuildConfig, stage: str) -> dict[str, Any]:
    """Run one stage now (recomputing it); its upstream stages must be finished for this config."""
    if stage not in RUNNERS:
        raise ConfigError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    cfg.out.mkdir(parents=True, exist_ok=True)
    return RUNNERS[stage](cfg)


def build(cfg: BuildConfig, force: bool = False) -> tuple[Path, dict[str, Any]]:
    """Run every stage that is not finished for this config (all of them with ``force``)."""
    if cfg.executor == "ray":  # reach the cluster before any work
        from data_pipeline.ray_executor import connect

        connect(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    reused: set[str] = set()
    t0 = time.perf_counter()
    for stage in STAGES:
        if not force and is_done(cfg, stage) and not (stage == "export" and not (cfg.out / "stats.json").exists()):
            log.info("stage %s: finished earlier with the same inputs and settings, reused", stage)
            reused.add(stage)
            continue
        RUNNERS[stage](cfg)
    stats = assemble_stats(cfg, reused)
    stats["total_seconds"] = round(time.perf_counter() - t0, 3)
    stats["peak_rss_now_mib"] = peak_rss_mib()[0]
    atomic_write_json(cfg.out / "stats.json", stats)
    return cfg.out, stats


__all__ = ["STAGES", "StageError", "build", "run_stage", "summary_table", "fingerprint", "is_done"]
