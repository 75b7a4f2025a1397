"""The five stages of a corpus build (one module each), their bookkeeping and the build runner.

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

from data_pipeline.report import summary_table
from data_pipeline.stages.bookkeeping import (
                                              STAGES,
                                              StageError,
                                              assemble_stats,
                                              begin_stage,
                                              digest,
                                              fingerprint,
                                              finish_stage,
                                              is_done,
                                              progress_bar,
                                              require_stage,
                                              stage_record,
                                              work_dir,
)
from data_pipeline.stages.dedup import dedup_specs, run_dedup
from data_pipeline.stages.export import document_row, run_export
from data_pipeline.stages.filter import run_filter, save_token_ids
from data_pipeline.stages.ingest import run_ingest
from data_pipeline.stages.runner import RUNNERS, build, run_stage
from data_pipeline.stages.tokenizer import load_stage_tokenizer, run_tokenizer

__all__ = ["RUNNERS", "STAGES", "StageError", "assemble_stats", "begin_stage", "build", "dedup_specs",
           "digest", "document_row", "finish_stage", "fingerprint", "is_done", "load_stage_tokenizer",
           "progress_bar", "require_stage", "run_dedup", "run_export", "run_filter", "run_ingest", "run_stage",
           "run_tokenizer", "save_token_ids", "stage_record", "summary_table", "work_dir"]
