"""The pipeline bubble measured next to the formula: equal-cost stages on CPU (gloo), the project's PipeEngine.

    .venv/bin/python -m benchmarks.bench_pipeline_bubble --pp 2 4 --micro 4 8 --reps 3

Every stage holds the same ``--layers-per-stage`` MLP blocks (hidden -> 4 hidden -> hidden, GeLU) on a
[batch, hidden] activation, so the stages cost the same and the only idle time is the schedule's. Each rank runs
``--steps`` training steps (``train_batch``, after ``--warmup``) and reads its ``comm_timer``
(``training.optim.pipe_bubble``, the value behind ``pipeline_bubble`` in metrics.jsonl): the host seconds its
send/receive instructions took over the steps' wall seconds. The table puts that fraction f (mean over the stages,
with the stages' min-max over repetitions) next to the schedule's expected fraction, and f / (1 - f), the idle time
over the ideal step, next to the paper's bubble formula ((p - 1) / m for 1F1B).

A schedule is a row of :data:`SCHEDULES` (its formulas and the cells its rules refuse) and of :data:`BUILDERS` (the
module its stages run as; ``build_engine`` picks the engine by the module's class): 1F1B (DeepSpeed's
``PipelineModule``), interleaved 1F1B with v = :data:`V` chunks per rank (the project's ``InterleavedPipeModule``) and
DualPipeV (DeepSpeed's ``DualPipeVModule``, 2p stages, two per rank). Every schedule gets the same
``--layers-per-stage`` blocks per rank, so the rows compare: interleaved cuts them into v chunks of
layers-per-stage / v blocks, DualPipeV into two stages of layers-per-stage / 2. A cell a schedule's rules refuse
(interleaved: m a multiple of p; DualPipeV: m >= 2p; the blocks of a rank splitting evenly) is skipped with a note.
Ranks run one intra-op thread each; more ranks than cores (PP=4 on 2 cores) time-share the cores, which stretches
the steady state and the measured waits alike (the table notes it).
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks import common

V = 2  # model chunks per rank of the interleaved row (Megatron's virtual pipeline size)


def no_rule(p: int, m: int, layers_per_stage: int) -> str | None:
    return None


def interleaved_rule(p: int, m: int, layers_per_stage: int) -> str | None:
    if m % p:
        return f"m = {m} is not a multiple of p = {p} (interleaved 1F1B)"
    if layers_per_stage % V:
        return f"{layers_per_stage} blocks per rank do not split into v = {V} chunks"
    return None


def dualpipev_rule(p: int, m: int, layers_per_stage: int) -> str | None:
    if m < 2 * p:
        return f"m = {m} < 2p = {2 * p} (DualPipeV)"
    if layers_per_stage % 2:
        return f"{layers_per_stage} blocks per rank do not split into DualPipeV's two stages"
    return None


def over_fraction(over_ideal: Callable[[int, int], float]) -> Callable[[int, int], float]:
    """The idle fraction of the wall time for a bubble b over the ideal step: b / (1 + b)."""
    return lambda p, m: over_ideal(p, m) / (1 + over_ideal(p, m))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as the benchmark runs it: its expected idle fraction of the step's wall time and its
    bubble over the ideal step (the paper's formula), for p stages and m micro-batches; ``refuse`` names why a cell
    (p, m, blocks per rank) breaks the schedule's rules, or None."""

    name: str
    fraction: Callable[[int, int], float]
    over_ideal: Callable[[int, int], float]
    formula: str
    refuse: Callable[[int, int, int], str | None] = no_rule


def interleaved_over(p: int, m: int) -> float:
    return (p - 1) / (V * m)


def dualpipev_over(p: int, m: int) -> float:
    # training.plan.timing.bubble_fraction: DeepSpeed's DualPipeVSchedule with a backward twice the forward
    return (5 * p - 6) / (6 * m)


SCHEDULES = {
    # DeepSpeed's TrainSchedule (PipeDream-Flush): (p - 1) forward+backward slots idle out of m + p - 1
    "1f1b": Schedule("1f1b", lambda p, m: (p - 1) / (m + p - 1), lambda p, m: (p - 1) / m, "(p-1)/m"),
    # Megatron's interleaved 1F1B: (p - 1) chunk slots (1/v of a stage each) idle out of v m + p - 1
    "interleaved": Schedule("interleaved", over_fraction(interleaved_over), interleaved_over, f"(p-1)/({V}m)",
                            interleaved_rule),
    "dualpipev": Schedule("dualpipev", over_fraction(dualpipev_over), dualpipev_over, "(5p-6)/(6m)",
                          dualpipev_rule),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="+", default=["1f1b"], choices=sorted(SCHEDULES))
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees (one rank per stage)")
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches per step (m)")
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    return ap.parse_args(argv)


class Block(torch.nn.Module):
    """hidden -> 4 hidden -> GeLU -> hidden, with a residual: one unit of stage cost."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def blocks(a: dict, ps) -> list:
    """``--layers-per-stage`` blocks per pipeline rank, as DeepSpeed layer specs (every schedule gets the same)."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(Block, a["hidden"]) for _ in range(a["layers_per_stage"] * ps.dims.pp)]


