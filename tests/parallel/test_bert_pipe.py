"""BERT in pipeline stages (``training.models.bert_pipe``): PP=2 under 1F1B (every layer recomputed), interleaved
1F1B (v = 2, one layer per chunk, recomputed) and DualPipeV trains as PP=1 does (fp32, dropout off: MLM + the binary
head's loss over padded batches; the losses and every gradient before every step within 1e-6 relative), resumes
bitwise, merges back to the PP=1 names, and logs the bubble. At TP=2 with sequence parallelism (one 4-rank launch)
1F1B, interleaved and DualPipeV train as TP=2 at PP=1 does (every gradient within 1e-6) and give PP=1's losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.corpora import bert_cfg, botchan_docs, write_bert_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import rel_gap

# TP 1, 4 layers (PP=2 x v=2 chunks, or DualPipeV's 2 x 2 stages, of one layer), 4 micro-batches of 2 per step, samples often shorter than the sequence (padding), a log line every step
EXTRA = {"parallel": {"tensor": 1}, "model": {"num_layers": 4}, "train": {"micro_batch_size": 2, "global_batch_size": 8, "log_interval": 1,
                                               "save_interval": 0},
         "bert": {"short_seq_prob": 0.5}}


@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_corpus")
    write_bert_corpus(root, botchan_docs())
    return root


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def _hook_grads(trainer) -> list[dict]:
    """This rank's gradients before every optimizer step, by ``BertModel`` name (the last stage's copy of the tied
    embedding module skipped: its word embedding's gradient is rank 0's, reduced over the tied group)."""
    from training.checkpoint_reader import PipeNames, canonical_name

    cfg, engine = trainer.cfg, trainer.engine
    pipe = cfg.parallel.pipeline > 1
    names = {id(p): canonical_name(n, PipeNames.of(cfg.model)) if pipe else n
             for n, p in engine.module.named_parameters() if not getattr(p, "ds_pipe_replicated", False)}
    steps: list[dict] = []
    engine.optimizer.register_step_pre_hook(lambda o, *_: steps.append(
        {names[id(p)]: p.grad.detach().clone() for grp in o.param_groups for p in grp["params"]
         if p.grad is not None and id(p) in names}))
    return steps


def _train(rank, world, corpus, base, runs):
    """Each (name, {section: overrides}) run one after the other in ``base/name``: whether the first batch holds
    padding, each run's engine class and gradients (:func:`_hook_grads`)."""
    from training.resolve import resolve_run
    from training.trainer import Trainer

    padded, grads, engines = None, {}, {}
    for name, over in runs:
        extra = {k: {**EXTRA.get(k, {}), **over.get(k, {})} for k in {*EXTRA, *over}}
        trainer = Trainer(resolve_run(bert_cfg(corpus, Path(base) / name, extra)))
        grads[name], engines[name] = _hook_grads(trainer), type(trainer.engine).__name__
        trainer.train()
        if padded is None:  # the first step's micro-batches hold padding (the mask crosses the stages)
            batches = list(trainer.task.micro_batches(0))
            masks = [b[0][2] if isinstance(b, tuple) else b["padding_mask"] for b in batches]
            padded = bool(any((m == 0).any() for m in masks))
    return {"padded": padded, "grads": grads, "engines": engines, "tp_rank": trainer.ps.tp_rank}


def _merged_grads(ranks, name, tp_rank: int = 0) -> list[dict]:
    """Run ``name``'s gradients of every step, merged over the stages (each rank holds its layers') of TP rank
    ``tp_rank`` (each TP rank's shards are compared with the same TP rank's reference)."""
    ranks = [r for r in ranks if r["tp_rank"] == tp_rank]
    steps = [{} for _ in ranks[0]["grads"][name]]
    for r in ranks:
        for merged, step in zip(steps, r["grads"][name]):
            merged.update(step)
    return steps


@pytest.fixture(scope="module")
def pp1_run(bert_corpus, tmp_path_factory):
    """The PP=1 reference run (its first batch holds padding): its folder and gradients."""
    base = tmp_path_factory.mktemp("bert_pp1")
    ranks = run_distributed(_train, 1, bert_corpus, str(base), [("pp1", {})])
    assert ranks[0]["padded"]
    return base / "pp1", _merged_grads(ranks, "pp1")


