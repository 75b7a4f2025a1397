"""Stage bookkeeping: fingerprints, ``work/<stage>/_stage.json`` markers, resume and the build's stats.

Each stage records ``work/<stage>/_stage.json`` = {fingerprint, status, stats[, shards]}. The fingerprint hashes
the config keys that change the stage's result together with the upstream fingerprint, so ``build``
skips a finished stage whose inputs did not change and recomputes everything downstream of a change.
A stage that writes a store (ingest, filter) records how many shards it wrote (``shards``); a later stage
refuses that store when its finished shards disagree (:func:`require_stage`), and the build refuses counts
that do not reconcile (:func:`reconcile`). A damaged ``_stage.json`` is one line; ``build --force`` (every
stage begun again, :func:`begin_stage`) rewrites it.
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
from data_pipeline.doc_store import DocStore
from data_pipeline.files import atomic_write_json, read_json, reset_dir
from data_pipeline.report import StageTimer
from data_pipeline.sources import input_fingerprint
from data_pipeline.store import REBUILD, STORE_FORMAT, ShardCheck, StoreError, done_shards
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
            return digest(["tokenizer", t, _file_stats(cfg), SPEC_PATHS])
        return digest(["tokenizer", fingerprint(cfg, "ingest"), t, cfg.seed, SPEC_PATHS])
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


#: how the tokenizer stage records its files (part of its fingerprint): relative to the output folder
SPEC_PATHS = "relative-to-output"


def record_spec(cfg: BuildConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer spec as the tokenizer stage records it: each ``*_file`` inside the output folder relative to
    it (a copied output folder uses its own files), any other absolute."""
    out = cfg.out.resolve()
    rec = {}
    for k, v in spec.items():
        if k.endswith("_file") and v:
            p = Path(v).resolve()
            v = p.relative_to(out).as_posix() if out in p.parents else str(p)
        rec[k] = v
    return rec


def stage_tokenizer_spec(cfg: BuildConfig) -> dict[str, Any]:
    """The finished tokenizer stage's spec with its files as paths (a relative one resolved against the output
    folder)."""
    spec = require_stage(cfg, "tokenizer")["spec"]
    return {k: (str(cfg.out.resolve() / v) if k.endswith("_file") and v and not Path(v).is_absolute() else v)
            for k, v in spec.items()}


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
    """The stage's ``_stage.json``, or None before it started; one-line :class:`StoreError` when it is damaged."""
    p = work_dir(cfg, stage) / "_stage.json"
    if not p.exists():
        return None
    try:
        rec = read_json(p)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise StoreError(f"{p} is damaged ({type(e).__name__}: {' '.join(str(e).split())[:100]}): rerun with "
                         f"`build --force` (it rebuilds the work files)") from None
    if not (isinstance(rec, dict) and isinstance(rec.get("status"), str)
            and (rec["status"] != "done" or isinstance(rec.get("stats"), dict))):
        raise StoreError(f"{p} is damaged (not a stage record): rerun with `build --force` (it rebuilds the work "
                         f"files)")
    return rec


def is_done(cfg: BuildConfig, stage: str) -> bool:
    """Finished, with the fingerprint of this config."""
    rec = stage_record(cfg, stage)
    return bool(rec and rec.get("status") == "done" and rec.get("fingerprint") == fingerprint(cfg, stage))


def begin_stage(cfg: BuildConfig, stage: str) -> Path:
    """Prepare a stage folder: keep finished shards of the same fingerprint (resume), else wipe it."""
    folder = work_dir(cfg, stage)
    try:
        rec = stage_record(cfg, stage)
    except StoreError:  # a damaged record: the stage starts again from nothing (its work files only)
        rec = None
    fp = fingerprint(cfg, stage)
    if rec is None or rec.get("fingerprint") != fp or rec.get("status") == "done":
        reset_dir(folder)
    atomic_write_json(folder / "_stage.json", {"fingerprint": fp, "status": "started"})
    return folder


def finish_stage(cfg: BuildConfig, stage: str, stats: dict[str, Any], shards: int | None = None,
                 docs: int | None = None) -> dict[str, Any]:
    """Mark the stage done with its stats (the last write of a stage); for a stage that writes a store,
    ``shards``: how many shards (``docs-00000`` to ``docs-<shards - 1>``) it holds, checked against the folder
    first, and ``docs``: how many documents their indexes hold (checked by :func:`open_store`)."""
    rec = {"fingerprint": fingerprint(cfg, stage), "status": "done", "stats": stats}
    if shards is not None:
        rec.update(shards=shards, docs=docs)
        check_shards(work_dir(cfg, stage), shards)
    atomic_write_json(work_dir(cfg, stage) / "_stage.json", rec)
    log.info("stage %s done in %.2fs", stage, stats.get("seconds", 0.0))
    return stats


