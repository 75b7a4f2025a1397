"""Stage ``filter``: count tokens per document, drop those under ``length.min_tokens`` → ``work/filter/``.

The filter's store is an index over the ingest shard files (no text is copied): per shard, the kept rows'
``idx.npy``, their token ids, exact-dedup keys and the too-short rows; ``_text_from.json`` names the ingest
folder (see :class:`data_pipeline.doc_store.DocStore`)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.executor import Executor
from data_pipeline.files import atomic_save_npy, write_jsonl_atomic
from data_pipeline.stages.bookkeeping import StageRun, require_stage, stage_record, stage_tokenizer_spec, work_dir
from data_pipeline.store import (
    ShardCheck,
    ShardReader,
    done_shards,
    load_index,
    seal_shard,
    shard_counts,
    shard_name,
    verify_files,
    write_text_from,
)
from data_pipeline.words import WordIndex, encode_indexed
from megatron_ds_suite.core.tokenizer import load_tokenizer


def save_token_ids(folder: Path, k: int, flat: np.ndarray, lens: np.ndarray) -> dict[str, list[int]]:
    """Shard ``k``'s token ids, one row per stored document: ``docs-K.tok.npy`` (``flat``: concatenated, EOD
    not included) and ``docs-K.tokoff.npy`` (int64 offsets, len = documents + 1). Written before the shard's
    ``.done.json`` marker, so a finished shard always has them; returns their checksums (for the marker)."""
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    return {".tok.npy": atomic_save_npy(folder / f"{shard_name(k)}.tok.npy", flat),
            ".tokoff.npy": atomic_save_npy(folder / f"{shard_name(k)}.tokoff.npy", off)}


def token_ids_of_shard(folder: Path, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Shard ``k``'s token ids and offsets (:func:`save_token_ids`), checked against the shard's checksums, or
    ``None`` for a filter shard without token files (a cache: export then tokenizes again, with the same result)."""
    if not (folder / f"{shard_name(k)}.tokoff.npy").exists():
        return None
    check = ShardCheck()
    return (np.load(check.file(folder, k, ".tok.npy"), allow_pickle=False),
            np.load(check.file(folder, k, ".tokoff.npy"), allow_pickle=False))


_TOKENIZERS: dict[str, Any] = {}  # one per spec per worker process: its word cache lasts across shards


def cached_tokenizer(spec: dict[str, Any]) -> Any:
    """The tokenizer of ``spec``, loaded once per worker process (the filter's and the export's workers)."""
    key = json.dumps(spec, sort_keys=True)  # the spec holds the files' sha256: new files, new tokenizer
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


@dataclass(frozen=True)
class FilterJob:
    """What one filter worker does: ingest shard ``shard`` of ``src`` -> filter shard ``shard`` of ``dst``."""

    src: str
    dst: str
    shard: int
    spec: dict[str, Any]  # the tokenizer spec (cached_tokenizer)
    min_tokens: int  # length.min_tokens
    count_eod: bool  # length.count_eod
    batch: int  # dataset.tokenize_batch


