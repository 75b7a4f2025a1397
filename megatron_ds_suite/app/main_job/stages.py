"""The stages of the main job, one method each (mixed into :class:`~megatron_ds_suite.app.main_job.job.MainJob`).

Each stage method returns (fingerprint, meta, run): meta["outputs_ok"] says whether the stage's outputs
exist (a finished record without them is re-run); run() does the work and returns a one-line summary.
Every stage is the project's own CLI run as a child process through ``MainJob._child``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from megatron_ds_suite.app.main_job.proc import Progress
from megatron_ds_suite.app.main_job.report import read_metrics
from megatron_ds_suite.app.main_job.state import Skipped, StageFailed, atomic_write, digest, file_id, latest_iteration
from megatron_ds_suite.core.network import network_reachable

log = logging.getLogger("main_job")


class Stages:
    """The GPT flow (corpus, train, eval_heldout, eval_wikitext103, eval_lambada) and the BERT flow
    (corpus, train, finetune_race, eval_race); the report stage lives in the job itself."""

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
        ok = latest_iteration(self.train_dir) == iters and (self.train_dir / "metrics.jsonl").is_file()

        def run() -> str:
            prev = self.state.get("train")
            if not prev.get("resumed") and self.train_dir.exists():
                # different settings (or never started here): a stale checkpoint must not be resumed
                shutil.rmtree(self.train_dir)
            elif prev.get("resumed") and latest_iteration(self.train_dir) is not None:
                log.info("  train: resuming from checkpoint iteration %d", latest_iteration(self.train_dir))
            target = ["-m", "training.pretrain", "--config", self.cfg.train.config, *self.train_overrides]
            if self.cfg.train.launcher == "python":
                cmd = [self.python, *target]
            else:
                cmd = self.launch(target, self.cfg.train.procs)
            self._child("train", cmd, Progress(total=iters, patterns=[r"iter\s+(?P<n>\d+)/(?P<total>\d+)"]), "it")
            got = latest_iteration(self.train_dir)
            if got != iters:
                raise StageFailed(f"stage 'train' ended without a checkpoint at iteration {iters} (latest: {got}); "
                                  f"full output: {self.logs / 'train.log'}")
            return self._train_summary()

        return self.train_fp, {"outputs_ok": ok}, run

    def _train_summary(self) -> str:
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
                      str(self.corpus_dir), "--split", self.train_cfg.data.split,
                      "--split-convention", self.train_cfg.data.split_convention, "--part", h.part,
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
            return race_results_summary(res)

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


def race_results_summary(res: dict[str, Any]) -> str:
    best = res.get("best") or {}
    accs = ", ".join(f"{split} accuracy {v['accuracy']:.4f} ({v['count']} questions)" for split, v in best.items())
    return f"best epoch {res.get('best_epoch')}: {accs}"
