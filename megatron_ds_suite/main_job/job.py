"""The project's main job, end to end: corpus -> tokenizer -> indexed dataset -> GPT-2 (TP) -> evaluation -> report.

    .venv/bin/python scripts/main_job.py [--config configs/main/default.yaml] [key.sub=value ...] [--force STAGE]
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

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ds_suite.main_job.config import ConfigError, MainConfig, flatten, load_main_config
from megatron_ds_suite.main_job.proc import Progress, free_port, network_reachable, run_logged

ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger("main_job")
GPT_STAGES = ("corpus", "train", "eval_heldout", "eval_wikitext103", "eval_lambada", "report")
BERT_STAGES = ("corpus", "train", "finetune_race", "eval_race", "report")


class StageFailed(RuntimeError):
    """A stage's command failed; the message names the stage and its log."""


class Skipped(Exception):
    """A stage that cannot run here (no file and no network); not an error."""


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_id(path: str | Path) -> list[Any]:
    st = os.stat(path)
    return [str(Path(path).resolve()), st.st_size, int(st.st_mtime)]


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- state
class State:
    """RUN/state.json: {stage: {fingerprint, status, seconds, summary, ...}}, rewritten atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, stage: str) -> dict[str, Any]:
        return self.data.get(stage, {})

    def set(self, stage: str, **rec: Any) -> None:
        self.data[stage] = rec
        atomic_write(self.path, json.dumps(self.data, indent=2, default=str) + "\n")

    def done(self, stage: str, fingerprint: str) -> bool:
        r = self.get(stage)
        return r.get("status") == "done" and r.get("fingerprint") == fingerprint


# --------------------------------------------------------------------------------------------- job
@dataclass
class Outcome:
    """What happened to a stage in this invocation (for the console and the report)."""

    name: str
    status: str  # ran | reused | skipped
    seconds: float
    summary: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class MainJob:
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
        from data_pipeline.config import ConfigError as DataConfigError
        from data_pipeline.config import load_config as load_data_config
        from data_pipeline.stages import fingerprint as data_fingerprint
        from training.config import ConfigError as TrainConfigError
        from training.config import load_config as load_train_config

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
        want = "gpt2" if c.flow == "gpt" else "bert"
        if self.train_cfg.model.arch != want:
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
            self.race_fp = digest(["race", self.train_fp, self.race_overrides, _read(c.race.config),
                                   _tree_id(c.race.data)])

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
                   disable=not self.cfg.progress, dynamic_ncols=True)

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

    # -------------------------------------------------------------------------------------- stages
    # Each stage method returns (fingerprint, meta, run): meta["outputs_ok"] says whether the stage's
    # outputs exist (a finished record without them is re-run); run() does the work, returns a summary.
    def stage_corpus(self):
        from data_pipeline.stages import STAGES, is_done

        outputs_ok = all(is_done(self.data_cfg, s) for s in STAGES) and (self.corpus_dir / "stats.json").is_file() \
            and (self.corpus_dir / "corpus.json").is_file()

        def run() -> str:
            cmd = [self.python, "-m", "data_pipeline", "build", "--config", self.cfg.corpus.config, *self.data_overrides]
            if self.force & {"corpus", "all"}:
                cmd.append("--force")  # the builder would otherwise reuse its finished sub-stages
            self._child("corpus", cmd, Progress(total=len(STAGES), steps=[r"stage (?P<label>\w+) done",
                                                                        r"stage (?P<label>\w+): finished earlier"]),
                        unit="stage")
            return self._corpus_summary()

        return self.corpus_fp, {"outputs_ok": outputs_ok}, run

    def _corpus_summary(self) -> str:
        d = json.loads((self.corpus_dir / "stats.json").read_text())["documents"]
        return (f"{d['read']} read, {d['malformed']} malformed, {d['too_short']} too short, "
                f"{d['duplicates']} duplicates, {d['kept']} kept")

    def stage_train(self):
        iters = self.train_cfg.train.iters
        ok = _latest_iteration(self.train_dir) == iters and (self.train_dir / "metrics.jsonl").is_file()

        def run() -> str:
            prev = self.state.get("train")
            if not prev.get("resumed") and self.train_dir.exists():
                # different settings (or never started here): a stale checkpoint must not be resumed
                shutil.rmtree(self.train_dir)
            elif prev.get("resumed") and _latest_iteration(self.train_dir) is not None:
                log.info("  train: resuming from checkpoint iteration %d", _latest_iteration(self.train_dir))
            target = ["-m", "training.pretrain", "--config", self.cfg.train.config, *self.train_overrides]
            if self.cfg.train.launcher == "python":
                cmd = [self.python, *target]
            else:
                cmd = self.launch(target, self.cfg.train.procs)
            self._child("train", cmd, Progress(total=iters, patterns=[r"iter\s+(?P<n>\d+)/(?P<total>\d+)"]), "it")
            got = _latest_iteration(self.train_dir)
            if got != iters:
                raise StageFailed(f"stage 'train' ended without a checkpoint at iteration {iters} (latest: {got}); "
                                  f"full output: {self.logs / 'train.log'}")
            return self._train_summary()

        return self.train_fp, {"outputs_ok": ok}, run

    def _train_summary(self) -> str:
        from megatron_ds_suite.main_job.report import read_metrics

        steps, events = read_metrics(self.train_dir / "metrics.jsonl")
        s = f"{len(steps)} iterations, final loss {steps[-1]['loss']:.4f}" if steps else "no steps"
        valid = [e for e in events if e.get("event") == "valid"]
        if valid:
            s += f", validation loss {valid[-1]['loss']:.4f}"
        return s

    def _eval_cmd(self, target: list[str]) -> list[str]:
        tp = self.cfg.eval.tp
        if tp == 1:
            return [self.python, *target]
        return self.launch(target + ["--tp", str(tp)], tp)

    def stage_heldout(self):
        h = self.cfg.eval.heldout
        if not h.enabled:
            raise Skipped("disabled (eval.heldout.enabled=false)")
        out = self.run / "eval" / "heldout.json"
        fp = digest(["heldout", self.train_fp, dataclasses.asdict(h), self.cfg.eval.tp])

        def run() -> str:
            target = ["-m", "evaluation", "heldout", "--checkpoint", str(self.train_dir), "--corpus",
                      str(self.corpus_dir), "--split", self.train_cfg.data.split, "--part", h.part,
                      "--stride", str(h.stride), "--batch-size", str(h.batch_size),
                      "--max-documents", str(h.max_documents), "--json", str(out)]
            self._child("eval_heldout", self._eval_cmd(target), Progress(follow_tqdm=True), "win")
            r = json.loads(out.read_text())
            return f"{r['documents']} {h.part} documents, {r['tokens']} tokens: loss {r['loss']:.4f}, ppl {r['ppl']:.2f}"

        return fp, {"outputs_ok": out.is_file()}, run

    def _eval_input(self, name: str, data: str | None, hf: str | None, hf_split: str, limit: int,
                    kind: str) -> tuple[Path, list[Any], Path]:
        """The evaluation file to use (a given file, else one fetched through ``datasets`` once and kept in
        RUN/eval/inputs), cut to its first ``limit`` lines when asked; and its identity for the fingerprint."""
        inputs = self.run / "eval" / "inputs"
        if data and Path(data).is_file():
            src = Path(data).resolve()
        elif hf:
            src = inputs / f"{name}-{digest([hf, hf_split])}.{'tokens' if kind == 'wikitext' else 'jsonl'}"
            if not src.is_file():
                if not Path(hf.partition(":")[0]).exists() and not network_reachable(timeout=self.cfg.network_timeout):
                    why = f"{data} does not exist and " if data else ""
                    raise Skipped(f"{why}no network to fetch {hf!r} through datasets")
                self._fetch(name, hf, hf_split, src, kind)
        else:
            raise Skipped(f"no data: {data} does not exist and no hf_dataset is set" if data else
                          "no data file or hf_dataset configured")
        if limit:
            cut = inputs / f"{name}-first{limit}-{digest(file_id(src))}{src.suffix}"
            if not cut.is_file():
                with open(src, encoding="utf-8") as f:
                    lines = [line for _, line in zip(range(limit), f)]
                atomic_write(cut, "".join(lines))
            return cut, [file_id(src), limit], src
        return src, [file_id(src), 0], src

    def _fetch(self, name: str, hf: str, split: str, dest: Path, kind: str) -> None:
        code = ("import json,sys\n"
                "from evaluation.wikitext import read_hf_wikitext\nfrom evaluation.lambada import read_hf_lambada\n"
                "name, split, dest, kind = sys.argv[1:5]\n"
                "if kind == 'wikitext':\n    text = read_hf_wikitext(name, split)\n"
                "else:\n    text = ''.join(json.dumps({'text': t}) + '\\n' for t in read_hf_lambada(name, split))\n"
                "tmp = dest + '.tmp'\nopen(tmp, 'w', encoding='utf-8').write(text)\n"
                "import os; os.replace(tmp, dest); print('fetched', dest)\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._child(f"fetch_{name}", [self.python, "-c", code, hf, split, str(dest), kind], Progress(follow_tqdm=True))

    def stage_wikitext(self):
        w = self.cfg.eval.wikitext103
        if not w.enabled:
            raise Skipped("disabled (eval.wikitext103.enabled=false)")
        path, ident, src = self._eval_input("wikitext103", w.data, w.hf_dataset, w.hf_split, w.limit_lines, "wikitext")
        out = self.run / "eval" / "wikitext103.json"
        fp = digest(["wikitext103", self.train_fp, ident, w.seq_length, w.stride, w.batch_size, self.cfg.eval.tp])

        def run() -> str:
            target = ["-m", "evaluation", "wikitext103", "--checkpoint", str(self.train_dir), "--data", str(path),
                      "--json", str(out), "--stride", str(w.stride), "--batch-size", str(w.batch_size)]
            if w.seq_length:
                target += ["--seq-length", str(w.seq_length)]
            self._child("eval_wikitext103", self._eval_cmd(target), Progress(follow_tqdm=True), "win")
            r = json.loads(out.read_text())
            return (f"{r['num_original_tokens']} original tokens{self._limited(w.limit_lines, 'lines')}: "
                    f"adjusted ppl {r['adjusted_ppl']:.2f}, token ppl {r['ppl']:.2f}")

        return fp, {"outputs_ok": out.is_file(),
                    "detail": {"data": str(path), "source": str(src), "limit": w.limit_lines, "unit": "lines"}}, run

    @staticmethod
    def _limited(limit: int, what: str) -> str:
        return f" (first {limit} {what})" if limit else ""

    def stage_lambada(self):
        la = self.cfg.eval.lambada
        if not la.enabled:
            raise Skipped("disabled (eval.lambada.enabled=false)")
        path, ident, src = self._eval_input("lambada", la.data, la.hf_dataset, la.hf_split, la.limit, "lambada")
        out = self.run / "eval" / "lambada.json"
        fp = digest(["lambada", self.train_fp, ident, la.strict, la.batch_size, self.cfg.eval.tp])

        def run() -> str:
            target = ["-m", "evaluation", "lambada", "--checkpoint", str(self.train_dir), "--data", str(path),
                      "--json", str(out), "--batch-size", str(la.batch_size), "--strict" if la.strict else "--no-strict"]
            self._child("eval_lambada", self._eval_cmd(target), Progress(follow_tqdm=True), "ex")
            r = json.loads(out.read_text())
            return f"{r['mode']} accuracy {r['accuracy']:.4f} ({r['correct']}/{r['count']})"

        return fp, {"outputs_ok": out.is_file(),
                    "detail": {"data": str(path), "source": str(src), "limit": la.limit, "unit": "examples"}}, run

    # BERT flow ------------------------------------------------------------------------------------
    def stage_finetune_race(self):
        r = self.cfg.race
        if not Path(r.data).is_dir():
            raise StageFailed(f"race.data {r.data} is not a folder with RACE train/dev/test")
        ok = (self.race_dir / "checkpoints" / "latest").is_file() and (self.race_dir / "race_results.json").is_file()

        def run() -> str:
            if self.race_dir.exists():
                shutil.rmtree(self.race_dir)  # fine-tuning is short: always from the pretrained model
            target = ["-m", "training.finetune_race", "--config", r.config, *self.race_overrides]
            cmd = [self.python, *target] if self.cfg.train.launcher == "python" else self.launch(target, self.cfg.train.procs)
            self._child("finetune_race", cmd, Progress(follow_tqdm=True), "it")
            res = json.loads((self.race_dir / "race_results.json").read_text())
            return _race_results_summary(res)

        return self.race_fp, {"outputs_ok": ok}, run

    def stage_eval_race(self):
        r = self.cfg.race
        out = self.run / "eval" / "race.json"
        fp = digest(["eval_race", self.race_fp, r.split, r.batch_size, self.cfg.eval.tp])

        def run() -> str:
            ft = json.loads((self.race_dir / "config.json").read_text())
            seq = ft["finetune"].get("seq_length") or ft["model"]["seq_length"]  # the length it was tuned at
            target = ["-m", "evaluation", "race", "--checkpoint", str(self.race_dir), "--data", str(Path(r.data).resolve()),
                      "--split", r.split, "--json", str(out), "--batch-size", str(r.batch_size), "--seq-length", str(seq)]
            self._child("eval_race", self._eval_cmd(target), Progress(follow_tqdm=True), "q")
            res = json.loads(out.read_text())
            return f"RACE {r.split} accuracy {res['accuracy']:.4f} ({res['count']} questions)"

        return fp, {"outputs_ok": out.is_file()}, run

    # ------------------------------------------------------------------------------------- report
    def stage_report(self) -> Path:
        from megatron_ds_suite.main_job.report import ReportInputs, write_report

        cmd = "bash scripts/run_main.sh" + (f" --config {self.config_path}" if self.config_path else "") + \
              "".join(f" {o}" for o in self.overrides)
        inputs = ReportInputs(run_dir=self.run, flow=self.cfg.flow, title=self.cfg.title, command=cmd,
                              corpus_dir=self.corpus_dir, train_dir=self.train_dir, train_cfg=self.train_cfg,
                              procs=self.cfg.train.procs, accelerator=self.accelerator,
                              stages=[dataclasses.asdict(o) for o in self.outcomes],
                              eval_detail={o.name: o.detail for o in self.outcomes})
        return write_report(inputs)


def _read(path: str) -> str:
    return Path(path).read_text() if Path(path).is_file() else ""


def _tree_id(folder: str) -> list[Any]:
    p = Path(folder)
    return [file_id(f) for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else []


def _latest_iteration(run_dir: Path) -> int | None:
    f = run_dir / "checkpoints" / "latest"
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    try:
        return int(tag.rsplit("_", 1)[-1])
    except ValueError:
        return None


def _race_results_summary(res: dict[str, Any]) -> str:
    best = res.get("best") or {}
    accs = ", ".join(f"{split} accuracy {v['accuracy']:.4f} ({v['count']} questions)" for split, v in best.items())
    return f"best epoch {res.get('best_epoch')}: {accs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/main_job.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/main/default.yaml", help="main-job YAML (configs/main/)")
    ap.add_argument("--force", action="append", default=[], metavar="STAGE",
                    help="re-run this stage even if finished (repeatable; 'all' for every stage)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    ap.add_argument("overrides", nargs="*", help="main-config overrides, e.g. train.set.train.iters=50")
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    config_path = str(Path(args.config).resolve())
    os.chdir(ROOT)  # every relative path inside configs and overrides is relative to the repository root

    install_signal_handlers()
    try:
        cfg = load_main_config(config_path, args.overrides)
        if args.quiet:
            cfg.progress = False
        job = MainJob(cfg, args.config, args.overrides, set(args.force))
        return job.execute()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP (an ssh session that drops) behave like Ctrl-C: the running stage's process
    group (its own session, so the hangup never reaches it) is stopped by ``run_logged`` and the
    orchestrator exits 130 with its state kept; rerunning resumes. Without this a hangup killed the
    orchestrator alone and left training running, unlocked, for a rerun to overlap."""
    def on_term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored


if __name__ == "__main__":
    sys.exit(main())
