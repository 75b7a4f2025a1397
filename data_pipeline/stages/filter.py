"""Stage ``filter``: count tokens per document, drop those under ``length.min_tokens`` → ``work/filter/``."""
from __future__ import annotations

import json
from collections import Counter
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.report import StageTimer
from data_pipeline.words import WordIndex, encode_indexed
from data_pipeline.stages.bookkeeping import begin_stage, finish_stage, progress_bar, require_stage, work_dir
from data_pipeline.store import (ShardWriter, atomic_save_npy, done_shards, iter_shard, shard_counts,
                                 shard_name, write_jsonl_atomic)


def _uid_extra(rec: dict[str, Any]) -> dict[str, Any]:
    """The user's id of a store record (``id_field``), carried from ingest to export when there is one."""
    return {"uid": rec["uid"]} if "uid" in rec else {}


def save_token_ids(folder: Path, k: int, ids: list[np.ndarray], dtype: Any) -> None:
    """Shard ``k``'s token ids, one row per stored document: ``docs-K.tok.npy`` (concatenated, EOD not
    included) and ``docs-K.tokoff.npy`` (int64 offsets, len = documents + 1). Written before the shard's
    ``.done.json`` marker, so a finished shard always has them."""
    off = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=off[1:])
    flat = np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype=dtype)
    atomic_save_npy(folder / f"{shard_name(k)}.tok.npy", flat)
    atomic_save_npy(folder / f"{shard_name(k)}.tokoff.npy", off)


def token_ids_of_shard(folder: Path, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Shard ``k``'s token ids and offsets (:func:`save_token_ids`), or ``None`` for a filter output that
    predates the token files (export then tokenizes again, with the same result)."""
    off = folder / f"{shard_name(k)}.tokoff.npy"
    if not off.exists():
        return None
    return np.load(folder / f"{shard_name(k)}.tok.npy"), np.load(off)


_TOKENIZERS: dict[str, Any] = {}  # one per spec per worker process: its word cache lasts across shards


def _tokenizer(spec: dict[str, Any]) -> Any:
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    key = json.dumps(spec, sort_keys=True)  # the spec holds the files' sha256: new files, new tokenizer
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


def _filter_shard(args: tuple[str, str, int, dict[str, Any], int, bool, int]) -> dict[str, Any]:
    src_s, dst_s, k, spec, min_tokens, count_eod, batch = args
    from data_pipeline.dedup.exact import text_key
    from megatron_ds_suite.core.indexed_dataset import best_dtype

    tok = _tokenizer(spec)
    writer = ShardWriter(Path(dst_s), k)
    too_short, kept, tokens = 0, 0, 0
    kept_ids: list[np.ndarray] = []  # the kept documents' token ids, reused by export (tokenized once)
    keys: list[np.ndarray] = []  # exact-dedup keys of the kept documents (hashed while the text is at hand)
    dtype = best_dtype(tok.vocab_size)
    examples, short_rows = [], []
    try:
        recs = list(iter_shard(Path(src_s), k))
        index = WordIndex.load(Path(src_s), k) if getattr(tok, "word_cache", None) is not None \
            and tok.word_cache.mode == "identity" else None
        if index is not None and len(index.raw_n) != len(recs):
            index = None  # not this shard's texts (cannot happen short of a hand-edited folder): encode them
        # the ingest worker's word ids when it cut the texts (the same ids: one numpy gather), else the texts
        for part in [recs] if index is not None else [recs[s:s + batch] for s in range(0, len(recs), batch)]:
            flat, lens = encode_indexed(tok.word_cache, index) if index is not None \
                else tok.encode_flat([r["text"] for r in part])
            ends = np.cumsum(lens).tolist()
            for rec, end, m in zip(part, ends, lens.tolist()):
                ids = flat[end - m:end]
                n = m + (1 if count_eod else 0)
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
    """Tokenize every document once, keep those of at least ``length.min_tokens`` tokens."""
    timer = StageTimer("filter")
    require_stage(cfg, "ingest")
    spec = require_stage(cfg, "tokenizer")["spec"]
    src = work_dir(cfg, "ingest")
    dst = begin_stage(cfg, "filter")
    todo = [k for k in done_shards(src) if k not in set(done_shards(dst))]
    jobs = [(str(src), str(dst), k, spec, cfg.length.min_tokens, cfg.length.count_eod,
             cfg.dataset.tokenize_batch) for k in todo]
    bar = progress_bar(cfg, desc="filter: count tokens", unit="doc")
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
    return finish_stage(cfg, "filter", stats)
