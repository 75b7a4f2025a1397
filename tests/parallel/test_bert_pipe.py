"""BERT in pipeline stages (``training.models.bert_pipe``): PP=2 (every layer recomputed) trains as PP=1 does (fp32,
dropout off: MLM + the binary head's loss over padded batches), resumes bitwise, merges back to the PP=1 names, and
logs the bubble."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.corpora import bert_cfg, botchan_docs, write_bert_corpus
from tests.helpers.distributed import run_distributed

# TP 1, 4 micro-batches of 2 per step, samples often shorter than the sequence (padding), a log line every step
EXTRA = {"parallel": {"tensor": 1}, "train": {"micro_batch_size": 2, "global_batch_size": 8, "log_interval": 1,
                                               "save_interval": 0},
         "bert": {"short_seq_prob": 0.5}}


@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_corpus")
    write_bert_corpus(root, botchan_docs())
    return root


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def _train(rank, world, corpus, base, runs):
    """Each (name, {section: overrides}) run one after the other in ``base/name``."""
    from training.resolve import resolve_run
    from training.trainer import Trainer

    padded = None
    for name, over in runs:
        extra = {k: {**EXTRA.get(k, {}), **over.get(k, {})} for k in {*EXTRA, *over}}
        trainer = Trainer(resolve_run(bert_cfg(corpus, Path(base) / name, extra)))
        trainer.train()
        if padded is None:  # the first step's micro-batches hold padding (the mask crosses the stages)
            batches = list(trainer.task.micro_batches(0))
            masks = [b[0][2] if isinstance(b, tuple) else b["padding_mask"] for b in batches]
            padded = bool(any((m == 0).any() for m in masks))
    return padded


@pytest.fixture(scope="module")
def pp1_run(bert_corpus, tmp_path_factory):
    """The PP=1 reference run (its first batch holds padding)."""
    base = tmp_path_factory.mktemp("bert_pp1")
    assert run_distributed(_train, 1, bert_corpus, str(base), [("pp1", {})])[0]
    return base / "pp1"


def test_bert_pp2_equals_pp1_resumes_and_logs_the_bubble(bert_corpus, pp1_run, tmp_path):
    from training.checkpoint_reader import load_merged_state_dict

    # PP=2 with every layer recomputed (DeepSpeed's checkpoint of the stage tuple: the int64 masks pass through)
    pp2 = {"parallel": {"pipeline": 2}, "model": {"recompute": "full"}}
    runs = [("pp2", pp2), ("part", {**pp2, "train": {"exit_at": 2}}), ("part", pp2)]
    run_distributed(_train, 2, bert_corpus, str(tmp_path), runs)
    ref, got, part = _rows(pp1_run), _rows(tmp_path / "pp2"), _rows(tmp_path / "part")
    assert [r["iteration"] for r in ref] == [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):  # the loss is MLM + sentence order (binary head), as at PP=1
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert ref[0]["loss"] > ref[0]["mlm_loss"] > 0 and ref[0]["sop_loss"] > 0.1
    # stopped at iteration 2 and resumed by a fresh trainer: the same losses, bit for bit
    assert [r["loss"] for r in part] == [r["loss"] for r in got]
    # every step's bubble: the stages' mean and each stage's, fractions of the step's wall time
    for r in got:
        assert 0.0 < r["pipeline_bubble"] < 1.0 and len(r["pipeline_bubble_stages"]) == 2
        assert all(0.0 < f < 1.0 for f in r["pipeline_bubble_stages"])
    assert "pipeline_bubble" not in ref[0]
    # the PP=2 checkpoint merges into BertModel's names and weights (what reshard, export and evaluation read)
    want, _, _ = load_merged_state_dict(pp1_run)
    have, cfg, meta = load_merged_state_dict(tmp_path / "pp2")
    assert meta["parallel"]["pp"] == 2 and sorted(have) == sorted(want)
    assert {"lm_head.bias", "binary_head.weight", "pooler.weight", "final_ln.weight"} <= set(have)
    for name, w in want.items():
        torch.testing.assert_close(have[name], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_bert_tp2_pp2_sequence_parallel_equals_pp1(bert_corpus, pp1_run, tmp_path):
    """TP 2 x PP 2 with sequence parallelism (4 ranks): the stages send their sequence chunk, the heads gather it;
    the PP=1 losses (measured: equal to the last bit) and weights."""
    from training.checkpoint_reader import load_merged_state_dict

    over = {"parallel": {"pipeline": 2, "tensor": 2, "sequence_parallel": True}}
    run_distributed(_train, 4, bert_corpus, str(tmp_path), [("tp2pp2", over)])
    ref, got = _rows(pp1_run), _rows(tmp_path / "tp2pp2")
    assert len(got) == 3
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a["loss"], b["loss"])
    want, _, _ = load_merged_state_dict(pp1_run)
    have, _, meta = load_merged_state_dict(tmp_path / "tp2pp2")
    assert meta["parallel"]["tp"] == meta["parallel"]["pp"] == 2 and sorted(have) == sorted(want)
    for name, w in want.items():  # measured: within 5.2e-7
        torch.testing.assert_close(have[name], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
