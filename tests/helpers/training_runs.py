"""Short training runs of ``configs/gpt2_tiny.yaml`` on Botchan, shared by the training, fp16, compile, planner,
optimizer-step, Llama and reshard tests: the overrides, the rank worker ``run_distributed`` starts, and the
sentencepiece model the ``spm_model`` fixture (tests/conftest.py) trains once per session."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]

BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
needs_corpus = pytest.mark.skipif(not BOTCHAN.is_file(), reason="../shared/data/corpus/botchan.txt not present")


def train_spm_model(folder: Path) -> dict:
    """The spec of a 1000-piece sentencepiece model trained on Botchan (small vocab keeps CPU runs fast)."""
    from data_pipeline.tokenizer_train import train_sentencepiece

    lines = [line for line in BOTCHAN.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok = train_sentencepiece(lines, folder / "botchan", vocab_size=1000, flavor="gpt", seed=1)
    return tok.spec()


def tiny_overrides(spec: dict, run_dir: Path, **extra) -> list[str]:
    """``a.b=value`` overrides of configs/gpt2_tiny.yaml: Botchan text, the tokenizer ``spec``, no dropout, sequence 32."""
    base = {
        "data.corpus": "null",
        "data.text_files": f"[{BOTCHAN}]",
        "data.tokenizer": json.dumps(spec),
        "run.dir": str(run_dir),
        "train.progress_bar": "false",
        "model.hidden_dropout": "0.0",
        "model.attention_dropout": "0.0",
        "model.seq_length": "32",
        "train.micro_batch_size": "2",
        "train.global_batch_size": "8",
        "optimizer.warmup_iters": "1",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def train_worker(rank, world, overrides, inject=None):
    """Rank worker: train configs/gpt2_tiny.yaml with ``overrides``; rank 0 returns the losses. With ``inject``
    ({steps, overflow_at}) it steps by hand and makes one gradient inf on the chosen steps."""
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer, TrainingAborted

    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides)
    trainer = Trainer(resolve_run(cfg))
    if inject is None:
        out = trainer.train()
        return {"losses": [json.loads(line)["loss"] for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
                           if "event" not in json.loads(line)] if rank == 0 else None,
                "valid": out["valid_loss"]}
    # fp16 overflow injection: a gradient hook turns one parameter's gradient into inf on chosen steps
    param = trainer.model.layers[0].mlp.fc.weight
    state = {"on": False}
    param.register_hook(lambda g: g * float("inf") if state["on"] else g)
    records = []
    try:
        for it in range(inject["steps"]):
            state["on"] = it in inject["overflow_at"]
            before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
            m = trainer.train_step()
            changed = any(not torch.equal(before[n], p.detach().float()) for n, p in trainer.model.named_parameters())
            records.append({"applied": m["step_applied"], "scale": m["loss_scale"], "skipped": m["skipped"],
                            "changed": changed, "lr": m["lr"]})
    except TrainingAborted as e:
        return {"records": records, "aborted": str(e)}
    return {"records": records, "aborted": None}


def train_stages(rank, world, overrides, stages):
    """Rank worker: one Trainer run per entry of ``stages`` (extra overrides), one after the other."""
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    for extra in stages:
        Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides + extra))).train()
    return None


def metric_steps(run_dir: Path) -> dict:
    """iteration -> (loss, lr) of a run's metrics.jsonl training rows."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["loss"], r["lr"]) for r in rows if "event" not in r}


def resume_worker(rank, world, overrides, base):
    """Train gpt2_tiny to the end (base/full), and again stopping at iteration 2 and resuming in a fresh
    trainer (base/part); returns both runs' metrics rows."""
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    def rows(cfg):
        return [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]

    config = ROOT / "configs" / "gpt2_tiny.yaml"
    full = load_config(config, overrides + [f"run.dir={base}/full"])
    Trainer(resolve_run(full)).train()
    part = load_config(config, overrides + [f"run.dir={base}/part", "train.exit_at=2"])
    Trainer(resolve_run(part)).train()                     # stops (and saves) at iteration 2
    part = load_config(config, overrides + [f"run.dir={base}/part"])
    Trainer(resolve_run(part)).train()                     # a fresh trainer resumes from the checkpoint
    return rows(full), rows(part)