def test_bert_pp2_equals_pp1_under_each_schedule_resumes_and_logs_the_bubble(bert_corpus, pp1_run, tmp_path):
    from training.checkpoint_reader import load_merged_state_dict

    pp1_dir, pp1_grads = pp1_run
    # PP=2 with every layer recomputed (DeepSpeed's checkpoint of the stage tuple: the int64 masks pass through)
    pp2 = {"parallel": {"pipeline": 2}, "model": {"recompute": "full"}}
    runs = [("pp2", pp2), ("part", {**pp2, "train": {"exit_at": 2}}), ("part", pp2),
            ("interleaved", {"parallel": {"pipeline": 2, "pipeline_schedule": "interleaved", "virtual_pipeline": 2},
                             "model": {"recompute": "full"}}),
            ("dualpipev", {"parallel": {"pipeline": 2, "pipeline_schedule": "dualpipev"}})]
    ranks = run_distributed(_train, 2, bert_corpus, str(tmp_path), runs, timeout=900)
    assert ranks[0]["engines"] == {"pp2": "PipeEngine", "part": "PipeEngine", "interleaved": "InterleavedPipeEngine",
                                   "dualpipev": "DualPipeEngine"}
    ref, got, part = _rows(pp1_dir), _rows(tmp_path / "pp2"), _rows(tmp_path / "part")
    assert [r["iteration"] for r in ref] == [r["iteration"] for r in got] == [1, 2, 3]
    gaps = {}
    for schedule in ("pp2", "interleaved", "dualpipev"):  # the loss is MLM + sentence order (binary head)
        rows, grads = _rows(tmp_path / schedule), _merged_grads(ranks, schedule)
        assert len(rows) == len(grads) == len(pp1_grads) == 3
        gaps[schedule] = (max(abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in zip(ref, rows)),
                          max(rel_gap(g, r) for g, r in zip(grads, pp1_grads)))  # every tensor, every step
    print("relative gaps to PP=1 (loss, gradient):", gaps)
    for schedule, (loss_gap, grad_gap) in gaps.items():
        assert loss_gap <= 1e-6 and grad_gap <= 1e-6, (schedule, gaps[schedule])
    assert {"lm_head.bias", "binary_head.weight", "pooler.weight", "embedding.word_embeddings.weight"} <= \
        set(pp1_grads[0])
    assert ref[0]["loss"] > ref[0]["mlm_loss"] > 0 and ref[0]["sop_loss"] > 0.1
    # stopped at iteration 2 and resumed by a fresh trainer: the same losses, bit for bit
    assert [r["loss"] for r in part] == [r["loss"] for r in got]
    # every step's bubble: the stages' mean and each stage's, fractions of the step's wall time
    for r in got:
        assert 0.0 < r["pipeline_bubble"] < 1.0 and len(r["pipeline_bubble_stages"]) == 2
        assert all(0.0 < f < 1.0 for f in r["pipeline_bubble_stages"])
    assert "pipeline_bubble" not in ref[0]
    # the PP=2 checkpoint merges into BertModel's names and weights (what reshard, export and evaluation read)
    want, _, _ = load_merged_state_dict(pp1_dir)
    have, cfg, meta = load_merged_state_dict(tmp_path / "pp2")
    assert meta["parallel"]["pp"] == 2 and sorted(have) == sorted(want)
    assert {"lm_head.bias", "binary_head.weight", "pooler.weight", "final_ln.weight"} <= set(have)
    for name, w in want.items():
        torch.testing.assert_close(have[name], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_bert_tp2_pp2_sequence_parallel_equals_pp1(bert_corpus, pp1_run, tmp_path):
    """TP 2 with sequence parallelism (4 ranks): PP=2 under 1F1B, interleaved (v = 2) and DualPipeV against TP 2 at
    PP=1 (two data-parallel replicas, the same global batch): the stages send their sequence chunk, the heads gather
    it; every gradient before every step within 1e-6 relative (each TP rank's shards against the same TP rank's),
    the PP=1 losses (measured: equal to the last bit) and weights."""
    from training.checkpoint_reader import load_merged_state_dict

    sp = {"tensor": 2, "sequence_parallel": True}
    runs = [("tp2pp1", {"parallel": sp}), ("tp2pp2", {"parallel": {**sp, "pipeline": 2}}),
            ("interleaved", {"parallel": {**sp, "pipeline": 2, "pipeline_schedule": "interleaved",
                                          "virtual_pipeline": 2}}),
            ("dualpipev", {"parallel": {**sp, "pipeline": 2, "pipeline_schedule": "dualpipev"}})]
    ranks = run_distributed(_train, 4, bert_corpus, str(tmp_path), runs, timeout=900)
    assert [ranks[0]["engines"][n] for n, _ in runs[1:]] == ["PipeEngine", "InterleavedPipeEngine", "DualPipeEngine"]
    ref = _rows(pp1_run[0])
    gaps = {}
    for name in ("tp2pp1", "tp2pp2", "interleaved", "dualpipev"):
        got = _rows(tmp_path / name)
        assert [r["iteration"] for r in got] == [1, 2, 3]
        loss_gap = max(abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in zip(ref, got))
        grad_gap = 0.0 if name == "tp2pp1" else max(
            rel_gap(g, r) for t in (0, 1)
            for g, r in zip(_merged_grads(ranks, name, t), _merged_grads(ranks, "tp2pp1", t)))
        gaps[name] = (loss_gap, grad_gap)
    print("TP=2 + SP relative gaps (loss to PP=1 TP=1, gradient to PP=1 TP=2):", gaps)
    for name, (loss_gap, grad_gap) in gaps.items():
        assert loss_gap <= 1e-6 and grad_gap <= 1e-6, (name, gaps[name])
    want, _, _ = load_merged_state_dict(pp1_run[0])
    for name in ("tp2pp2", "interleaved", "dualpipev"):
        have, _, meta = load_merged_state_dict(tmp_path / name)
        assert meta["parallel"]["tp"] == meta["parallel"]["pp"] == 2 and sorted(have) == sorted(want)
        for key, w in want.items():  # measured: within 5.2e-7
            torch.testing.assert_close(have[key], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=(name, key): f"{n}: {m}")