def build_1f1b(a: dict, ps):
    """Equal stages as one ``PipelineModule`` (DeepSpeed's 1F1B under the project's ``PipeEngine``)."""
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=blocks(a, ps), topology=ps.topology, partition_method="uniform", loss_fn=mse)


def build_interleaved(a: dict, ps):
    """The project's ``InterleavedPipeModule``: p v chunks of layers_per_stage / v blocks, rank r holding chunks
    r, r + p, ... (``InterleavedPipeEngine``)."""
    from training.models.pipe_chunks import InterleavedPipeModule

    return InterleavedPipeModule(layers=blocks(a, ps), topology=ps.topology, partition_method="uniform", loss_fn=mse,
                                 virtual_pipeline=V)


def build_dualpipev(a: dict, ps):
    """DeepSpeed's ``DualPipeVModule``: 2p stages of layers_per_stage / 2 blocks, rank r holding stages r and
    2p-1-r (``DualPipeEngine``; rank 0 loads the data and computes the loss)."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    return DualPipeVModule(layers=blocks(a, ps), topology=ps.topology, partition_method="uniform", loss_fn=mse)


BUILDERS = {"1f1b": build_1f1b, "interleaved": build_interleaved, "dualpipev": build_dualpipev}


def stage_worker(rank: int, world: int, a: dict) -> dict:
    from training.optim.engine import build_engine
    from training.parallel.state import ParallelState

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ps = ParallelState(tp=1, pp=world)
    model = BUILDERS[a["schedule"]](a, ps)
    m, b = a["micro"], a["batch"]
    ds_config = {"train_batch_size": b * m, "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
                 "steps_per_print": 10**9, "wall_clock_breakdown": False}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = build_engine(model, optimizer, None, ds_config, ps)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(b, a["hidden"], generator=g), torch.randn(b, a["hidden"], generator=g)) for _ in range(m)]
    for _ in range(a["warmup"]):
        engine.train_batch(iter(batches))
    engine.comm_timer.read()  # from here on
    start = time.perf_counter()
    for _ in range(a["steps"]):
        engine.train_batch(iter(batches))
    secs = (time.perf_counter() - start) / a["steps"]
    return {"fraction": engine.comm_timer.read(), "secs": secs}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from training.runtime.spawn import run_distributed

    info = common.machine_info()
    base = {k: getattr(args, k) for k in ("hidden", "batch", "layers_per_stage", "steps", "warmup")}
    cells, skipped = [], []
    for s, p, m in ((s, p, m) for s in args.schedules for p in args.pp for m in args.micro):
        why = SCHEDULES[s].refuse(p, m, args.layers_per_stage)
        if why:
            skipped.append(f"{s} p={p} m={m}: {why}")
        else:
            cells.append((s, p, m))
    stage_fractions: dict[tuple, list[list[float]]] = {c: [] for c in cells}

    def launch(cell: tuple) -> float:
        s, p, m = cell
        res = run_distributed(stage_worker, p, {**base, "schedule": s, "micro": m}, timeout=1800.0)
        stage_fractions[cell].append([r["fraction"] for r in res])
        return max(r["secs"] for r in res)

    secs = common.interleaved({c: functools.partial(launch, c) for c in cells}, args.reps)
    cores = os.cpu_count() or 1
    rows = []
    for cell in cells:
        s, p, m = cell
        sched = SCHEDULES[s]
        means = common.Samples([sum(f) / len(f) for f in stage_fractions[cell]])
        stages = [x for f in stage_fractions[cell] for x in f]
        over = common.Samples([f / (1 - f) for f in means.values])
        rows.append([s, str(p), str(m), means.fmt(".3f"), f"{min(stages):.3f}-{max(stages):.3f}",
                     f"{sched.fraction(p, m):.3f}", over.fmt(".3f"), f"{sched.over_ideal(p, m):.3f}",
                     secs[cell].fmt(".3f"), "yes" if p > cores else "no"])
    print()
    print(common.markdown_header(info, common.load_average()))
    print(f"- stages: {args.layers_per_stage} MLP blocks each (hidden {args.hidden} -> {4 * args.hidden}), "
          f"micro-batch [{args.batch}, {args.hidden}] fp32, SGD; one intra-op thread per rank; {args.reps} interleaved "
          f"repetitions x {args.steps} steps after {args.warmup} warm-up")
    print()
    print(common.markdown_table(
        ["schedule", "p", "m", "measured f (stage mean) median [min-max]", "f per stage min-max",
         "expected f", "measured f/(1-f)", "formula", "s/step", "ranks > cores"], rows))
    print()
    print("f: the fraction of the step's wall time a stage spent in send/receive (pipeline_bubble); expected f: "
          "formula / (1 + formula) (1F1B: (p-1)/(m+p-1)); formula: the bubble over the ideal step, " +
          ", ".join(f"{k} {v.formula}" for k, v in SCHEDULES.items() if k in args.schedules))
    for note in skipped:
        print(f"skipped {note}")


if __name__ == "__main__":
    main()
