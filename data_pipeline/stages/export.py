"""Stage ``export``: kept documents, indexed datasets, rejects, duplicates, stats and manifest → ``<output_dir>/``."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.config import BuildConfig
from data_pipeline.doc_store import DocStore
from data_pipeline.executor import Executor
from data_pipeline.files import atomic_write_json, write_jsonl_atomic
from data_pipeline.overlap import contaminated_positions, load_eval_set
from data_pipeline.sentences import split_sentences
from data_pipeline.stages.bookkeeping import (
    StageRun,
    assemble_stats,
    open_store,
    reconcile,
    require_stage,
    stage_tokenizer_spec,
    work_dir,
)
from data_pipeline.stages.filter import cached_tokenizer, token_ids_of_shard
from data_pipeline.stages.tokenizer import load_stage_tokenizer
from data_pipeline.store import REBUILD, ShardCheck, ShardReader, StoreError, done_shards, load_index, shard_name
from megatron_ds_suite.core import atomic


def document_row(rec: dict[str, Any]) -> dict[str, Any]:
    """A ``documents.jsonl`` row. With the user's id (``id_field``): ``id`` is that id, unchanged, and
    ``source`` the provenance (``path:line``, ``path[row]``, ...); without one, ``id`` is the provenance."""
    if "uid" in rec:
        suffix = f"#{rec['uid']}"
        src = rec["src"][:-len(suffix)] if rec["src"].endswith(suffix) else rec["src"]
        return {"id": rec["uid"], "i": rec["i"], "source": src, "text": rec["text"]}
    return {"id": rec["src"], "i": rec["i"], "text": rec["text"]}


def _decontaminate(cfg: BuildConfig, store: DocStore, removed: np.ndarray) -> dict[int, list[str]]:
    """Store positions of documents kept by dedup (``removed``: bool per position) that share a
    ``decontaminate.ngram``-gram with an evaluation set → the sets' names; written to ``contaminated.jsonl``
    (always, empty when off)."""
    found: dict[int, list[str]] = {}
    if cfg.decontaminate.against:
        sets = [load_eval_set(name, cfg.resolve(p), cfg.decontaminate.ngram)
                for name, _, p in (x.partition("=") for x in cfg.decontaminate.against)]
        texts = store.iter_texts()
        found = {pos: names for pos, names in contaminated_positions(texts, sets, cfg.num_workers, cfg.progress)
                 if not removed[pos]}
    rows = []
    for pos in sorted(found):
        rec = store.meta(pos)
        rows.append({"id": document_row({**rec, "text": ""})["id"], "i": rec["i"], "sets": found[pos]})
    write_jsonl_atomic(cfg.out / "contaminated.jsonl", rows)
    return found


@dataclasses.dataclass(frozen=True, eq=False)
class ExportJob:
    """What one export worker does: the rows of filter shard ``shard`` (in ``folder``, texts in ``text_folder``)
    less those marked in ``drop`` -> their document lines and, with ``gpt``, token ids, with ``bert`` the token ids
    of their sentences. The worker reads the shard's index rows itself, so the driver holds one byte per
    document, not the rows of every shard."""

    folder: str
    text_folder: str
    shard: int
    drop: np.ndarray  # bool per row: removed by dedup or decontamination
    spec: dict[str, Any]  # the tokenizer spec (used only for a filter output without token files)
    gpt: bool  # dataset.gpt: also the ids, EOD appended
    eod: int
    dtype: str  # numpy dtype string of the indexed dataset
    bert: bool = False  # dataset.bert: also the sentences' ids (split_sentences, then the tokenizer)


@dataclasses.dataclass(frozen=True, eq=False)
class ExportPiece:
    """What one export worker returns for its shard (in input order)."""

    lines: bytes  # the documents.jsonl lines of the kept documents
    ids: np.ndarray  # gpt: their ids, EOD after each, concatenated
    sizes: np.ndarray  # the kept documents' sizes (ids + EOD; zeros without gpt): one per kept document
    read: int  # documents read (kept or not)
    sentence_ids: np.ndarray  # bert: the ids of every non-empty sentence, concatenated
    sentence_sizes: np.ndarray  # bert: each sentence's number of ids
    sentences_per_doc: np.ndarray  # bert: each kept document's number of sentences


def bert_sentences(tok: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The BERT items of ``texts``: (ids of every sentence that has any, concatenated; each one's size; each
    text's number of such sentences). Sentences by :func:`data_pipeline.sentences.split_sentences`, ids by
    ``tok.encode_batch`` (one call for the whole shard)."""
    sents = [split_sentences(t) for t in texts]
    ids = tok.encode_batch([x for ss in sents for x in ss])
    sizes = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    nonempty = sizes > 0
    bounds = np.zeros(len(sents) + 1, dtype=np.int64)
    np.cumsum([len(ss) for ss in sents], out=bounds[1:])
    per_doc = np.add.reduceat(np.append(nonempty.astype(np.int64), 0), bounds[:-1])  # the 0: room for a last empty
    per_doc[bounds[:-1] == bounds[1:]] = 0  # reduceat gives the next element for an empty range
    flat = np.fromiter((i for x in ids for i in x), dtype=np.int64, count=int(sizes.sum()))
    return flat, sizes[nonempty], per_doc


