"""The planner against the engine's real tensors (issue 15 item 5, first part).

A tiny GPT-2 is trained for one step by the real ``Trainer`` under DeepSpeed on 1 to 4 gloo ranks (TP 1/2/4,
PP 2, ZeRO-1 over DP 2; fp32 and fp16); each rank then adds up the bytes of the tensors it really holds, and
the planner's per-rank numbers (``stage_params`` x ``state_bytes_per_param``, the inputs of ``memory``) must
equal them exactly:

* weights: the model's parameters on that rank (fp16 after DeepSpeed's ``half()`` in fp16 runs);
* gradients: the ``.grad`` of those parameters, read as backward accumulates it and when the optimizer
  steps (ZeRO-1 frees them before the step; DeepSpeed's pipeline sets some directly);
* optimizer: every tensor the base torch optimizer holds beyond the model's parameters, its fp32 master
  copies (fp16; and ZeRO-1's fp32 partition in every dtype) and the Adam moments ``exp_avg``/``exp_avg_sq``,
  distinct storages counted once. Adam's per-tensor ``step`` counters (0-d, 4 bytes per parameter
  *tensor*, not per parameter) are not counted: the planner does not model them.

With ZeRO-1 (DP 2) the optimizer part is the rank's partition: ``ZERO_OPTIMIZER_BYTES_PER_PARAM`` / d per
parameter (12 in fp32 too: before this check the planner said 8).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides
from training.config import load_config
from training.layout import Layout
from training.plan.accounting import ModelShape, stage_params
from training.plan.memory import ZERO_OPTIMIZER_BYTES_PER_PARAM, memory, state_bytes_per_param

VOCAB = 1000  # test_training's sentencepiece model; padded to 1024 at TP 1, 2 and 4


def _run_overrides(spec: dict, run_dir: Path, tp: int, pp: int, dtype: str, zero: int) -> list[str]:
    extra = {"train.global_batch_size": 4, "train.iters": 1, "optimizer.warmup_iters": 0, "parallel.tensor": tp,
             "parallel.pipeline": pp, "precision.dtype": dtype, "parallel.zero_stage": zero}
    if dtype == "fp16":  # a small scale: no overflow skips Adam's first step
        extra.update({"precision.allow_fp16_on_cpu": "true", "precision.initial_scale_power": 4})
    return tiny_overrides(spec, run_dir, **extra)


def _storage_bytes(tensors: list) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of a flat buffer counts the buffer once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _measure_worker(rank: int, world: int, overrides: list[str]) -> dict:
    import torch

    from training.resolve import resolve_run
    from training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides)
    trainer = Trainer(resolve_run(cfg))
    params = list(trainer.model.parameters())
    base = trainer.engine.optimizer  # DeepSpeed's fp16 wrapper holds the torch optimizer as .optimizer
    while not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    grads: dict[int, int] = {}

    def read_grad(p: torch.Tensor) -> None:
        if p.grad is not None:
            grads[id(p)] = max(grads.get(id(p), 0), p.grad.numel() * p.grad.element_size())

    for p in params:  # as backward accumulates it ...
        p.register_post_accumulate_grad_hook(read_grad)
    def read_grads(*_: object) -> None:  # ... and as the optimizer steps (DeepSpeed sets some directly, e.g.
        for p in params:                  # the last stage's unused position table)
            read_grad(p)

    base.register_step_pre_hook(read_grads)
    applied = trainer.train_step()["step_applied"]  # an fp16 overflow would skip Adam's first step

    model_ids = {id(p) for p in params}
    masters = [p for g in base.param_groups for p in g["params"] if id(p) not in model_ids]
    moments = [v for state in base.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"applied": applied, "stage": trainer.ps.pp_rank, "padded_vocab": trainer.padded_vocab, "dtype": trainer.dtype,
            "weights": _storage_bytes(params), "weights_elements": sum(p.numel() for p in params),
            "grads": sum(grads.values()), "with_grad": len(grads), "params": len(params),
            "optimizer": _storage_bytes(masters + moments)}


def _measure_each(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Rank worker: ``_measure_worker`` for each overrides list of ``runs``, one after the other."""
    return [_measure_worker(rank, world, overrides) for overrides in runs]


LAYOUTS = [(1, 1, 1, 0, "fp32"), (2, 1, 1, 0, "fp16"), (4, 1, 1, 0, "fp32"), (1, 2, 1, 0, "fp32"), (2, 2, 1, 0, "fp16"),
           (1, 1, 2, 1, "fp32"), (2, 1, 2, 1, "fp16")]  # tp, pp, dp, zero, dtype


@pytest.fixture(scope="module")
def measured(spm_model, tmp_path_factory) -> dict:
    """{layout: (its overrides, per rank ``_measure_worker``'s measurements)}: one launch per world size."""
    root = tmp_path_factory.mktemp("plan_measured")
    out = {}
    for world in sorted({tp * pp * dp for tp, pp, dp, _, _ in LAYOUTS}):
        group = [lay for lay in LAYOUTS if lay[0] * lay[1] * lay[2] == world]
        runs = [_run_overrides(spm_model, root / "-".join(map(str, lay)), lay[0], lay[1], lay[4], lay[3]) for lay in group]
        ranks = run_distributed(_measure_each, world, runs, timeout=600 * len(group))
        out.update({lay: (over, [r[i] for r in ranks]) for i, (lay, over) in enumerate(zip(group, runs))})
    return out


@needs_corpus
@pytest.mark.parametrize("tp,pp,dp,zero,dtype", LAYOUTS, ids=lambda v: str(v))
def test_planner_state_bytes_equal_the_engines_tensors(measured, tp, pp, dp, zero, dtype):
    overrides, ranks = measured[(tp, pp, dp, zero, dtype)]
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides + [f"model.vocab_size={VOCAB}"])
    shape = ModelShape.from_config(cfg.model, tp, cfg.bert)
    per_stage = stage_params(shape, tp, pp)
    wb, gb, ob = state_bytes_per_param(dtype)
    for r in ranks:
        assert r["applied"] and r["dtype"] == dtype and r["padded_vocab"] == shape.vocab
        n = per_stage[r["stage"]]
        assert r["weights_elements"] == n
        assert r["with_grad"] == r["params"]  # every parameter holds a gradient
        optimizer = ZERO_OPTIMIZER_BYTES_PER_PARAM * n // dp if zero else ob * n
        assert (r["weights"], r["grads"], r["optimizer"]) == (wb * n, gb * n, optimizer), r
    assert sorted({r["stage"] for r in ranks}) == list(range(pp))
    # the report's numbers: the stage the planner finds most loaded (state + activations; with fp32
    # activations that can be stage 0, which holds more micro-batches in flight) is one the engine measured
    mem = memory(shape, Layout(tp=tp, pp=pp, dp=dp, micro_batch=cfg.train.micro_batch_size,
                               global_batch=cfg.train.global_batch_size), dtype)
    picked = [r for r in ranks if r["weights"] == mem.params]
    assert picked, (mem, ranks)
    assert (mem.grads, mem.optimizer_zero1 if zero else mem.optimizer) == (picked[0]["grads"], picked[0]["optimizer"])
