"""Stage ``ingest``: read every source, reject malformed records, clean (ftfy + whitespace) → ``work/ingest/``."""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.clean import clean_text
from data_pipeline.config import BuildConfig
from data_pipeline.dedup.exact import text_key
from data_pipeline.executor import Executor
from data_pipeline.files import atomic_save_npy, read_word_list, write_jsonl_atomic, write_word_list
from data_pipeline.sources import REJECT_REASONS, RawRecord, check_sources, iter_records
from data_pipeline.stages.bookkeeping import StageError, StageRun
from data_pipeline.store import ShardWriter, done_shards, shard_counts, shard_name
from data_pipeline.tokenizer_train import WordCounts
from data_pipeline.words import GPT2_WHITESPACE, SPM_IDENTITY, WordIndex, training_counts
from megatron_ds_suite.core import atomic

log = logging.getLogger(__name__)


#: suffixes of the side files an ingest shard may have besides its texts, metadata and index (their checksums go in
#: the shard's completion marker)
WORD_INDEX_FILES = (".wix.npz", ".wvocab.json", ".wvocab.txt")
WORD_COUNT_FILES = (".words.json", ".words.txt", ".words.npy")
SIDE_FILES = (".rejects.jsonl", ".key.npy", *WORD_INDEX_FILES, *WORD_COUNT_FILES)


def word_counts_path(folder: Path, k: int) -> Path:
    """Shard ``k``'s training-word counts (:func:`data_pipeline.words.training_counts` of its clean texts,
    ``"words": null`` when they cannot be counted), read by the tokenizer stage (:func:`read_word_counts`)."""
    return folder / f"{shard_name(k)}.words.json"


def write_word_counts(folder: Path, k: int, wc: WordCounts | None) -> None:
    """Shard ``k``'s counts: the header ``docs-K.words.json`` (docs, lines, number of words; written last), the
    words ``\\n``-joined in ``docs-K.words.txt`` and their counts in ``docs-K.words.npy``, in the counter's
    order: a join and an array instead of a JSON object of ~50,000 keys per shard (encoding that object was
    ~4 % of a build). Training words never hold a line break (lines are cut there); should one, the counts
    go inline as a JSON object, the older form, which :func:`read_word_counts` reads too."""
    header = word_counts_path(folder, k)
    if wc is None:
        atomic.write_text(header, json.dumps({"words": None}))
    elif not write_word_list(folder / f"{shard_name(k)}.words.txt", wc.words, "\n"):
        atomic.write_text(header, json.dumps(wc.to_json(), ensure_ascii=False))
    else:
        atomic_save_npy(folder / f"{shard_name(k)}.words.npy",
                        np.fromiter(wc.words.values(), dtype=np.int64, count=len(wc.words)))
        atomic.write_text(header, json.dumps({"docs": wc.docs, "lines": wc.lines, "word_list": len(wc.words)}))


def read_word_counts(folder: Path, k: int) -> tuple[bool, WordCounts | None]:
    """(whether shard ``k`` has counts, the counts or ``None`` when its texts cannot be given as counts)."""
    header = word_counts_path(folder, k)
    if not header.is_file():
        return False, None
    saved = json.loads(header.read_text("utf-8"))
    if "word_list" not in saved:
        return True, WordCounts.from_json(saved) if saved["words"] is not None else None
    n = int(saved["word_list"])
    words = read_word_list(folder / f"{shard_name(k)}.words.txt", n, "\n")
    counts = np.load(folder / f"{shard_name(k)}.words.npy", allow_pickle=False).tolist()
    if len(counts) != n:
        raise ValueError(f"{header}: {n} words announced, {len(counts)} counts found")
    return True, WordCounts(Counter(dict(zip(words, counts))), int(saved["docs"]), int(saved["lines"]))


@dataclass(frozen=True)
class IngestJob:
    """What one ingest worker does: clean ``records`` (input indices from ``first``) into shard ``shard`` of
    ``folder``."""

    folder: str
    shard: int
    records: list[RawRecord]
    first: int  # input index of records[0]
    ftfy: bool  # clean.ftfy
    normalize_whitespace: bool  # clean.normalize_whitespace
    split: str | None  # the tokenizer's word split (index_split): cut the texts into words once; None: do not
    count_words: bool  # write the shard's training-word counts (word_counts_path)


