"""``eval.tasks``: lm-eval's lambada_openai (local data) run on the live model at ``train.eval_interval``, logged in
metrics.jsonl, equal to the standalone lm-eval path on the checkpoint saved at that iteration.

A tiny GPT-2 (one process) trains 2 steps with eval_interval = save_interval = 1 and eval.limit = 5; the lm_eval
events must be at iterations 1 and 2, and each must equal lm-eval on the checkpoint of its iteration: iteration 1
through the library (the checkpoint's weights, ``SuiteLM`` + ``evaluate_tasks``), iteration 2 through
``python -m evaluation lm-eval`` itself. Iteration 1's evaluation ran mid-training, so the model it left must have
trained on exactly as one never evaluated (train mode back, random streams kept): the training losses equal those
of the same run without eval.tasks (trained in the same child process).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA, run_distributed

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
LAMBADA = Path(SHARED_DATA) / "eval" / "lambada" / "lambada_test.jsonl"
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
TASK = "lambada_openai_local"
LIMIT = 5


def _train(rank, world, runs):
    """Each override list trained in turn, in this one process (one start-up for both runs)."""
    from evaluation.lm_eval_train import LmEvalDuringTraining
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    for overrides in runs:
        cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides)
        Trainer(resolve_run(cfg), [LmEvalDuringTraining(cfg)] if cfg.eval.tasks else []).train()
    return True


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lm_eval_tasks_during_training_equal_the_standalone_command(tmp_path, monkeypatch):
    if not (LAMBADA.is_file() and BOTCHAN.is_file() and GPT2.is_dir()):
        pytest.skip("../shared/data (lambada_test.jsonl, botchan.txt, gpt2 tokenizer) absent")
    from evaluation.cli import main
    from evaluation.lm_eval_model import SuiteLM
    from evaluation.lm_eval_run import evaluate_tasks, task_manager
    from evaluation.lm_eval_train import flat_metrics
    from evaluation.scoring import gpt2_scorer
    from training.checkpoint_reader import load_model_for_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    spec = {"kind": "gpt2_bpe", "vocab_file": str((GPT2 / "gpt2-vocab.json").resolve()),
            "merges_file": str((GPT2 / "gpt2-merges.txt").resolve())}
    base = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]", "data.tokenizer": json.dumps(spec),
            "train.progress_bar": "false", "model.seq_length": "64", "train.micro_batch_size": "2",
            "train.global_batch_size": "2", "train.iters": "2", "optimizer.warmup_iters": "1", "parallel.tensor": "1",
            "train.eval_interval": "1", "train.eval_iters": "1", "train.save_interval": "1", "train.keep_last": "2",
            "run.device_peak_tflops": "1.0"}  # no CPU matmul measurement
    run, plain = tmp_path / "run", tmp_path / "plain"
    lm_eval = {"eval.tasks": f"[{TASK}]", "eval.lambada": str(LAMBADA), "eval.limit": str(LIMIT)}
    run_distributed(_train, 1, [[f"{k}={v}" for k, v in {**base, **lm_eval, "run.dir": run}.items()],
                                [f"{k}={v}" for k, v in {**base, "run.dir": plain}.items()]])

    events = {r["iteration"]: r for r in _rows(run) if r.get("event") == "lm_eval"}
    assert sorted(events) == [1, 2]
    assert {k for k in events[1] if k not in ("event", "iteration")} == {f"{TASK}/acc", f"{TASK}/perplexity"}

    # iteration 1: lm-eval on that checkpoint's weights, as the command builds its model
    model, cfg, tok = load_model_for_eval(run, tag="iter_0000001")
    with tempfile.TemporaryDirectory() as tmp:
        manager = task_manager(Path(tmp), [TASK], str(LAMBADA), None)
        scorer = gpt2_scorer(model, tok.vocab_size, cfg.model.positions)
        res = evaluate_tasks(SuiteLM(scorer, tok, "iter_0000001"), manager, [TASK], None, LIMIT)
    for key, value in flat_metrics(res["results"]).items():
        assert events[1][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key

    # iteration 2 (the newest checkpoint): python -m evaluation lm-eval
    out = tmp_path / "standalone.json"
    assert main(["lm-eval", "--checkpoint", str(run), "--tasks", TASK, "--lambada", str(LAMBADA),
                 "--limit", str(LIMIT), "--json", str(out)]) == 0
    standalone = flat_metrics(json.loads(out.read_text())["results"])
    assert set(standalone) == {f"{TASK}/acc", f"{TASK}/perplexity"}
    for key, value in standalone.items():
        assert events[2][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert events[2][f"{TASK}/perplexity"] != events[1][f"{TASK}/perplexity"]  # the live model, not a stale copy

    # evaluating mid-training changed nothing of the training: the same losses as the run without eval.tasks
    losses = [[(r["iteration"], r["loss"]) for r in _rows(d) if "event" not in r] for d in (run, plain)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
