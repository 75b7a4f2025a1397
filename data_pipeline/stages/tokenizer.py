"""Stage ``tokenizer``: train sentencepiece on the cleaned documents, or load the given tokenizer files."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from data_pipeline.config import BuildConfig
from data_pipeline.doc_store import DocStore
from data_pipeline.executor import Executor
from data_pipeline.stages.bookkeeping import StageRun, open_store, record_spec, stage_tokenizer_spec
from data_pipeline.stages.ingest import WORD_COUNT_FILES, read_word_counts, trains_on_word_counts
from data_pipeline.store import shard_texts, verify_files
from data_pipeline.tokenizer_train import MAX_SENTENCES, WordCounts, count_training_words, train_sentencepiece
from megatron_ds_suite.core.corpus import copy_tokenizer_files
from megatron_ds_suite.core.hf_tokenizers import HFTokenizer, WordPieceTokenizer
from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, load_tokenizer


def run_tokenizer(cfg: BuildConfig, executor: Executor) -> dict[str, Any]:
    """Train or load the tokenizer (on the driver: one training; ``executor`` unused); its spec goes in the
    stage's stats."""
    with StageRun(cfg, "tokenizer") as stage:
        t = cfg.tokenizer
        stage.begin()
        tok_dir = cfg.out / "tokenizer"
        n_docs = 0
        if t.type == "sentencepiece":
            store = open_store(cfg, "ingest")

            def texts() -> Iterator[str]:
                nonlocal n_docs
                for text in store.iter_texts():
                    if n_docs >= t.train_max_docs:
                        return
                    n_docs += 1
                    yield text

            counts = training_word_counts(cfg, store) if trains_on_word_counts(cfg) else None
            if counts is not None:  # trained from the ingest workers' word counts; the texts are not read
                n_docs = counts.docs
            tok = train_sentencepiece(texts() if counts is None else (), tok_dir / f"spm_{t.flavor}_{t.vocab_size}", t.vocab_size,
                                      flavor=t.flavor, seed=cfg.seed, num_threads=t.num_threads,  # type: ignore[arg-type]
                                      word_counts=counts)
            spec = tok.spec()
        elif t.type == "sentencepiece_model":
            spec = copy_tokenizer_files(SentencePieceTokenizer(cfg.resolve(t.model_file or "")).spec(), cfg.out)
        elif t.type in ("wordpiece", "hf"):  # a BERT vocab.txt / a tokenizer.json users already have
            tok = (WordPieceTokenizer(cfg.resolve(t.vocab_file or ""), t.lowercase) if t.type == "wordpiece"
                   else HFTokenizer(cfg.resolve(t.model_file or "")))
            spec = copy_tokenizer_files(tok.spec(), cfg.out)
        else:
            spec = copy_tokenizer_files(GPT2BPETokenizer(cfg.resolve(t.vocab_file or ""),
                                                         cfg.resolve(t.merges_file or "")).spec(), cfg.out)
        return stage.finish(stage.stats(n_docs, spec=record_spec(cfg, spec), trained_on_docs=n_docs))


def training_word_counts(cfg: BuildConfig, store: DocStore) -> WordCounts | None:
    """The training words of the first ``tokenizer.train_max_docs`` clean documents (at most 1,000,000
    sentences), counted: the ingest workers' per-shard counts for every shard wholly inside those limits, a
    count of the texts for the shard where they stop (or for a shard without counts, e.g. one ingested
    before counting existed). ``None`` when some text cannot be given as counts (a tab or a literal
    U+2581; see :func:`count_training_words`): train on the sentences then."""
    total = WordCounts()
    max_docs, max_lines = cfg.tokenizer.train_max_docs, MAX_SENTENCES
    for k in store.shards:
        if total.docs >= max_docs or total.lines >= max_lines:
            break
        verify_files(store.folder, k, WORD_COUNT_FILES, caches=True)  # checked against the shard's checksums
        found, part = read_word_counts(store.folder, k)
        if found and part is None:
            return None  # the ingest worker found a sentence that cannot be counted
        if part is None or total.docs + part.docs > max_docs or total.lines + part.lines >= max_lines:
            part = count_training_words(shard_texts(store.folder, k),
                                        max_docs=max_docs - total.docs, max_lines=max_lines - total.lines)
            if part is None:
                return None
        total.merge(part)
    return total


def load_stage_tokenizer(cfg: BuildConfig) -> Any:
    return load_tokenizer(stage_tokenizer_spec(cfg))