class StageRun:
    """One run of a stage's bookkeeping as one context: its timer (started on creation), :meth:`begin` (the folder
    prepared, ``_stage.json`` "started"), :meth:`progress` (bars, closed when the ``with`` block ends, however it
    ends), :meth:`stats` (seconds, documents/s, peak memory and the stage's own numbers), :meth:`finish`
    (``_stage.json`` "done" with its stats and shards) and :attr:`fingerprint`. Every stage runs in one::

        with StageRun(cfg, "filter") as stage:
            folder = stage.begin()
            bar = stage.progress(desc="filter", unit="doc")
            ...
            return stage.finish(stage.stats(docs_in, kept=kept), shards=shards, docs=kept)
    """

    def __init__(self, cfg: BuildConfig, name: str) -> None:
        self.cfg, self.name = cfg, name
        self.timer = StageTimer(name)
        self.folder = work_dir(cfg, name)
        self._bars: list[Any] = []

    def __enter__(self) -> StageRun:
        return self

    def __exit__(self, *exc: object) -> None:
        for bar in self._bars:
            bar.close()

    @property
    def fingerprint(self) -> str:
        """:func:`fingerprint` of this stage for this config."""
        return fingerprint(self.cfg, self.name)

    def begin(self) -> Path:
        """:func:`begin_stage`: the stage's folder, wiped unless resuming the same fingerprint."""
        self.folder = begin_stage(self.cfg, self.name)
        return self.folder

    def progress(self, **kw: Any) -> Any:
        """A :func:`progress_bar`, closed when the stage's ``with`` block ends."""
        bar = progress_bar(self.cfg, **kw)
        self._bars.append(bar)
        return bar

    def stats(self, docs_in: int, **info: Any) -> dict[str, Any]:
        """The stage's stats: seconds since the run began, documents in, per second, peak memory, and ``info``."""
        return self.timer.finish(docs_in, **info)

    def finish(self, stats: dict[str, Any], shards: int | None = None, docs: int | None = None) -> dict[str, Any]:
        """:func:`finish_stage`: the stage marked done with ``stats`` (its last write); returns ``stats``."""
        for bar in self._bars:
            bar.close()
        return finish_stage(self.cfg, self.name, stats, shards, docs)


def require_stage(cfg: BuildConfig, stage: str) -> dict[str, Any]:
    """The stats of a finished upstream stage whose store holds the shards it wrote; one-line ``StageError`` /
    ``StoreError`` otherwise."""
    if not is_done(cfg, stage):
        raise StageError(f"stage '{stage}' has not finished for this config in {cfg.out}: run "
                         f"`python -m data_pipeline build --config ...` (or `stage {stage}`) first")
    rec: dict[str, Any] = stage_record(cfg, stage)  # type: ignore[assignment]
    if "shards" in rec:
        check_shards(work_dir(cfg, stage), rec["shards"])
    return rec["stats"]


def open_store(cfg: BuildConfig, stage: str) -> DocStore:
    """The store of the finished ``stage`` (:func:`require_stage` first), opened, holding as many documents as
    its stage wrote (a shard index cut or replaced by a shorter one is refused here, before any work)."""
    require_stage(cfg, stage)
    store = DocStore(work_dir(cfg, stage))
    docs = stage_record(cfg, stage).get("docs")  # type: ignore[union-attr]
    if docs is not None and len(store) != docs:
        store.close()
        check = ShardCheck()
        for k in store.shards:  # name the index that changed (it no longer matches its checksum)
            check.file(store.folder, k, ".idx.npy")
        raise StoreError(f"{store.folder}: its shard indexes hold {len(store)} documents, its stage wrote {docs}: "
                         f"{REBUILD}")
    return store


def check_shards(folder: Path, shards: Any) -> None:
    """The finished shards (completion markers) of the store ``folder`` are exactly ``docs-00000`` to
    ``docs-<shards - 1>``, as its stage recorded; one-line :class:`StoreError` naming the first difference."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 0:
        raise StoreError(f"{folder / '_stage.json'} is damaged (shards: {shards!r}): rerun with `build --force`")
    found = done_shards(folder)
    if found == list(range(shards)):
        return
    have = set(found)
    lost = [k for k in range(shards) if k not in have]
    extra = [k for k in found if k >= shards]
    what = (f"the completion marker of shard {lost[0]} (docs-{lost[0]:05d}.done.json) is missing" if lost else
            f"it also holds shard {extra[0]}, which its stage did not write")
    raise StoreError(f"{folder}: its stage wrote {shards} shard(s), {len(found)} are finished ({what}{' and more' if len(lost) + len(extra) > 1 else ''}): "
                     f"{REBUILD}")


def reconcile(documents: dict[str, Any]) -> None:
    """``read = malformed + too_short + duplicates + contaminated + kept``, or a one-line :class:`StageError`: a
    build that lost (or invented) documents is not published as finished."""
    parts = ("malformed", "too_short", "duplicates", "contaminated", "kept")
    total = sum(documents[p] for p in parts)
    if documents["read"] != total:
        raise StageError(f"the build's document counts do not reconcile: read {documents['read']} != "
                         + " + ".join(f"{p} {documents[p]}" for p in parts)
                         + f" = {total}: a work file was lost or changed between stages; rerun with `build --force`")


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
    documents = {"read": read, "malformed": malformed, "too_short": too_short, "duplicates": dups,
                 "contaminated": contaminated, "kept": kept}
    reconcile(documents)
    return {
        "output_dir": str(cfg.out),
        "documents": {**documents, "reconciles": True},
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
