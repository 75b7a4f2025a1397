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

from .clean import clean_text
from .config import BuildConfig, ConfigError
from .report import StageTimer, peak_rss_mib, summary_table
from .sources import REJECT_REASONS, RawRecord, input_fingerprint, iter_records
from .store import (DocStore, ShardWriter, atomic_save_npy, atomic_write_json, done_shards, iter_shard,
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


def _dedup_result_keys(cfg: BuildConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg.dedup)
    for k in ("chunk_size", "storage", "redis_host", "redis_port", "redis_db", "basename", "verify_block_docs",
              "redis_password_env", "redis_username", "redis_tls", "redis_ca_certs"):
        d.pop(k)
    return d


def fingerprint(cfg: BuildConfig, stage: str) -> str:
    """Hash of everything that determines a stage's output."""
    if stage == "ingest":
        return _digest(["ingest", [dataclasses.asdict(s) for s in cfg.sources], input_fingerprint(cfg),
                        dataclasses.asdict(cfg.clean), cfg.shard_size])
    if stage == "tokenizer":
        t = dataclasses.asdict(cfg.tokenizer)
        if cfg.tokenizer.type != "sentencepiece":
            t = {k: t[k] for k in ("type", "model_file", "vocab_file", "merges_file")}
            return _digest(["tokenizer", t, _file_stats(cfg)])
        return _digest(["tokenizer", fingerprint(cfg, "ingest"), t, cfg.seed])
    if stage == "filter":
        return _digest(["filter", fingerprint(cfg, "ingest"), fingerprint(cfg, "tokenizer"),
                        dataclasses.asdict(cfg.length)])
    if stage == "dedup":
        return _digest(["dedup", fingerprint(cfg, "filter"), _dedup_result_keys(cfg)])
    if stage == "export":
        return _digest(["export", fingerprint(cfg, "dedup"), dataclasses.asdict(cfg.dataset)])
    raise ValueError(stage)


def _file_stats(cfg: BuildConfig) -> list[Any]:
    out = []
    for k in ("model_file", "vocab_file", "merges_file"):
        v = getattr(cfg.tokenizer, k)
        if v:
            st = os.stat(cfg.resolve(v))
            out.append([k, st.st_size, int(st.st_mtime)])
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
                    writer.add(i, rec.src, text)
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

    ctx = get_context("fork")
    pool = ctx.Pool(workers) if workers > 1 else None
    try:
        for k, first, recs in _shards_of(iter_records(cfg), cfg.shard_size):
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
    from .corpus import copy_tokenizer_files
    from .tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, train_sentencepiece

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
    else:
        spec = copy_tokenizer_files(GPT2BPETokenizer(cfg.resolve(t.vocab_file or ""),
                                                     cfg.resolve(t.merges_file or "")).spec(), cfg.out)
    spec = {k: (str(Path(v).resolve()) if k.endswith("_file") else v) for k, v in spec.items()}
    return _finish(cfg, "tokenizer", timer.finish(n_docs, spec=spec, trained_on_docs=n_docs))


def load_stage_tokenizer(cfg: BuildConfig) -> Any:
    from .tokenizer import load_tokenizer

    return load_tokenizer(_require(cfg, "tokenizer")["spec"])


# ------------------------------------------------------------------------------------------------ filter
def _filter_shard(args: tuple[str, str, int, dict[str, Any], int, bool, int]) -> dict[str, Any]:
    src_s, dst_s, k, spec, min_tokens, count_eod, batch = args
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(spec)
    writer = ShardWriter(Path(dst_s), k)
    too_short, kept, tokens = 0, 0, 0
    examples, short_rows = [], []
    try:
        recs = list(iter_shard(Path(src_s), k))
        for s in range(0, len(recs), batch):
            part = recs[s:s + batch]
            for rec, ids in zip(part, tok.encode_batch([r["text"] for r in part])):
                n = len(ids) + (1 if count_eod else 0)
                if n >= min_tokens:
                    writer.add(rec["i"], rec["src"], rec["text"], ntok=n)
                    kept += 1
                    tokens += n
                else:
                    too_short += 1
                    short_rows.append({"i": rec["i"], "src": rec["src"], "reason": "too_short",
                                       "detail": f"{n} tokens < length.min_tokens={min_tokens}"})
                    if len(examples) < 3:
                        examples.append({"i": rec["i"], "src": rec["src"], "tokens": n})
        info = {"in": len(recs), "kept": kept, "too_short": too_short, "tokens": tokens, "examples": examples}
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
    if cfg.num_workers > 1 and len(jobs) > 1:
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
    from .dedup import LshSpec, ShingleSpec, lsh_params

    d = cfg.dedup
    b, r = lsh_params(d.threshold, d.num_perm, d.bands, d.rows, d.lsh_weights)
    return ShingleSpec(d.shingle_size, d.shingle_unit), LshSpec(d.threshold, d.num_perm, b, r, d.seed)


def run_dedup(cfg: BuildConfig) -> dict[str, Any]:
    from . import dedup as dd

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
                            "storage": d.storage}
    removed: list[int] = []
    clusters: dict[int, list[int]] = {}
    rows: list[dict[str, Any]] = []
    times: dict[str, float] = {}
    if d.enabled and n:
        sig_dir = cfg.out / "work" / ("signatures-" + _digest([fingerprint(cfg, "filter"), d.num_perm, d.seed,
                                                                 d.shingle_size, d.shingle_unit,
                                                                 dd.FINGERPRINT_VERSION, d.chunk_size]))
        candidates = None
        if d.storage == "redis":
            basename = d.basename or f"dp-{_digest([str(cfg.out), fingerprint(cfg, 'dedup')])}"

            def candidates(sigs: np.ndarray, active: np.ndarray) -> np.ndarray:
                dd.redis_clear(d.redis_host, d.redis_port, d.redis_db, basename, **dd.redis_auth(d))
                atomic_save_npy(folder / "sigs.npy", sigs)
                atomic_save_npy(folder / "active.npy", active)
                storage = dd.redis_storage_config(d.redis_host, d.redis_port, d.redis_db, basename, **dd.redis_auth(d))
                try:
                    found = dd.candidates_redis(folder / "sigs.npy", lsh, storage, max(1, cfg.num_workers))
                finally:
                    dd.redis_clear(d.redis_host, d.redis_port, d.redis_db, basename, **dd.redis_auth(d))
                    (folder / "sigs.npy").unlink(missing_ok=True)
                return np.asarray(sorted(found), dtype=np.int64).reshape(-1, 2)

        res = dd.dedup_store(store, sig_dir, shingle, lsh, d.chunk_size, cfg.num_workers, d.verify_block_docs,
                             cfg.progress, candidates)
        clusters = res.clusters
        rows, removed = dd.duplicate_rows(store, clusters, res.link, lambda root, m: res.to_survivor[m])
        store.close()
        info.update(documents=n, unsignatured=int((~res.active).sum()), candidate_pairs=res.candidates,
                    verified_pairs=res.accepted, rejected_candidates=res.rejected,
                    skipped_candidates=res.skipped, measured_pairs=res.verified,
                    clusters=len(clusters), removed=len(removed), phase_seconds=res.seconds)
        times = info["phase_seconds"]
    else:
        info.update(documents=n, unsignatured=0, candidate_pairs=0, verified_pairs=0, rejected_candidates=0,
                    skipped_candidates=0, measured_pairs=0, clusters=0, removed=0)
    atomic_save_npy(folder / "removed.npy", np.asarray(sorted(removed), dtype=np.int64))
    write_jsonl_atomic(folder / "duplicates.jsonl", rows)
    log.info("dedup: %d docs, %d candidate pairs, %d verified, %d clusters, %d removed %s", n,
             info["candidate_pairs"], info["verified_pairs"], info["clusters"], info["removed"], times)
    return _finish(cfg, "dedup", timer.finish(n, **info))


