"""ZeRO stages 0-3 and ZeRO-Offload on CPU at DP 2 or 4 (issue 42): model-state memory per rank and step time.

``python -m benchmarks.bench_zero [--dp 2 --layers 4 --hidden 256 --vocab 8192 --steps 5]``

Each case starts ``--dp`` gloo ranks (TP 1, fp32), builds the GPT-2 under the project's engine
(``training.optim.engine.build_engine``) with the DeepSpeed JSON the trainer derives for the stage
(``training.ds_json.deepspeed_config``), runs warm-up steps on one fixed random batch, then times ``--steps`` steps.
Per rank it reports the model state it holds, measured as ``tests/parallel/test_plan_zero.py`` measures it
(weights kept between steps, ZeRO-3's ``ds_tensor`` partitions; the optimizer's fp32 partitions and Adam moments;
the gradients: full ``.grad``s at stages 0-1, the partition the optimizer steps with at 2-3, counted per step: DeepSpeed
allocates that flat fp32 partition afresh at every step and frees it after, so storages are not summed across steps),
the planner's figure
for it (``training.plan.memory.zero_state_bytes``) and the rank's peak RSS (the whole process: torch, DeepSpeed,
buffers). The step time is the slowest rank's mean.
"""
from __future__ import annotations

import argparse
import logging
import resource
import time
import warnings

from benchmarks import common

CASES = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu"))
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (TP 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per DP rank")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def _storage(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _build(rank: int, world: int, a: dict):
    """(engine, model, tokens, labels): the GPT-2 under the project's engine at ``a``'s ZeRO stage and offload."""
    import torch

    from training.config import config_from_dict
    from training.ds_json import deepspeed_config
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    cfg = config_from_dict({
        "model": {"num_layers": a["layers"], "hidden_size": a["hidden"], "num_attention_heads": a["heads"],
                  "seq_length": a["seq"], "vocab_size": a["vocab"], "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": {"micro_batch_size": a["batch"], "global_batch_size": a["batch"] * world},
        "parallel": {"tensor": 1, "zero_stage": a["zero"], "offload_optimizer": a["offload"]},
        "precision": {"dtype": "fp32"}})
    ps = ParallelState(tp=1)
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(cfg.train.seed)
    model = GPTModel(cfg.model, a["vocab"], ps.tp_group, seed=cfg.train.seed).train()
    opt, sched = build_optimizer(model, cfg.optimizer, 10**6)
    engine = build_engine(model, opt, sched, deepspeed_config(cfg, world, "fp32"), ps)
    gen = torch.Generator().manual_seed(rank)
    seq = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen)
    return engine, model, seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class GradientWatch:
    """The gradients a rank holds: each parameter's ``.grad`` as backward accumulates it (largest seen: stages
    0-1 keep them whole) and the ``.grad`` storages of the torch optimizer's parameters when it steps (stages 2-3:
    the partition; ZeRO-2 calls the optimizer once per group, so they are collected over one engine step's calls
    and :meth:`new_step` starts the next step's: DeepSpeed builds the flat fp32 gradient partition anew at each step
    and frees it after, and the allocator may place it elsewhere each time)."""

    def __init__(self, params, base):
        self.full: dict[int, int] = {}
        self.stepped: dict[int, int] = {}
        self.base = base
        for p in params:
            p.register_post_accumulate_grad_hook(self._read)
        base.register_step_pre_hook(self._at_step)

    def new_step(self) -> None:
        self.stepped = {}

    def _read(self, p) -> None:
        if p.grad is not None:
            self.full[id(p)] = max(self.full.get(id(p), 0), p.grad.numel() * p.grad.element_size())

    def _at_step(self, *_) -> None:
        for g in self.base.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.stepped[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()

    def bytes(self, zero: int) -> int:
        return sum(self.full.values()) if zero < 2 else sum(self.stepped.values())


def _state_bytes(engine, params, base, zero: int) -> dict:
    """Weights kept between steps (ZeRO-3: the partitions) and the optimizer's own tensors, distinct storages."""
    import torch

    held = [p.ds_tensor for p in params] + [p.data for p in params if p.numel() > 0] if zero == 3 else params
    kept = {w.untyped_storage().data_ptr() for w in held}
    own = [p for g in base.param_groups for p in g["params"]] + list(
        getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))
    own = [p for p in own if p.untyped_storage().data_ptr() not in kept]
    moments = [v for st in base.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"weights": _storage(held), "optimizer": _storage(own + moments),
            "n": sum(getattr(p, "ds_numel", p.numel()) for p in params)}


def _worker(rank: int, world: int, a: dict) -> dict:
    import torch

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    engine, model, tokens, labels = _build(rank, world, a)
    params = list(model.parameters())
    base = engine.optimizer
    while not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    watch = GradientWatch(params, base)

    def step() -> float:
        watch.new_step()
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return float(loss)

    for _ in range(a["warmup"]):
        step()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    losses = [step() for _ in range(a["steps"])]
    secs = (time.perf_counter() - t0) / a["steps"]
    return {"secs": secs, "loss": losses[-1], **_state_bytes(engine, params, base, a["zero"]),
            "grads": watch.bytes(a["zero"]), "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from training.plan.memory import zero_state_bytes
    from training.runtime.spawn import run_distributed

    info = common.machine_info()
    rows = []
    for zero, offload in CASES:
        a = {**vars(args), "zero": zero, "offload": offload}
        res = run_distributed(_worker, args.dp, a, timeout=1800.0)
        r = res[0]
        plan = zero_state_bytes(r["n"], "fp32", args.dp, zero, offload == "cpu")
        measured = r["weights"] + r["grads"] + r["optimizer"]
        planned = plan.params + plan.grads + plan.optimizer + plan.host_optimizer
        rows.append([f"{zero}" + (" + offload cpu" if offload == "cpu" else ""), f"{r['weights'] / MIB:.2f}",
                     f"{r['grads'] / MIB:.2f}", f"{r['optimizer'] / MIB:.2f}", f"{measured / MIB:.2f}",
                     f"{planned / MIB:.2f}", f"{max(x['rss'] for x in res) / MIB:.0f}",
                     f"{max(x['secs'] for x in res):.3f}", f"{r['loss']:.6f}"])
    print()
    print(common.markdown_header(info, common.load_average()))
    print(f"- model: GPT-2, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab "
          f"{args.vocab} ({rows and res[0]['n']:,} parameters), micro-batch {args.batch} per rank, fp32, TP 1, DP {args.dp} "
          f"(gloo), {args.steps} timed steps after {args.warmup} warm-up; memory per rank (rank 0)")
    print()
    print(common.markdown_table(
        ["ZeRO stage", "weights MiB", "gradients MiB", "optimizer MiB (host with offload)", "model state MiB",
         "planner MiB", "peak RSS MiB (max rank)", "s/step (slowest rank)", "last loss"], rows))


if __name__ == "__main__":
    main()
