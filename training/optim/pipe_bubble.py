"""The pipeline bubble measured: host time each rank waits on pipeline communication in a training step.

DeepSpeed's pipeline engine runs a schedule (``PipeSchedule``) as a stream of instructions, each executed through
the class's ``_INSTRUCTION_MAP``. :func:`timed_instructions` wraps the ones that wait on other stages (the
point-to-point ``SendActivation``, ``RecvActivation``, ``SendGrad``, ``RecvGrad``, and ``ReduceTiedGrads``, the
all-reduce of the tied embedding's gradient between the first and last stage) so that every call adds its host wall
time to the engine's :class:`CommTimer`. :class:`BubbleTimed`, a mixin of the project's ``PipeEngine``
(``training.optim.engine``), installs the wrapped map, opens and closes the timer's step around ``train_batch`` and
times the loss broadcast that ends every step (``_aggregate_total_loss``: the stages that finished first wait
there for the first stage's last backward, the schedule's tail). A schedule built on the engine with another
instruction map wraps it the same way.

On gloo (CPU) a send or receive blocks the host until the data has moved, so the time in these instructions is
the time the stage waited on its neighbours plus the copies themselves; on GPU DeepSpeed's p2p calls block the
host as well (``deepspeed.runtime.pipe.p2p``: blocking ``send``/``recv``). The interleaved engine's receives on
NCCL (:mod:`training.optim.pipe_channels`) do not: the device waits, the host only posts, so there its waits show up
in the next host read (the activation metadata, the closing loss broadcast). Nothing here synchronises a device:
the timer reads ``time.perf_counter`` only, and a reader (the trainer on its log steps) turns the sums into a
fraction, gathered over the stages on the device (:func:`gather_stage_fractions`) and read with the step's other
metrics in the log step's one host read.

The fraction reported is ``waited / step wall time`` over the steps since the last read. For p equal stages and
m micro-batches 1F1B idles each stage for (p - 1) forward+backward slots of m + p - 1, so the expected fraction is
(p - 1) / (m + p - 1); the paper's bubble (p - 1) / m is the same time over the ideal step, ``f / (1 - f)``
(:func:`bubble_over_ideal`).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

#: the instructions that wait on other stages
PIPE_COMM_INSTRUCTIONS = (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad,
                          schedule.ReduceTiedGrads,
                          schedule.CommitP2P)  # DualPipeV's batched sends and receives, waited here


class CommTimer:
    """Host seconds spent in pipeline communication and in whole steps, summed since the last :meth:`read`."""

    def __init__(self) -> None:
        self.waited = 0.0  # seconds in p2p instructions during steps since the last read
        self.stepped = 0.0  # wall seconds of those steps
        self._in_step = 0.0  # p2p seconds of the step running now
        self._step_start: float | None = None

    def add(self, seconds: float) -> None:
        """One communication's host time (counted only inside a step: evaluation batches are not steps)."""
        if self._step_start is not None:
            self._in_step += seconds

    def begin_step(self) -> None:
        self._in_step, self._step_start = 0.0, time.perf_counter()

    def end_step(self) -> None:
        if self._step_start is None:
            return
        self.stepped += time.perf_counter() - self._step_start
        self.waited += self._in_step
        self._step_start = None

    def read(self) -> float | None:
        """The fraction of the step wall time spent waiting on communication since the last read (None: no step
        since), and start counting afresh."""
        fraction = self.waited / self.stepped if self.stepped > 0 else None
        self.waited = self.stepped = 0.0
        return fraction


def gather_stage_fractions(timer: CommTimer, group: dist.ProcessGroup | None, stages: int,
                           device: torch.device) -> torch.Tensor:
    """Every stage's :meth:`CommTimer.read` (NaN where no step ran since the last read), first to last, as one
    float64 device tensor [stages]: one all-gather over the pipeline group (collective), no host read, so the reader
    reads it with the step's other metrics (``Trainer.read_metrics``: one host read per log step)."""
    mine = timer.read()
    t = torch.tensor([math.nan if mine is None else mine], dtype=torch.float64, device=device)
    per_stage = [torch.empty_like(t) for _ in range(stages)]
    dist.all_gather(per_stage, t, group=group)
    return torch.cat(per_stage)


def bubble_metrics(per_stage: list[float]) -> dict:
    """``pipeline_bubble`` (the mean over the stages) and ``pipeline_bubble_stages`` (each stage's, first to last)
    from the read values of :func:`gather_stage_fractions`."""
    return {"pipeline_bubble": sum(per_stage) / len(per_stage), "pipeline_bubble_stages": per_stage}


def bubble_over_ideal(fraction: float) -> float:
    """A fraction of the step's wall time spent idle -> the same idle time over the ideal (busy) step, the quantity
    the formula (p - 1) / m of the 1F1B schedule gives."""
    return fraction / (1.0 - fraction)


def _timed(execute: Callable[..., Any]) -> Callable[..., Any]:
    def run(engine, **kwargs):
        start = time.perf_counter()
        try:
            return execute(engine, **kwargs)
        finally:
            engine.comm_timer.add(time.perf_counter() - start)

    run.__name__ = getattr(execute, "__name__", "p2p")
    return run


def timed_instructions(instruction_map: dict[type, Callable[..., Any]]) -> dict[type, Callable[..., Any]]:
    """A copy of an engine's ``_INSTRUCTION_MAP`` whose communication instructions add their host time to
    ``engine.comm_timer``."""
    return {kind: _timed(fn) if kind in PIPE_COMM_INSTRUCTIONS else fn for kind, fn in instruction_map.items()}


class BubbleTimed:
    """Mixin before ``PipelineEngine`` in an engine's bases: ``comm_timer`` (:class:`CommTimer`) sums the host time
    of the step's pipeline communication (the wrapped instructions and the closing loss broadcast) and of each
    ``train_batch``."""

    _INSTRUCTION_MAP = timed_instructions(PipelineEngine._INSTRUCTION_MAP)
    comm_timer: CommTimer

    def __init__(self, *args, **kwargs):
        self.comm_timer = CommTimer()
        super().__init__(*args, **kwargs)

    def train_batch(self, data_iter=None):
        self.comm_timer.begin_step()
        try:
            return super().train_batch(data_iter)
        finally:
            self.comm_timer.end_step()

    def _aggregate_total_loss(self):
        start = time.perf_counter()
        try:
            return super()._aggregate_total_loss()
        finally:
            self.comm_timer.add(time.perf_counter() - start)