# ------------------------------------------------------------------------------------------------ export
def run_export(cfg: BuildConfig) -> dict[str, Any]:
    from .corpus import write_manifest
    from .indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
    from .sentences import split_sentences

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
    dtype = best_dtype(tok.vocab_size)
    gpt = MMapIndexedDatasetBuilder(out / cfg.dataset.gpt_prefix, dtype) if cfg.dataset.gpt else None
    bert = MMapIndexedDatasetBuilder(out / cfg.dataset.bert_prefix, dtype) if cfg.dataset.bert else None
    docs_tmp = out / f"documents.jsonl.tmp{os.getpid()}"
    kept = tokens = sentences = 0
    batch: list[dict[str, Any]] = []
    bar = _bar(cfg, total=len(store), desc="export: tokenize+write", unit="doc")

    def flush(f: Any) -> None:
        nonlocal tokens, sentences
        texts = [r["text"] for r in batch]
        if gpt is not None:
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
            f.write(json.dumps({"id": r["src"], "i": r["i"], "text": r["text"]}, ensure_ascii=False) + "\n")
        bar.update(len(batch))
        batch.clear()

    try:
        with open(docs_tmp, "w", encoding="utf-8") as f:
            for pos, rec in enumerate(store):
                if pos in removed:
                    bar.update(1)
                    continue
                batch.append(rec)
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

    exp = timer.finish(len(store), kept=kept, tokens=tokens, sentences=sentences)
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
    stage_stats = {s: {**{k: _require(cfg, s)[k] for k in ("seconds", "docs_in", "docs_per_s", "peak_rss_mib",
                                                             "peak_rss_children_mib")},
                       "reused": s in (reused or set())} for s in STAGES}
    tok = flt["tokenizer"]
    return {
        "output_dir": str(cfg.out),
        "documents": {"read": read, "malformed": malformed, "too_short": too_short, "duplicates": dups,
                      "kept": kept, "reconciles": read == malformed + too_short + dups + kept},
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
