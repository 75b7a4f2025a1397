"""Stop-and-resume probe over the configuration space: does every way of training resume exactly?

    python -m tests.hostile.resume_matrix [--only PATTERN] [--steps 4] [--stop 2] [--json OUT.json]

For each case (a model, a dtype and a parallel layout on 2 ranks) the same training runs twice through
``Trainer.train``: once to ``--steps`` iterations, once stopped by ``train.exit_at=--stop`` (a checkpoint, as a
signal or a time limit leaves it) and resumed by a fresh trainer from that checkpoint. Everything logged after the
stop (loss, gradient norm, learning rate, loss scale, skipped steps) and every weight at the end must be bitwise
equal. A case ends as ``exact``, ``differs`` (what first differs), or ``error`` (the exception, on any rank).

The cases run one after the other inside one 2-rank job per world size (tests.helpers.distributed), so the probe
takes minutes, not the hour a launch per case would cost. Not part of the test suite (pytest collects none of
tests/hostile); a failure it finds becomes a test where it belongs (tests/parallel/test_bf16_pipe_step.py holds
the first: bf16 under pipeline parallelism could not resume at all).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from tests.helpers.corpora import botchan_docs, write_bert_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, tiny_overrides, train_spm_model

# name: (config file, overrides) on 2 ranks; the tiny configs at sequence 32, 4 layers
CASES: dict[str, tuple[str, dict]] = {}


def _add(name: str, config: str = "gpt2_tiny", **extra) -> None:
    CASES[name] = (config, {"model.num_layers": 4, "train.global_batch_size": 8, "parallel.tensor": 1, **extra})


for _dtype in ("fp32", "fp16", "bf16"):
    _add(f"dp2-zero0-{_dtype}", **{"precision.dtype": _dtype})
    _add(f"tp2-{_dtype}", **{"parallel.tensor": 2, "precision.dtype": _dtype})
    _add(f"pp2-1f1b-{_dtype}", **{"parallel.pipeline": 2, "precision.dtype": _dtype})
    for _stage in (1, 2, 3):
        _add(f"dp2-zero{_stage}-{_dtype}", **{"parallel.zero_stage": _stage, "precision.dtype": _dtype})
for _dtype in ("fp16", "bf16"):
    _add(f"pp2-interleaved-{_dtype}", **{"parallel.pipeline": 2, "parallel.pipeline_schedule": "interleaved",
                                         "parallel.virtual_pipeline": 2, "precision.dtype": _dtype})
    _add(f"pp2-dualpipev-{_dtype}", **{"parallel.pipeline": 2, "parallel.pipeline_schedule": "dualpipev",
                                       "precision.dtype": _dtype})
    _add(f"pp2-interleaved-zero1-{_dtype}", **{"parallel.pipeline": 2, "parallel.pipeline_schedule": "interleaved",
                                               "parallel.virtual_pipeline": 2, "parallel.zero_stage": 1,
                                               "precision.dtype": _dtype})
    _add(f"pp2-dualpipev-zero1-{_dtype}", **{"parallel.pipeline": 2, "parallel.pipeline_schedule": "dualpipev",
                                             "parallel.zero_stage": 1, "precision.dtype": _dtype})
    _add(f"tp2-sp-{_dtype}", **{"parallel.tensor": 2, "parallel.sequence_parallel": "true", "precision.dtype": _dtype})
    _add(f"cp2-ulysses-{_dtype}", "llama_tiny", **{"parallel.context": 2, "precision.dtype": _dtype})
    _add(f"cp2-ring-{_dtype}", "llama_tiny", **{"parallel.context": 2, "parallel.context_impl": "ring",
                                                "precision.dtype": _dtype})
    _add(f"dp2-zero2-offload-{_dtype}", **{"parallel.zero_stage": 2, "parallel.offload_optimizer": "cpu",
                                           "precision.dtype": _dtype})
    _add(f"llama-tp2-{_dtype}", "llama_tiny", **{"parallel.tensor": 2, "precision.dtype": _dtype})
    _add(f"llama-pp2-{_dtype}", "llama_tiny", **{"parallel.pipeline": 2, "precision.dtype": _dtype})
    _add(f"bert-pp2-{_dtype}", "bert_tiny", **{"parallel.pipeline": 2, "precision.dtype": _dtype})
    _add(f"bert-dp2-zero1-{_dtype}", "bert_tiny", **{"parallel.zero_stage": 1, "precision.dtype": _dtype})


def _rows(run_dir: Path, after: int) -> list[dict]:
    keep = ("iteration", "loss", "grad_norm", "lr", "loss_scale", "skipped")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in keep} for r in rows if "event" not in r and r["iteration"] > after]


def _train(config: Path, overrides: list[str]):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    t = Trainer(resolve_run(load_config(config, overrides)))
    t.train()
    return t


def _weights(t) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in t.engine.module.named_parameters()}


def _first_difference(full, resumed, wf, wr) -> str | None:
    if full != resumed:
        for a, b in zip(full, resumed):
            if a != b:
                return f"logged after the stop: {a} vs {b}"
        return f"{len(full)} rows logged after the stop vs {len(resumed)}"
    for name, w in wf.items():
        if not torch.equal(w, wr[name]):
            return f"weight {name}: max |diff| {float((w - wr[name]).abs().max()):.3g}"
    return None


def _overrides(config: str, spec: dict, run_dir: Path, extra: dict) -> list[str]:
    """GPT and Llama on Botchan with the probe's tokenizer (tests.helpers.training_runs); BERT on the sentence corpus
    of Botchan that :func:`run` builds beside the runs."""
    if config != "bert_tiny":
        return tiny_overrides(spec, run_dir, **extra)
    bert = {"data.corpus": run_dir.parents[2] / "bert-corpus", "data.split": "90,10,0", "run.dir": run_dir,
            "train.progress_bar": "false", "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
            "model.seq_length": 64, "train.micro_batch_size": 2, "optimizer.warmup_iters": 1, **extra}
    return [f"{k}={v}" for k, v in bert.items()]


def _case(rank, spec, tmp, name, steps, stop) -> dict:
    config, extra = CASES[name]
    base = {"train.iters": steps, "train.log_interval": 1, "train.eval_interval": 0, "train.save_interval": 0,
            "precision.allow_fp16_on_cpu": "true", **extra}
    path = ROOT / "configs" / f"{config}.yaml"
    full = _train(path, _overrides(config, spec, Path(tmp) / name / "full", base))
    part_dir = Path(tmp) / name / "part"
    _train(path, _overrides(config, spec, part_dir, {**base, "train.exit_at": stop}))
    resumed = _train(path, _overrides(config, spec, part_dir, base))
    problem = _first_difference(_rows(Path(tmp) / name / "full", stop), _rows(part_dir, stop), _weights(full),
                                _weights(resumed))
    return {"status": "differs" if problem else "exact", "detail": problem}


def _worker(rank, world, spec, tmp, names, steps, stop):
    out = {}
    for name in names:
        try:
            out[name] = _case(rank, spec, tmp, name, steps, stop)
            if rank == 0:
                print(f"[resume_matrix] {name}: {out[name]['status']} {out[name]['detail'] or ''}", file=sys.stderr,
                      flush=True)
        except Exception as e:  # noqa: BLE001 - the probe records every failure and goes on
            out[name] = {"status": "error", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                         "trace": traceback.format_exc()[-2000:]}
            if rank == 0:
                print(f"[resume_matrix] {name}: {out[name]['detail']}", file=sys.stderr, flush=True)
            break  # a rank that failed may have left the others inside a collective: stop this job here
    return out


def run(names: list[str], steps: int, stop: int) -> dict:
    """Every case of ``names`` (in order, restarting the 2-rank job after a case that failed)."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec = train_spm_model(Path(tmp) / "spm")
        if any(CASES[n][0] == "bert_tiny" for n in names):
            write_bert_corpus(Path(tmp) / "bert-corpus", botchan_docs())
        todo = list(names)
        while todo:
            try:
                got = run_distributed(_worker, 2, spec, f"{tmp}/runs", todo, steps, stop, timeout=300 * len(todo))
            except AssertionError as e:  # a rank died or hung: the first case not reported is the culprit
                results[todo[0]] = {"status": "error", "detail": str(e).splitlines()[-1][:300]}
                todo = todo[1:]
                continue
            merged = {}
            for per_rank in got:
                for name, r in per_rank.items():
                    if name not in merged or r["status"] != "exact":
                        merged[name] = r
            results.update(merged)
            todo = [n for n in todo if n not in merged]
            if todo and not any(r["status"] == "error" for r in merged.values()):
                break  # nothing failed, yet cases are missing: do not loop
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="*", help="fnmatch pattern over the case names")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stop", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    names = [n for n in CASES if fnmatch.fnmatch(n, a.only)]
    if not names:
        p.error(f"--only {a.only} matches no case; cases: {', '.join(CASES)}")
    results = run(names, a.steps, a.stop)
    for name in names:
        r = results.get(name, {"status": "missing", "detail": None})
        print(f"{r['status']:8} {name}{': ' + r['detail'] if r.get('detail') else ''}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("exact", "differs", "error")}
    print(f"{counts['exact']} exact, {counts['differs']} differ, {counts['error']} errors of {len(names)} cases")
    return 0 if counts["exact"] == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