def _export_shard(job: ExportJob) -> ExportPiece:
    """Worker: filter shard ``k``'s documents not in ``drop`` (dedup's and decontamination's) → their
    ``documents.jsonl`` lines, with ``gpt`` their ids with EOD appended, concatenated, and each one's size
    (the filter's ids: each document is tokenized once per build; tokenized here only for a filter output
    older than its token files), with ``bert`` their sentences' ids (:func:`bert_sentences`)."""
    folder_s, text_folder, k, drop = job.folder, job.text_folder, job.shard, job.drop
    spec, gpt, eod, dtype = job.spec, job.gpt, job.eod, job.dtype
    folder = Path(folder_s)
    check = ShardCheck()  # the filter's and the ingest's files of the shard, each checked against its checksum
    rows = load_index(folder, k, Path(text_folder), check)
    keep = ~drop
    if len(keep) != len(rows):
        raise StoreError(f"{folder}: shard {k} holds {len(rows)} documents, the stage expected {len(keep)}: "
                         f"{REBUILD}")
    lines, texts = [], []
    with ShardReader(Path(text_folder), k, check) as reader:
        for row in rows[keep]:
            rec = reader.record(row)
            lines.append(json.dumps(document_row(rec), ensure_ascii=False))
            texts.append(rec["text"])
    text = ("\n".join(lines) + "\n").encode("utf-8") if lines else b""
    none = np.zeros(0, np.int64)
    bert = bert_sentences(cached_tokenizer(spec), texts) if job.bert else (none, none, none)
    if not gpt:
        return ExportPiece(text, none, np.zeros(len(lines), np.int64), len(keep), *bert)
    saved = token_ids_of_shard(folder, k)
    if saved is not None:
        flat, off = saved
        lens = np.diff(off)[keep]
        ids = flat[np.repeat(keep, np.diff(off))]
    else:
        ids, lens = cached_tokenizer(spec).encode_flat(texts)
    # EOD after each document: inserted at each document's end
    return ExportPiece(text, np.insert(ids.astype(dtype, copy=False), np.cumsum(lens), eod), lens + 1, len(keep),
                       *bert)