def filter_shard(job: FilterJob) -> dict[str, Any]:
    """Worker: ingest shard ``k`` → the filter's shard ``k``: the index rows of the documents kept (their text
    stays in the ingest shard file, which the filter store reads through ``_text_from.json``), their token ids
    (export writes them: each document is tokenized once), their exact-dedup keys and the too-short rows."""
    src_s, dst_s, k, spec = job.src, job.dst, job.shard, job.spec
    min_tokens, count_eod, batch = job.min_tokens, job.count_eod, job.batch
    from data_pipeline.dedup.exact import text_key
    from megatron_ds_suite.core.indexed_dataset_builder import best_dtype

    src, dst = Path(src_s), Path(dst_s)
    tok = cached_tokenizer(spec)
    check = ShardCheck()  # every ingest file read here is checked against the shard's checksums first
    table = load_index(src, k, src, check)  # (input index, text offset, length, meta offset, length) per text
    for sfx in (".txt", ".meta.jsonl"):  # the filter is the first reader of the shard: all of it, even the texts
        check.file(src, k, sfx)           # the word ids stand for (one CRC-32 pass, ~1 GB/s)
    verify_files(src, k, [".wix.npz", ".wvocab.json", ".wvocab.txt", ".key.npy"], caches=True)
    index = WordIndex.load(src, k)
    words = getattr(tok, "word_cache", None)
    recs: list[dict[str, Any]] | None = None
    if index is not None and words is not None and index.split == words.split_name and len(index.raw_n) == len(table):
        with ShardReader(src, k, check) as reader:  # the ingest worker's words: one numpy gather
            flat, lens = encode_indexed(words, index, lambda d: reader.text(table[d]))  # declined texts
    else:  # another tokenizer (or an ingest without the index): encode the texts
        with ShardReader(src, k, check) as reader:
            recs = [reader.record(row) for row in table]
        parts = [tok.encode_flat([r["text"] for r in recs[s:s + batch]]) for s in range(0, len(recs), batch)]
        flat = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        lens = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    n = lens + (1 if count_eod else 0)
    keep = n >= min_tokens
    sums = save_token_ids(dst, k, flat[np.repeat(keep, lens)].astype(best_dtype(tok.vocab_size)), lens[keep])
    keys_file = src / f"{shard_name(k)}.key.npy"  # hashed by the ingest worker while it had the text
    if keys_file.exists():  # checked above
        keys = np.load(keys_file, allow_pickle=False)[keep]
    else:
        with ShardReader(src, k, check) as reader:
            keys = np.asarray([text_key(reader.text(row)) for row, ok in zip(table, keep.tolist()) if ok],
                              dtype=np.uint64).reshape(-1, 2)
    sums[".key.npy"] = atomic_save_npy(dst / f"{shard_name(k)}.key.npy", keys)
    short_rows, examples = [], []
    with ShardReader(src, k, check) as reader:
        for j in np.flatnonzero(~keep).tolist():  # only the too-short records' metadata is read back
            rec = recs[j] if recs is not None else reader.meta(table[j])
            short_rows.append({"i": rec["i"], "src": rec["src"], "reason": "too_short",
                               "detail": f"{int(n[j])} tokens < length.min_tokens={min_tokens}"})
            if len(examples) < 3:
                examples.append({"i": rec["i"], "src": rec["src"], "tokens": int(n[j])})
    write_jsonl_atomic(dst / f"{shard_name(k)}.too_short.jsonl", short_rows)  # for rejects.jsonl
    info = {"in": len(table), "kept": int(keep.sum()), "too_short": int((~keep).sum()), "tokens": int(n[keep].sum()),
            "examples": examples}
    sums[".idx.npy"] = atomic_save_npy(dst / f"{shard_name(k)}.idx.npy", table[keep])
    seal_shard(dst, k, info, sums, [".too_short.jsonl"])  # the shard's completion marker, last
    return info


def run_filter(cfg: BuildConfig, executor: Executor) -> dict[str, Any]:
    """Tokenize every document once, keep those of at least ``length.min_tokens`` tokens."""
    with StageRun(cfg, "filter") as stage:
        require_stage(cfg, "ingest")  # checks the ingest store holds the shards its stage wrote
        shards = stage_record(cfg, "ingest").get("shards", len(done_shards(work_dir(cfg, "ingest"))))  # type: ignore[union-attr]
        spec = stage_tokenizer_spec(cfg)
        src = work_dir(cfg, "ingest")
        dst = stage.begin()
        write_text_from(dst, src)  # the kept texts stay where ingest wrote them
        todo = [k for k in done_shards(src) if k not in set(done_shards(dst))]
        jobs = [FilterJob(str(src), str(dst), k, spec, cfg.length.min_tokens, cfg.length.count_eod,
                          cfg.dataset.tokenize_batch) for k in todo]
        bar = stage.progress(desc="filter: count tokens", unit="doc")
        for info in executor.imap_unordered(filter_shard, jobs):
            bar.update(info["in"])
        bar.close()
        tot: Counter[str] = Counter()
        examples: list[Any] = []
        for k in done_shards(dst):
            c = shard_counts(dst, k)
            tot.update({x: c[x] for x in ("in", "kept", "too_short", "tokens")})
            examples += c["examples"][: max(0, 5 - len(examples))]
        stats = stage.stats(tot["in"], kept=tot["kept"], too_short=tot["too_short"], tokens=tot["tokens"],
                             min_tokens=cfg.length.min_tokens, count_eod=cfg.length.count_eod,
                             tokenizer=require_stage(cfg, "tokenizer")["spec"], too_short_examples=examples)
        return stage.finish(stats, shards=shards, docs=tot["kept"])
