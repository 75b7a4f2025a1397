"""The learning-rate schedule: Megatron's formula (:func:`lr_at`), held on the device and advanced by the step's own
applied flag (:class:`DeviceLRSchedule`).

Megatron's ``AnnealingLR`` (HEAD ``OptimizerParamScheduler``) to the number. With n = the number of updates
already applied: warmup ``lr = max_lr * n / W`` while n <= W, then the fixed decay formula (r = (n - W) / (D - W);
cosine coefficient 0.5 (cos(pi r) + 1), linear 1 - r; lr = min_lr + coeff (max_lr - min_lr); n > D -> min_lr).
Megatron steps its scheduler *after* the optimizer (and builds it with ``step(0)``), so with warmup the first
update runs at lr 0 and the rate reaches max_lr at update W + 1. DeepSpeed's own ``WarmupCosineLR`` does not fit:
it rejects a warmup of 0 steps and its decay is one step ahead of Megatron's formula.

The schedule counts *applied* updates: a skipped step (an fp16 overflow, a non-finite bf16 gradient) does not
advance it. When the step decides the skip on the device (:class:`~training.optim.mixed_precision.
MixedPrecisionStep` around torch's fused AdamW) the host does not know whether a step was applied until it reads,
so a host-side schedule either reads every step or steps blindly and is set back later (the steps between a skip
and the read then run one rate ahead).

:class:`DeviceLRSchedule` keeps the schedule where the decision is:

- the rate of update ``n`` for every ``n`` up to the end of warmup and decay is computed once on the host by
  :func:`lr_at` (so every value is bitwise the host formula's) into a table on the device;
- the count of applied updates is a device integer; :meth:`DeviceLRSchedule.step` adds the step's applied flag
  (a device 0/1, or 1 when the host knows the step was applied) and gathers the next rate from the table into
  one device scalar that every parameter group of torch's fused AdamW reads as its ``lr`` (a tensor learning
  rate: the kernel reads it on the device). Three small kernels per step, no host read, nothing to settle;
- the count is read on the host only for a checkpoint (:meth:`DeviceLRSchedule.state_dict`); a checkpoint of a
  ``LambdaLR`` (its ``last_epoch`` is the same count) loads too.

The rate is float64 on the CPU (its fused kernel computes the step size in double, as from a Python float) and
float32 on CUDA (its fused kernel reads a float32 rate and computes in float32, as it does with a Python float),
so updates are bitwise those of the same schedule held as Python floats.
"""
from __future__ import annotations

import math

import torch

from training.config import OptimizerConfig


def lr_at(it: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """Learning rate of the update taken after ``it`` applied updates (Megatron's ``num_steps``)."""
    warm = cfg.warmup_iters
    decay_end = cfg.decay_iters if cfg.decay_iters is not None else train_iters
    if warm > 0 and it <= warm:
        return cfg.lr * it / warm  # update 0 runs at lr 0, as in Megatron
    if cfg.decay_style == "constant":
        return cfg.lr
    if it > decay_end or decay_end <= warm:
        return cfg.min_lr
    r = (it - warm) / (decay_end - warm)
    coeff = 0.5 * (math.cos(math.pi * r) + 1.0) if cfg.decay_style == "cosine" else 1.0 - r
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def rate_dtype(device: torch.device) -> torch.dtype:
    """The dtype torch's fused Adam kernels read a tensor learning rate in on ``device``."""
    return torch.float64 if device.type == "cpu" else torch.float32


class DeviceLRSchedule:
    """Megatron's warmup + decay schedule as a device table indexed by the device count of applied updates.

    Installs its rate tensor as ``lr`` of every parameter group of ``optimizer`` (torch's fused Adam/AdamW). The
    engine calls :meth:`step` after each optimizer step: with no argument for an update the host knows was
    applied (DeepSpeed's own steps call it that way, and only on applied steps), with ``applied`` (a device 0/1
    tensor) for a step whose skip was decided on the device."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, train_iters: int):
        self.optimizer = optimizer
        warm = cfg.warmup_iters
        decay_end = cfg.decay_iters if cfg.decay_iters is not None else train_iters
        last = max(warm, decay_end) + 1  # from here on the rate no longer changes (min_lr, or lr when constant)
        self.rates = torch.tensor([lr_at(n, cfg, train_iters) for n in range(last + 1)], dtype=torch.float64)
        self.applied = torch.zeros((), dtype=torch.int64)
        self.table = self.lr = None  # placed by install(), on the optimizer's device
        self.install()

    def install(self, device: torch.device | None = None) -> None:
        """Point every parameter group's ``lr`` at this schedule's rate, on ``device`` (default: where the groups'
        parameters are now, or where the rate already is when the groups hold none, as ZeRO-3's between its
        sub-group steps): at construction, after the engine was built (ZeRO-Offload steps on host partitions) and
        after an optimizer's ``load_state_dict`` replaced the groups' values with the checkpoint's."""
        if device is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            device = params[0].device if params else self.lr.device if self.lr is not None else torch.device("cpu")
        if self.lr is None or self.lr.device != device:
            self.table = self.rates.to(device, rate_dtype(device))
            self.applied = self.applied.to(device)
            self.lr = torch.empty((), dtype=self.table.dtype, device=device)
            self._refresh()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def _refresh(self) -> None:
        index = self.applied.clamp(max=self.table.numel() - 1)
        torch.index_select(self.table, 0, index.reshape(1), out=self.lr.view(1))

    def step(self, applied: torch.Tensor | None = None) -> None:
        """After an optimizer step: count it (``applied`` None: applied; a device 0/1: as it says) and set the
        rate of the next one."""
        if applied is None:
            self.applied.add_(1)
        else:
            self.applied.add_(applied.to(torch.int64))
        self._refresh()

    def rate(self) -> torch.Tensor:
        """The rate the next update will use, as a device scalar of its own (not the live one)."""
        return self.lr.clone()

    def get_last_lr(self) -> list[torch.Tensor]:
        """DeepSpeed's and torch's scheduler interface: the groups' current rate."""
        return [self.lr for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """The count of applied updates (one host read: checkpoints only). ``last_epoch`` is the name
        ``LambdaLR`` gives the same count."""
        return {"last_epoch": int(self.applied.item())}

    def load_state_dict(self, state: dict) -> None:
        """Restore the count (this schedule's checkpoints and a ``LambdaLR``'s) and re-install the rate."""
        if not isinstance(state.get("last_epoch"), int) or state["last_epoch"] < 0:
            raise ValueError(f"learning-rate schedule state without a count of applied updates: {sorted(state)}")
        self.applied.fill_(state["last_epoch"])
        self._refresh()
        self.install()
