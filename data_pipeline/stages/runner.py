"""Build orchestration: run one stage, or every stage not finished for this config.

A build or a stage holds the output folder's lock (``output_dir/.lock``,
:mod:`megatron_ds_suite.core.folder_lock`, the one training runs take) from before its first stage until it
ends: a second build into the same folder is refused in one line instead of wiping the first one's work."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from data_pipeline.config import BuildConfig, ConfigError
from data_pipeline.executor import executor_for
from data_pipeline.files import atomic_write_json
from data_pipeline.report import peak_rss_mib
from data_pipeline.stages.bookkeeping import STAGES, assemble_stats, is_done
from data_pipeline.stages.dedup import run_dedup
from data_pipeline.stages.export import run_export
from data_pipeline.stages.filter import run_filter
from data_pipeline.stages.ingest import run_ingest
from data_pipeline.stages.tokenizer import run_tokenizer
from data_pipeline.workers import reading_work_files
from megatron_ds_suite.core.folder_lock import folder_lock

log = logging.getLogger(__name__)


RUNNERS = {"ingest": run_ingest, "tokenizer": run_tokenizer, "filter": run_filter, "dedup": run_dedup,
           "export": run_export}


def run_stage(cfg: BuildConfig, stage: str) -> dict[str, Any]:
    """Run one stage now (recomputing it); its upstream stages must be finished for this config."""
    if stage not in RUNNERS:
        raise ConfigError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    with executor_for(cfg) as executor, output_lock(cfg), reading_work_files(stage):
        return RUNNERS[stage](cfg, executor)


def output_lock(cfg: BuildConfig) -> Any:
    """The output folder's lock (created with the folder), held for a ``with`` block."""
    return folder_lock(cfg.out, "output_dir", "corpus build")


def build(cfg: BuildConfig, force: bool = False) -> tuple[Path, dict[str, Any]]:
    """Run every stage that is not finished for this config (all of them with ``force``)."""
    # the executor, chosen here once and handed to every stage: a Ray cluster is reached before any work, the
    # local fork pool is forked once for every stage (data_pipeline.workers)
    with executor_for(cfg) as executor, output_lock(cfg):
        reused: set[str] = set()
        t0 = time.perf_counter()
        for stage in STAGES:
            if not force and is_done(cfg, stage) and not (stage == "export" and not (cfg.out / "stats.json").exists()):
                log.info("stage %s: finished earlier with the same inputs and settings, reused", stage)
                reused.add(stage)
                continue
            with reading_work_files(stage):
                RUNNERS[stage](cfg, executor)
        stats = assemble_stats(cfg, reused)
        stats["total_seconds"] = round(time.perf_counter() - t0, 3)
        stats["peak_rss_now_mib"] = peak_rss_mib()[0]
        atomic_write_json(cfg.out / "stats.json", stats)
        return cfg.out, stats
