"""The planner's per-rank model state for ZeRO stages 0-3 and ZeRO-Offload (issue 42) against the tensors each
rank really holds, on CPU at DP 2 (TP 1, fp32, the tiny GPT-2 for one step under the real ``Trainer``).

What is measured per rank, after one optimizer step (distinct storages counted once):

* weights: the bytes of the model's parameters this rank keeps between steps: the parameters themselves at
  stages 0-2; at stage 3 each parameter's local partition (``ds_tensor``) plus any parameter still whole
  (DeepSpeed's persistent small parameters; the run sets ``stage3_param_persistence_threshold: 0``, so none);
* optimizer states: every tensor the torch AdamW holds: its parameters when they are not the weights' storage
  (ZeRO's fp32 partitions; ZeRO-3's from DeepSpeed's ``fp32_partitioned_groups_flat``, since it hands them to the
  torch optimizer only for the step; storages shared with the weights would be left out, none are) and its
  ``exp_avg``/``exp_avg_sq`` (Adam's 0-d ``step`` counters left out, as the planner
  does); with offload these are the host's (``host_optimizer``);
* gradients: at stages 0-1 each parameter's ``.grad`` as backward accumulates it (largest seen, summed: the
  full gradients these stages hold until the reduction); at stages 2-3 the ``.grad`` of the optimizer's fp32
  partitions when it steps (the 1/DP gradient partition these stages keep; ZeRO-2 calls the torch optimizer once
  per parameter group, so the storages are collected over the calls; one step, so one set: DeepSpeed allocates
  that flat partition afresh at each step, which ``benchmarks/bench_zero.py`` therefore counts per step).

Each must be within 10 % of :func:`training.plan.memory.zero_state_bytes` for the rank's parameters (the
partitions' alignment padding is the difference at stages 2-3).
"""
from __future__ import annotations

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

CASES = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu"))


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measure(spec, run_dir, zero, offload) -> dict:
    import torch

    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "parallel.zero_stage": zero, "precision.dtype": "fp32",
                                          "parallel.offload_optimizer": offload, "train.iters": 1,
                                          "optimizer.warmup_iters": 0, "train.global_batch_size": 4,
                                          "deepspeed.zero_optimization.stage3_param_persistence_threshold": 0})
    if zero != 3:
        ov = [o for o in ov if "persistence" not in o]
    t = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))
    params = list(t.model.parameters())
    base = t.engine.optimizer
    while not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    full_grads: dict[int, int] = {}
    stepped: dict[int, int] = {}  # storage -> bytes, over the optimizer's calls (ZeRO-2 steps one group a call)

    def read_grad(p):
        if p.grad is not None:
            full_grads[id(p)] = max(full_grads.get(id(p), 0), p.grad.numel() * p.grad.element_size())

    for p in params:
        p.register_post_accumulate_grad_hook(read_grad)

    def at_step(*_):
        for g in base.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    stepped[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()

    base.register_step_pre_hook(at_step)
    t.train_step()
    held = [p.ds_tensor for p in params] + [p.data for p in params if p.numel() > 0] if zero == 3 else params
    weights = _storage_bytes(held)
    weight_storages = {w.untyped_storage().data_ptr() for w in held}
    # ZeRO-3 hands its fp32 partitions to the torch optimizer only for the step: read them from DeepSpeed's list
    own = [p for g in base.param_groups for p in g["params"]] + list(
        getattr(t.engine.optimizer, "fp32_partitioned_groups_flat", []))
    own = [p for p in own if p.untyped_storage().data_ptr() not in weight_storages]  # not the weights themselves
    moments = [v for st in base.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    n = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    grads = sum(full_grads.values()) if zero < 2 else sum(stepped.values())
    return {"n": n, "weights": weights, "grads": grads, "optimizer": _storage_bytes(own + moments)}


def _worker(rank, world, spec, tmp):
    return {f"{zero}-{off}": _measure(spec, f"{tmp}/{zero}-{off}", zero, off) for zero, off in CASES}


@needs_corpus
def test_planner_zero_state_per_rank_within_10_percent_of_measured(spm_model, tmp_path):
    from training.plan.memory import zero_state_bytes

    ranks = run_distributed(_worker, 2, spm_model, str(tmp_path), timeout=900)
    rows = []
    for rank, measured in enumerate(ranks):
        for zero, off in CASES:
            m = measured[f"{zero}-{off}"]
            plan = zero_state_bytes(m["n"], "fp32", 2, zero, off == "cpu")
            planned = {"weights": plan.params, "grads": plan.grads, "optimizer": plan.optimizer + plan.host_optimizer}
            rows.append((rank, zero, off, {k: (m[k], planned[k]) for k in planned}))
            for k, want in planned.items():
                assert abs(m[k] - want) <= 0.10 * want, (rank, zero, off, k, m[k], want)
    print("\n".join(map(str, rows)))
