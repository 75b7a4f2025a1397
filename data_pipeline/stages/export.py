"""Stage ``export``: kept documents, indexed datasets, rejects, duplicates, stats and manifest → ``<output_dir>/``."""
from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.report import StageTimer
from data_pipeline.stages.bookkeeping import (assemble_stats, begin_stage, finish_stage, progress_bar, require_stage,
                                              work_dir)
from data_pipeline.stages.filter import TokenIds
from data_pipeline.stages.tokenizer import load_stage_tokenizer
from data_pipeline.store import DocStore, atomic_write_json, done_shards, shard_name, write_jsonl_atomic
from megatron_ds_suite.core import atomic


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
    """Write the kept documents, indexed datasets, rejects, duplicates, ``stats.json`` and the manifest."""
    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
    from data_pipeline.sentences import split_sentences

    timer = StageTimer("export")
    ing = require_stage(cfg, "ingest")
    tok_stats = require_stage(cfg, "tokenizer")
    flt = require_stage(cfg, "filter")
    ded = require_stage(cfg, "dedup")
    begin_stage(cfg, "export")
    out = cfg.out
    tok = load_stage_tokenizer(cfg)
    store = DocStore(work_dir(cfg, "filter"))
    removed = set(np.load(work_dir(cfg, "dedup") / "removed.npy").tolist())
    contaminated = _decontaminate(cfg, store, removed)
    dtype = best_dtype(tok.vocab_size)
    gpt = MMapIndexedDatasetBuilder(out / cfg.dataset.gpt_prefix, dtype) if cfg.dataset.gpt else None
    bert = MMapIndexedDatasetBuilder(out / cfg.dataset.bert_prefix, dtype) if cfg.dataset.bert else None
    kept = tokens = sentences = 0
    batch: list[dict[str, Any]] = []
    batch_pos: list[int] = []
    bar = progress_bar(cfg, total=len(store), desc="export: tokenize+write", unit="doc")

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
        with atomic.atomic_open(out / "documents.jsonl", "w") as f:  # published only when every batch is written
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
    finally:
        bar.close()
    # rejects (all of them, in input order) and the duplicates report
    ingest_dir = work_dir(cfg, "ingest")
    filter_dir = work_dir(cfg, "filter")
    with atomic.atomic_open(out / "rejects.jsonl", "wb") as f:
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
    atomic.copy_file(work_dir(cfg, "dedup") / "duplicates.jsonl", out / "duplicates.jsonl")

    exp = timer.finish(len(store), kept=kept, tokens=tokens, sentences=sentences, contaminated=len(contaminated),
                       decontaminate={"ngram": cfg.decontaminate.ngram, "against": cfg.decontaminate.against}
                       if cfg.decontaminate.against else None)
    finish_stage(cfg, "export", exp)
    stats = assemble_stats(cfg)
    atomic_write_json(out / "stats.json", stats)
    write_manifest(out, tok_stats["spec"], cfg.dataset.gpt_prefix if gpt else None,
                   cfg.dataset.bert_prefix if bert else None,
                   extra={"documents": stats["documents"], "tokens": stats["tokens"],
                          "length_filter": stats["length_filter"], "dedup": stats["dedup"],
                          "sources": [dataclasses.asdict(s) for s in cfg.sources]})
    del ing, flt, ded
    return exp
