"""Every tensor that meets the model or a collective lives on the engine's device.

Two mechanisms (see tests/helpers/fake_cuda_checks.py and tests/helpers/device_guard.py):

* fake CUDA: every task's forward + loss, the validation and DP reductions, the parameter count, the
  grad norm and the evaluation scorers with parameters on fake ``cuda:0`` and the real data loaders;
  with the batch mover replaced by one that moves nothing, the batch paths must fail (the control);
* emulated CUDA + collective guard: a real TP=2 x DP=2 training with validation, then a TP=2 x DP=2
  evaluation (WikiText, LAMBADA) and RACE accuracy over DP=2, with DeepSpeed's accelerator reporting ``cuda``;
  every collective operand must be on the engine's device, and the numbers equal a serial reference.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.device_guard import emulated_cuda_run
from tests.helpers.distributed import SHARED_DATA, run_distributed

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(SHARED_DATA)
GPT2 = DATA / "tokenizers" / "gpt2"
BOTCHAN = DATA / "corpus" / "botchan.txt"
RACE = DATA / "eval" / "RACE"
WIKITEXT = DATA / "eval" / "wikitext-103" / "wiki.test.tokens"
LAMBADA = DATA / "eval" / "lambada" / "lambada_test.jsonl"
needs_data = pytest.mark.skipif(not all(p.exists() for p in (GPT2, BOTCHAN, RACE, WIKITEXT, LAMBADA)),
                                reason="../shared/data (tokenizers, corpus, eval files) not present")

BATCH_PATHS = {"check_gpt_task_loss", "check_gpt_task_loss_context_parallel", "check_gpt_pipe_forward", "check_trainer_validation_reduction",
               "check_bert_task_loss", "check_race_finetune_forward_and_accuracy_reduction", "check_race_scorer",
               "check_wikitext_scoring_and_dp_reduction", "check_lambada_scoring", "check_sdpa_is_causal_on_cuda"}


# --------------------------------------------------------------------------------------------------
# fake CUDA (FakeTensorMode), in a subprocess
# --------------------------------------------------------------------------------------------------
@needs_data
def test_every_path_on_fake_cuda_and_skipping_the_mover_fails(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.fake_cuda_checks", str(tmp_path), "--with-control"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = {r["check"]: r for r in rows if not r["control"]}
    control = {r["check"]: r for r in rows if r["control"]}
    from tests.helpers.fake_cuda_checks import CHECKS

    assert set(real) == set(control) == {c.__name__ for c in CHECKS}
    failed = {k: v["error"] for k, v in real.items() if not v["ok"]}
    assert not failed, json.dumps({k: real[k].get("trace") for k in failed}, indent=1)
    # the control: a mover that moves nothing leaves host tensors, and each batch path trips on them
    for name in BATCH_PATHS:
        assert not control[name]["ok"] and "FakeTensorDeviceMismatchError" in control[name]["error"], control[name]


# --------------------------------------------------------------------------------------------------
# emulated CUDA + collective guard, real numbers
# --------------------------------------------------------------------------------------------------
def _gpt_overrides(run_dir: Path) -> list[str]:
    ov = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]",
          "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                                        "merges_file": str(GPT2 / "gpt2-merges.txt")}),
          "run.dir": str(run_dir), "train.progress_bar": "false", "model.seq_length": "32",
          "train.micro_batch_size": "2", "train.global_batch_size": "4", "train.iters": "2",
          "train.eval_interval": "1", "train.eval_iters": "1", "precision.dtype": "fp32", "parallel.tensor": "2",
          "optimizer.warmup_iters": "1", "run.device_peak_tflops": "1.0"}
    return [f"{k}={v}" for k, v in ov.items()]


def _race_samples(tok_spec: dict):
    from megatron_ds_suite.core.race import encode_questions, read_race_split
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    qs, _ = read_race_split(RACE, "dev")
    return encode_questions(qs, load_tokenizer(tok_spec), 48)


def _race_cfg():
    from training.config import config_from_dict

    return config_from_dict({"model": {"arch": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                       "seq_length": 48, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                             "finetune": {"eval_batch_size": 3}, "data": {"text_files": [str(BOTCHAN)]}})


def _guarded_run(rank, world, run_dir, race_tok):
    """TP=2 x DP=2, the accelerator claiming cuda:rank: training with validation (checkpoint saved),
    then WikiText and LAMBADA through the CLI's scorer on that checkpoint, and RACE accuracy as the
    fine-tuner computes it (its DP reduction)."""
    import torch.distributed as dist

    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    with emulated_cuda_run(rank) as (guard, _):
        trainer = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", _gpt_overrides(run_dir))))
        out = trainer.train()
        train = {"seen": dict(guard.seen), "violations": list(guard.violations), "valid": out["valid_loss"],
                 "device": str(next(trainer.model.parameters()).device)}
    dist.barrier()
    return {"train": train, **_guarded_eval(rank, run_dir, race_tok)}


def _guarded_eval(rank, run_dir, race_tok):
    from evaluation.lambada import read_lambada_jsonl
    from evaluation.model import load_scorer, setup_runtime
    from evaluation.tasks import lambada_eval, wikitext_eval
    from evaluation.wikitext import first_lines
    from training.models.bert import BertMultipleChoice
    from training.runtime import device as tdev
    from training.tasks.race import dp_accuracy

    text = first_lines(WIKITEXT.read_text(encoding="utf-8"), 12)
    texts = read_lambada_jsonl(LAMBADA)[:6]
    with emulated_cuda_run(rank) as (guard, _):
        rt = setup_runtime(tp=2)
        scorer, cfg, tok = load_scorer(run_dir, rt)
        wt = wikitext_eval(scorer, tok, text, seq_len=32, stride=16, batch_size=3, dp=rt.dp, progress=False)
        lb = lambada_eval(scorer, tok, texts, batch_size=3, dp=rt.dp, progress=False)
        race_cfg, ps = _race_cfg(), rt.pstate
        engine = BertMultipleChoice(race_cfg.model, 512, ps.tp_group, seed=5).to(tdev.local_device()).eval()
        race = dp_accuracy(engine, _race_samples(race_tok), ps.dims.dp, ps.dp_rank, ps.dp_group,
                           race_cfg.finetune.eval_batch_size)
        device = str(scorer.device)
    return {"seen": dict(guard.seen), "violations": guard.violations, "wikitext": wt, "lambada": lb, "race": race,
            "device": device}


@pytest.fixture(scope="module")
def race_tokenizer(tmp_path_factory):
    from data_pipeline.tokenizer_train import train_sentencepiece

    texts = [json.loads(line)["article"] for f in sorted(RACE.glob("*/*/*.txt"))
             for line in f.read_text().splitlines() if line.strip()]
    return train_sentencepiece(texts, tmp_path_factory.mktemp("race_spm") / "spm", 400, flavor="bert",
                               lowercase=True).spec()


@needs_data
def test_collectives_on_the_engine_device_training_eval_and_race(tmp_path, race_tokenizer):
    run_dir = tmp_path / "gpt"
    ev = run_distributed(_guarded_run, 4, run_dir, race_tokenizer)
    train = [r["train"] for r in ev]
    assert [r["device"] for r in train] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]  # the engine put it on "cuda"
    assert not [v for r in train for v in r["violations"]], train[0]["violations"]
    for r in train:
        # DeepSpeed's start-up broadcasts and DP gradient all-reduce, the TP all-reduces, the DP loss sum
        # and validation: all checked
        assert r["seen"].get("torch.distributed.all_reduce", 0) > 20 and r["seen"].get("torch.distributed.broadcast")
        assert math.isfinite(r["valid"]) and r["valid"] == train[0]["valid"]
    assert [r["device"] for r in ev] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert not [v for r in ev for v in r["violations"]], ev[0]["violations"]
    assert all(r["seen"].get("torch.distributed.all_reduce", 0) > 0 for r in ev)

    # serial references: one process, TP=1, no emulation
    from evaluation.lambada import read_lambada_jsonl
    from evaluation.model import Runtime, load_scorer
    from evaluation.race import race_accuracy
    from evaluation.race_model import multiple_choice_logits
    from evaluation.tasks import DataParallel, lambada_eval, wikitext_eval
    from evaluation.wikitext import first_lines
    from training.models.bert import BertMultipleChoice

    scorer, _, tok = load_scorer(run_dir, Runtime(None, DataParallel(), torch.device("cpu"), True))
    wt = wikitext_eval(scorer, tok, first_lines(WIKITEXT.read_text(encoding="utf-8"), 12), seq_len=32, stride=16,
                       batch_size=3, progress=False)
    lb = lambada_eval(scorer, tok, read_lambada_jsonl(LAMBADA)[:6], batch_size=3, progress=False)
    for r in ev:
        assert r["wikitext"]["scored_targets"] == wt["scored_targets"]
        assert r["wikitext"]["ppl"] == pytest.approx(wt["ppl"], rel=1e-4)
        assert r["lambada"]["accuracy"] == lb["accuracy"]
        assert r["lambada"]["perplexity"] == pytest.approx(lb["perplexity"], rel=1e-4)
    model = BertMultipleChoice(_race_cfg().model, 512, None, seed=5).eval()
    ref = race_accuracy(_race_samples(race_tokenizer), lambda b: multiple_choice_logits(model, b, torch.device("cpu")),
                        progress=False)
    for r in ev:
        assert r["race"]["count"] == ref["count"] == 17
        assert r["race"]["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-9)