def run_export(cfg: BuildConfig, executor: Executor) -> dict[str, Any]:  # noqa: C901
    """Write the kept documents, indexed datasets, rejects, duplicates, ``stats.json`` and the manifest."""
    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype
    with StageRun(cfg, "export") as stage:
        ing = require_stage(cfg, "ingest")
        require_stage(cfg, "tokenizer")
        spec = stage_tokenizer_spec(cfg)
        flt = require_stage(cfg, "filter")
        ded = require_stage(cfg, "dedup")
        open_store(cfg, "filter").close()  # whole, before any work
        stage.begin()
        out = cfg.out
        tok = load_stage_tokenizer(cfg)
        store = DocStore(work_dir(cfg, "filter"))
        drop = np.zeros(len(store), dtype=bool)  # removed by dedup, then also by decontamination
        drop[np.load(work_dir(cfg, "dedup") / "removed.npy")] = True
        contaminated = _decontaminate(cfg, store, drop)
        drop[np.fromiter(contaminated, dtype=np.int64, count=len(contaminated))] = True
        dtype = best_dtype(tok.vocab_size)
        gpt = MMapIndexedDatasetBuilder(out / cfg.dataset.gpt_prefix, dtype) if cfg.dataset.gpt else None
        bert = MMapIndexedDatasetBuilder(out / cfg.dataset.bert_prefix, dtype) if cfg.dataset.bert else None
        kept = tokens = sentences = 0
        bar = stage.progress(total=len(store), desc="export: write", unit="doc")
        bounds = store.starts
        jobs = [ExportJob(str(store.folder), str(store.text_folder), k, drop[bounds[n]:bounds[n + 1]],
                          spec, cfg.dataset.gpt, tok.eod, np.dtype(dtype).str, cfg.dataset.bert)
                for n, k in enumerate(store.shards)]
        try:
            with atomic.atomic_open(out / "documents.jsonl", "wb") as f:  # published only when every shard is written
                # shards in order (imap keeps it): documents.jsonl and the .bin are the kept documents in input order
                for piece in executor.imap(_export_shard, jobs):
                    f.write(piece.lines)
                    kept += len(piece.sizes)
                    if gpt is not None:
                        gpt.add_documents(piece.ids, piece.sizes)
                        tokens += len(piece.ids)
                    if bert is not None:  # one item per sentence, split and tokenized by the worker
                        bert.add_item_documents(piece.sentence_ids, piece.sentence_sizes, piece.sentences_per_doc)
                        sentences += len(piece.sentence_sizes)
                        if gpt is None:
                            tokens += len(piece.sentence_ids)
                    bar.update(piece.read)
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
                if short.is_file():
                    ShardCheck().file(filter_dir, k, ".too_short.jsonl")
                with open(ShardCheck().file(ingest_dir, k, ".rejects.jsonl"), "rb") as r:
                    if not short.is_file():  # a filter stage finished before too-short rows were listed
                        shutil.copyfileobj(r, f)
                        continue
                    # malformed (ingest) and too-short (filter) records of one shard, in input order
                    rows = [json.loads(x) for x in r] + [json.loads(x) for x in open(short, "rb")]
                for row in sorted(rows, key=lambda x: x["i"]):
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        atomic.copy_file(work_dir(cfg, "dedup") / "duplicates.jsonl", out / "duplicates.jsonl")

        exp = stage.stats(len(store), kept=kept, tokens=tokens, sentences=sentences, contaminated=len(contaminated),
                           decontaminate={"ngram": cfg.decontaminate.ngram, "against": cfg.decontaminate.against}
                           if cfg.decontaminate.against else None)
        reconcile({"read": ing["read"], "malformed": ing["rejected"], "too_short": flt["too_short"],
                   "duplicates": ded["removed"], "contaminated": len(contaminated), "kept": kept})  # before "done"
        stage.finish(exp)
        stats = assemble_stats(cfg)
        atomic_write_json(out / "stats.json", stats)
        write_manifest(out, spec, cfg.dataset.gpt_prefix if gpt else None,
                       cfg.dataset.bert_prefix if bert else None,
                       extra={"documents": stats["documents"], "tokens": stats["tokens"],
                              "length_filter": stats["length_filter"], "dedup": stats["dedup"],
                              "sources": [dataclasses.asdict(s) for s in cfg.sources]})
        del ing, flt, ded
        return exp
