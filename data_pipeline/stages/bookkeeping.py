"""Stage bookkeeping: fingerprints, ``work/<stage>/_stage.json`` markers, resume and the build's stats.

Each stage records ``work/<stage>/_stage.json`` = {fingerprint, status, stats}. The fingerprint hashes
the config keys that change the stage's result together with the upstream fingerprint, so ``build``
skips a finished stage whose inputs did not change and recomputes everything downstream of a change.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from data_pipeline.config import BuildConfig
from data_pipeline.sources import input_fingerprint
from data_pipeline.store import STORE_FORMAT, atomic_write_json, read_json, reset_dir
from megatron_ds_suite.core.errors import SuiteError

log = logging.getLogger(__name__)


STAGES = ("ingest", "tokenizer", "filter", "dedup", "export")


class StageError(SuiteError):
    """A stage cannot run (e.g. its upstream stage has not finished); one line."""


# ------------------------------------------------------------------------------------------ bookkeeping
def digest(obj: Any) -> str:
    """16 hex digits of the SHA-256 of ``obj`` as sorted-key JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def work_dir(cfg: BuildConfig, stage: str) -> Path:
    """``<output_dir>/work/<stage>``."""
    return cfg.out / "work" / stage


def _dedup_result_keys(cfg: BuildConfig) -> dict[str, Any]:
    """``dedup.*`` settings that change the result."""
    d = dataclasses.asdict(cfg.dedup)
    for k in ("chunk_size", "verify_block_docs", "sharded"):
        d.pop(k, None)
    return d


def fingerprint(cfg: BuildConfig, stage: str) -> str:
    """Hash of everything that determines a stage's output."""
    if stage == "ingest":
        return digest(["ingest", [dataclasses.asdict(s) for s in cfg.sources], input_fingerprint(cfg),
                        dataclasses.asdict(cfg.clean), cfg.shard_size, STORE_FORMAT])
    if stage == "tokenizer":
        t = dataclasses.asdict(cfg.tokenizer)
        if cfg.tokenizer.type != "sentencepiece":
            t = {k: t[k] for k in ("type", "model_file", "vocab_file", "merges_file")
                 + (("lowercase",) if cfg.tokenizer.type == "wordpiece" else ())}
            return digest(["tokenizer", t, _file_stats(cfg)])
        return digest(["tokenizer", fingerprint(cfg, "ingest"), t, cfg.seed])
    if stage == "filter":
        return digest(["filter", fingerprint(cfg, "ingest"), fingerprint(cfg, "tokenizer"),
                        dataclasses.asdict(cfg.length)])
    if stage == "dedup":
        return digest(["dedup", fingerprint(cfg, "filter"), _dedup_result_keys(cfg)])
    if stage == "export":
        parts = ["export", fingerprint(cfg, "dedup"), dataclasses.asdict(cfg.dataset)]
        if cfg.decontaminate.against:  # unchanged fingerprint when decontamination is off
            parts.append([cfg.decontaminate.ngram, _decontam_files(cfg)])
        return digest(parts)
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
    """The stage's ``_stage.json``, or None before it started."""
    p = work_dir(cfg, stage) / "_stage.json"
    return read_json(p) if p.exists() else None


def is_done(cfg: BuildConfig, stage: str) -> bool:
    """Finished, with the fingerprint of this config."""
    rec = stage_record(cfg, stage)
    return bool(rec and rec.get("status") == "done" and rec.get("fingerprint") == fingerprint(cfg, stage))


def begin_stage(cfg: BuildConfig, stage: str) -> Path:
    """Prepare a stage folder: keep finished shards of the same fingerprint (resume), else wipe it."""
    folder = work_dir(cfg, stage)
    rec = stage_record(cfg, stage)
    fp = fingerprint(cfg, stage)
    if rec is None or rec.get("fingerprint") != fp or rec.get("status") == "done":
        reset_dir(folder)
    atomic_write_json(folder / "_stage.json", {"fingerprint": fp, "status": "started"})
    return folder


def finish_stage(cfg: BuildConfig, stage: str, stats: dict[str, Any]) -> dict[str, Any]:
    """Mark the stage done with its stats (the last write of a stage)."""
    atomic_write_json(work_dir(cfg, stage) / "_stage.json",
                      {"fingerprint": fingerprint(cfg, stage), "status": "done", "stats": stats})
    log.info("stage %s done in %.2fs", stage, stats.get("seconds", 0.0))
    return stats


def require_stage(cfg: BuildConfig, stage: str) -> dict[str, Any]:
    """The stats of a finished upstream stage; one-line ``StageError`` otherwise."""
    if not is_done(cfg, stage):
        raise StageError(f"stage '{stage}' has not finished for this config in {cfg.out}: run "
                         f"`python -m data_pipeline build --config ...` (or `stage {stage}`) first")
    return stage_record(cfg, stage)["stats"]  # type: ignore[index]


def progress_bar(cfg: BuildConfig, **kw: Any) -> Any:
    """A tqdm bar, silent unless ``cfg.progress``."""
    from tqdm import tqdm

    return tqdm(disable=not cfg.progress, **kw)


def assemble_stats(cfg: BuildConfig, reused: set[str] | None = None) -> dict[str, Any]:
    """``stats.json``: every stage's stats, the document reconciliation, the config."""
    ing = require_stage(cfg, "ingest")
    flt = require_stage(cfg, "filter")
    ded = require_stage(cfg, "dedup")
    exp = require_stage(cfg, "export")
    read, malformed = ing["read"], ing["rejected"]
    too_short, dups, kept = flt["too_short"], ded["removed"], exp["kept"]
    contaminated = exp.get("contaminated", 0)
    stage_stats = {s: {**{k: require_stage(cfg, s)[k] for k in ("seconds", "docs_in", "docs_per_s", "peak_rss_mib",
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
