"""The project's main job, end to end: corpus -> tokenizer -> indexed dataset -> GPT-2 (TP) -> evaluation -> report.

    .venv/bin/python -m megatron_ds_suite.app.main_job [--config configs/main/default.yaml] [key.sub=value ...] [--force STAGE]
    bash scripts/run_main.sh ...              # same, after making sure the environment exists

Every stage is the project's own CLI run as a child process (``python -m data_pipeline build``,
``deepspeed --module training.pretrain``, ``python -m evaluation ...``); its full output goes to
RUN/logs/<stage>.log, the console shows a progress bar and a one-line summary.

Reuse: each stage has a fingerprint (hash of its resolved settings, the fingerprints of the stages it
reads and the size/mtime of its input files); RUN/state.json records the fingerprint of every finished
stage. A stage whose fingerprint matches a finished record and whose outputs exist is reused ("reused:
finished earlier with the same inputs and settings"); a changed config re-runs the stages it affects and
everything downstream of them. Interrupting (Ctrl-C) leaves the stage "started": the corpus builder
resumes from its finished shards and training from its newest checkpoint (same fingerprint), other
stages start over; outputs are always written atomically, so a rerun never reads half a file.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_pipeline.config import ConfigError as DataConfigError
from data_pipeline.config import load_config as load_data_config
from megatron_ds_suite.app.main_job.config import ConfigError, MainConfig, flatten
from megatron_ds_suite.app.main_job.proc import Progress, run_logged
from megatron_ds_suite.app.main_job.report import ReportInputs, write_report
from megatron_ds_suite.app.main_job.stages import Stages
from megatron_ds_suite.app.main_job.state import (
    Outcome,
    Skipped,
    StageFailed,
    State,
    atomic_write,
    digest,
    read_if_file,
    tree_id,
)
from megatron_ds_suite.core.errors import ConfigError as TrainConfigError
from megatron_ds_suite.core.network import free_port
from training.config import load_config as load_train_config

ROOT = Path(__file__).resolve().parents[3]
log = logging.getLogger("main_job")
GPT_STAGES = ("corpus", "train", "eval_heldout", "eval_wikitext103", "eval_lambada", "report")
BERT_STAGES = ("corpus", "train", "finetune_race", "eval_race", "report")


class MainJob(Stages):
    """One invocation: resolves every stage config up front, then runs the stages in order (reusing finished ones)."""

    def __init__(self, cfg: MainConfig, config_path: str | None, overrides: list[str], force: set[str]) -> None:
        self.cfg, self.config_path, self.overrides, self.force = cfg, config_path, overrides, force
        self.run = Path(cfg.run_dir).resolve()
        self.logs = self.run / "logs"
        self.python = sys.executable
        self.outcomes: list[Outcome] = []
        self.stages = GPT_STAGES if cfg.flow == "gpt" else BERT_STAGES
        bad = force - set(self.stages) - {"all"}
        if bad:
            raise ConfigError(f"--force {sorted(bad)[0]!r}: stages of the {cfg.flow} flow are {', '.join(self.stages)} (or all)")
        self._prepare()

    # -------------------------------------------------------------------------------- resolution
    def _prepare(self) -> None:
        """Load and check every stage config now (clear errors before any expensive work)."""
        from data_pipeline.stages import fingerprint as data_fingerprint
        c = self.cfg
        data_over = flatten(c.corpus.set)
        if not any(o.startswith("output_dir=") for o in data_over):
            data_over.append(f"output_dir={self.run / 'corpus'}")
        if c.flow == "bert" and not any(o.startswith("dataset.bert=") for o in data_over):
            data_over += ["tokenizer.flavor=bert", "dataset.bert=true", "dataset.gpt=false"]
        try:
            self.data_cfg = load_data_config(c.corpus.config, data_over)
        except DataConfigError as e:
            raise ConfigError(f"corpus ({c.corpus.config}): {e}") from None
        self.data_overrides = data_over
        self.corpus_dir = self.data_cfg.out.resolve()
        self.corpus_fp = data_fingerprint(self.data_cfg, "export")

        self.train_dir = self.run / "train"
        self.train_overrides = flatten(c.train.set) + [f"data.corpus={self.corpus_dir}", f"run.dir={self.train_dir}"]
        try:
            self.train_cfg = load_train_config(c.train.config, self.train_overrides)
        except TrainConfigError as e:
            raise ConfigError(f"train ({c.train.config}): {e}") from None
        want = "gpt" if c.flow == "gpt" else "bert"
        if (self.train_cfg.model.arch == "bert") != (want == "bert"):  # model.arch gpt2: the old name of gpt
            raise ConfigError(f"train.config {c.train.config} is a {self.train_cfg.model.arch} model but flow={c.flow} "
                              f"needs model.arch={want}")
        mp = self.train_cfg.parallel.tensor * self.train_cfg.parallel.pipeline
        if c.train.procs % mp:
            raise ConfigError(f"train.procs={c.train.procs} is not a multiple of TP x PP = {mp}")
        t = self.train_cfg.to_dict()
        t["run"].pop("dir"), t["run"].pop("tensorboard"), t["data"].pop("corpus"), t["train"].pop("progress_bar")
        t["run"].pop("csv", None), t["run"].pop("wandb", None)  # tracking sinks do not change the result
        if not t.get("deepspeed"):
            t.pop("deepspeed", None)  # an empty pass-through section keeps earlier fingerprints
        self.accelerator = self._accelerator()
        self.train_fp = digest(["train", t, self.corpus_fp, c.train.procs, c.train.launcher, self.accelerator])
        if c.flow == "bert":
            self.race_dir = self.run / "race"
            self.race_overrides = flatten(c.race.set) + [f"finetune.pretrained={self.train_dir}",
                                                         f"finetune.race_dir={Path(c.race.data).resolve()}",
                                                         f"run.dir={self.race_dir}"]
            self.race_fp = digest(["race", self.train_fp, self.race_overrides, read_if_file(c.race.config),
                                   tree_id(c.race.data)])

    def _accelerator(self) -> str:
        a = self.cfg.train.accelerator
        if a != "auto":
            return a
        env = os.environ.get("DS_ACCELERATOR")
        if env:
            return env
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e["PYTHONUNBUFFERED"] = "1"
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        if self.accelerator == "cpu":
            e["DS_ACCELERATOR"] = "cpu"
        return e

    def launch(self, target: list[str], procs: int) -> list[str]:
        """``[python, -m, module, ...]`` or ``[deepspeed, --num_gpus, procs, ...]`` for ``target``
        (``["-m", module, args...]`` or ``[script.py, args...]``)."""
        if procs == 1 and self.cfg.train.launcher == "python":
            return [self.python, *target]
        ds = str(Path(self.python).parent / "deepspeed")
        if not Path(ds).exists():
            ds = shutil.which("deepspeed") or ds
        head = [ds, "--num_gpus", str(procs), "--master_port", str(free_port())]
        if target[0] == "-m":
            return head + ["--module", *target[1:]]
        return head + target

    # ------------------------------------------------------------------------------------- driver
    def execute(self) -> int:
        self.run.mkdir(parents=True, exist_ok=True)
        lock = open(self.run / ".lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another main job is running in {self.run} (lock {self.run / '.lock'}); wait for it "
                              "or use another run_dir") from None
        self.state = State(self.run / "state.json")
        atomic_write(self.run / "main_config.json", json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        log.info("main job (%s flow) in %s; logs in %s", self.cfg.flow, self.run, self.logs)
        runners: dict[str, Callable[[], tuple[str, dict[str, Any], Callable[[], str]]]] = {
            "corpus": self.stage_corpus, "train": self.stage_train, "eval_heldout": self.stage_heldout,
            "eval_wikitext103": self.stage_wikitext, "eval_lambada": self.stage_lambada,
            "finetune_race": self.stage_finetune_race, "eval_race": self.stage_eval_race}
        total = len(self.stages)
        t_all = time.perf_counter()
        for k, name in enumerate(self.stages, 1):
            prefix = f"[{k}/{total}] {name:<17}"
            if name == "report":
                t0 = time.perf_counter()
                path = self.stage_report()
                self.outcomes.append(Outcome("report", "ran", time.perf_counter() - t0, str(path)))
                log.info("%s written: %s (%.1fs)", prefix, path, time.perf_counter() - t0)
                continue
            try:
                fp, meta, run = runners[name]()
            except Skipped as e:  # not recorded in state.json: a finished earlier result stays reusable
                self.outcomes.append(Outcome(name, "skipped", 0.0, str(e)))
                log.info("%s skipped: %s", prefix, e)
                continue
            forced = "all" in self.force or name in self.force
            if not forced and self.state.done(name, fp) and meta.get("outputs_ok", True):
                rec = self.state.get(name)
                self.outcomes.append(Outcome(name, "reused", rec.get("seconds", 0.0), rec.get("summary", ""),
                                             rec.get("detail", {})))
                log.info("%s reused: finished earlier with the same inputs and settings (%s)", prefix,
                         rec.get("summary", ""))
                continue
            prev = self.state.get(name)
            resuming = prev.get("fingerprint") == fp and prev.get("status") in ("started", "interrupted", "failed")
            self.state.set(name, fingerprint=fp, status="started", started=time.strftime("%Y-%m-%d %H:%M:%S"),
                           resumed=resuming)
            t0 = time.perf_counter()
            try:
                summary = run()
            except KeyboardInterrupt:
                self.state.set(name, fingerprint=fp, status="interrupted")
                log.error("%s interrupted; rerun the same command to continue (finished stages are reused%s)",
                          prefix, ", training resumes from its newest checkpoint" if name in ("train", "finetune_race") else "")
                return 130
            except StageFailed as e:
                self.state.set(name, fingerprint=fp, status="failed", error=str(e))
                log.error("%s FAILED: %s", prefix, e)
                return 1
            secs = time.perf_counter() - t0
            detail = meta.get("detail", {})
            self.state.set(name, fingerprint=fp, status="done", seconds=round(secs, 3), summary=summary, detail=detail,
                           finished=time.strftime("%Y-%m-%d %H:%M:%S"), log=str(self.logs / f"{name}.log"))
            self.outcomes.append(Outcome(name, "ran", secs, summary, detail))
            log.info("%s done in %.1fs: %s", prefix, secs, summary)
        log.info("main job finished in %.1fs: report %s", time.perf_counter() - t_all, self.run / "report.md")
        return 0

    def _child(self, name: str, cmd: list[str], progress: Progress, unit: str = "") -> None:
        """Run one stage command with a console bar; raise StageFailed (stage, log, last lines) on error."""
        from tqdm import tqdm

        log_path = self.logs / f"{name}.log"
        bar = tqdm(total=progress.total, desc=f"  {name}", unit=unit or "it", leave=False,
                   disable=None if self.cfg.progress else True, dynamic_ncols=True)  # None: only on a terminal

        def update(line: str) -> None:
            if progress.feed(line):
                if progress.total is not None and bar.total != progress.total:
                    bar.total = progress.total
                bar.n = min(progress.n, progress.total or progress.n)
                bar.set_description_str(f"  {name}" + (f" {progress.label}" if progress.label else ""), refresh=False)
                bar.refresh()

        try:
            rc, tail = run_logged(cmd, log_path, env=self.env(), on_update=update, cwd=ROOT)
        finally:
            bar.close()
        if rc != 0:
            last = "\n".join("      | " + t[:200] for t in tail[-8:])
            raise StageFailed(f"stage '{name}' exited with code {rc}; full output: {log_path}\n{last}")

    # ------------------------------------------------------------------------------------- report
    def stage_report(self) -> Path:
        cmd = "bash scripts/run_main.sh" + (f" --config {self.config_path}" if self.config_path else "") + \
              "".join(f" {o}" for o in self.overrides)
        inputs = ReportInputs(run_dir=self.run, flow=self.cfg.flow, title=self.cfg.title, command=cmd,
                              corpus_dir=self.corpus_dir, train_dir=self.train_dir, train_cfg=self.train_cfg,
                              procs=self.cfg.train.procs, accelerator=self.accelerator,
                              stages=[dataclasses.asdict(o) for o in self.outcomes],
                              eval_detail={o.name: o.detail for o in self.outcomes})
        return write_report(inputs)