def ingest_shard(job: IngestJob) -> dict[str, Any]:
    """Worker: one input shard's records -> ingest shard ``k`` (cleaned documents, rejects, exact-dedup keys, word counts)."""
    folder_s, k, records, first = job.folder, job.shard, job.records, job.first
    use_ftfy, ws, split, count_words = job.ftfy, job.normalize_whitespace, job.split, job.count_words
    folder = Path(folder_s)
    writer = ShardWriter(folder, k)
    counts: Counter[str] = Counter()
    rejects = []
    texts = []
    keys = []
    try:
        for n, rec in enumerate(records):
            i = first + n
            rec = rec.resolve()  # a jsonl line is parsed here, in the worker
            if rec.text is not None:
                text = clean_text(rec.text, use_ftfy, ws)
                if text:
                    writer.add(i, rec.src, text, **_uid_of(rec))
                    counts["clean"] += 1
                    keys.append(text_key(text))
                    if split is not None:
                        texts.append(text)
                    continue
                rec = RawRecord(rec.src, None, "empty", "no text left after cleaning: " + repr(rec.text[:100]))
            counts[rec.reason or "unknown"] += 1
            rejects.append({"i": i, "src": rec.src, "reason": rec.reason, "detail": rec.detail})
        write_jsonl_atomic(folder / f"{shard_name(k)}.rejects.jsonl", rejects)
        atomic_save_npy(folder / f"{shard_name(k)}.key.npy",  # exact-dedup keys, hashed while the text is at hand
                        np.stack(keys) if keys else np.zeros((0, 2), np.uint64))
        if split is not None:  # cut once into words: the filter's ids (and the tokenizer's counts) come from it
            index = WordIndex.build(texts, split)
            index.save(folder, k)
        if split is not None and count_words:  # one line of JSON: the C encoder (indent takes the Python one)
            write_word_counts(folder, k, training_counts(index, texts, normalized=ws))  # ws: normalize_whitespace's
        info = {"read": len(records), "first": first, "clean": counts.pop("clean", 0), "rejected": dict(counts)}
        writer.commit(info, [s for s in SIDE_FILES if (folder / f"{shard_name(k)}{s}").is_file()])
        return info
    except BaseException:
        writer.abort()
        raise


def trains_on_word_counts(cfg: BuildConfig) -> bool:
    """Whether the tokenizer stage trains SentencePiece from word counts (the ``gpt`` flavour's BPE)."""
    return cfg.tokenizer.type == "sentencepiece" and cfg.tokenizer.flavor == "gpt"


def index_split(cfg: BuildConfig) -> str | None:
    """The word split of the config's tokenizer when the ingest workers can cut texts with it
    (:mod:`data_pipeline.words`), else ``None``."""
    if trains_on_word_counts(cfg):
        return SPM_IDENTITY
    return GPT2_WHITESPACE if cfg.tokenizer.type == "gpt2" else None


def _uid_of(rec: RawRecord) -> dict[str, Any]:
    """``{"uid": id}`` for a record with a user id (JSON scalars kept as they are, anything else as str)."""
    if rec.uid is None:
        return {}
    return {"uid": rec.uid if isinstance(rec.uid, (str, int, float, bool)) else str(rec.uid)}


class _Shards:
    """The input records in shards of ``size`` (shard number, input index of its first record, records);
    ``count``: how many it has yielded (the stage records it: :func:`finish_stage`)."""

    def __init__(self, records: Iterator[RawRecord], size: int):
        self.records, self.size, self.count = records, size, 0

    def __iter__(self) -> Iterator[tuple[int, int, list[RawRecord]]]:
        buf: list[RawRecord] = []
        for rec in self.records:
            buf.append(rec)
            if len(buf) == self.size:
                yield self._next(buf)
                buf = []
        if buf:
            yield self._next(buf)

    def _next(self, buf: list[RawRecord]) -> tuple[int, int, list[RawRecord]]:
        k = self.count
        self.count += 1
        return k, k * self.size, buf


def run_ingest(cfg: BuildConfig, executor: Executor) -> dict[str, Any]:
    """Read and clean every source into shards (finished shards are kept on resume)."""
    with StageRun(cfg, "ingest") as stage:
        check_sources(cfg)  # an hf source that cannot be loaded: one line before any shard is written
        folder = stage.begin()
        done = set(done_shards(folder))
        if done:
            log.info("ingest: resuming, %d shard(s) already finished", len(done))
        split = index_split(cfg)
        count_words = trains_on_word_counts(cfg)  # shards that may hold training documents count their words
        bar = stage.progress(desc="ingest: read+clean", unit="doc")

        def jobs() -> Iterator[IngestJob]:  # read lazily: at most ~2 shards per worker in flight
            for k, first, recs in shards:
                if k in done:
                    bar.update(len(recs))
                    continue
                yield IngestJob(str(folder), k, recs, first, cfg.clean.ftfy, cfg.clean.normalize_whitespace, split,
                                count_words and first < cfg.tokenizer.train_max_docs)

        shards = _Shards(iter_records(cfg, lazy=True), cfg.shard_size)
        try:
            for info in executor.imap_unordered(ingest_shard, jobs()):
                bar.update(info["read"])
        finally:
            bar.close()
        read = clean = 0
        by_reason: Counter[str] = Counter()
        for k in done_shards(folder):
            c = shard_counts(folder, k)
            read += c["read"]
            clean += c["clean"]
            by_reason.update(c["rejected"])
        stats = stage.stats(read, read=read, clean=clean, rejected=sum(by_reason.values()),
                             rejected_by_reason={r: by_reason.get(r, 0) for r in REJECT_REASONS})
        if clean == 0:
            raise StageError(f"no usable document in the inputs ({read} records read, all rejected: "
                             f"{dict(by_reason)}); see {folder}/*.rejects.jsonl")
        return stage.finish(stats, shards=shards.count, docs=clean)
