"""What one optimizer step did, as one value.

Every step the engine takes (the project's own, :mod:`training.optim.mixed_precision` and
:mod:`training.optim.bf16_partitioned` and :mod:`training.optim.fp32`, or DeepSpeed's where the project does not
own it: ZeRO) ends in a :class:`StepOutcome`. Values the host has not read yet stay device tensors: bf16 decides
its skip on the device, and a norm is read only on a log step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutcome:
    applied: bool | torch.Tensor  # the update was applied (a device 1.0/0.0 when the device decided it)
    grad_norm: float | torch.Tensor | None  # the unscaled global norm before clipping (None: skipped, or not taken)
    loss_scale: float | torch.Tensor  # the loss scale for the next step (1.0 without fp16; a device scalar when
    # fp16 is decided on the device)
    read: tuple[float, ...] | None = None  # values staged with ride_along, read with the step's one host read
    # device-side skips not yet known to the host (bf16): skipped steps since the last settle, and the longest
    # run of consecutive skipped steps since then; None when the host decides every skip
    pending_skips: torch.Tensor | None = None
    longest_skip_run: torch.Tensor | None = None

    @property
    def decided_on_device(self) -> bool:
        return isinstance(self.applied, torch.Tensor)


def deepspeeds_outcome(optimizer, applied: bool, grad_norm, fp16: bool) -> StepOutcome:
    """The outcome of a step DeepSpeed took itself (ZeRO optimizers, ``BF16_Optimizer``, the A/B baseline)."""
    return StepOutcome(applied=bool(applied), grad_norm=grad_norm if applied else None,
                       loss_scale=loss_scale_of(optimizer) if fp16 else 1.0)


def loss_scale_of(optimizer) -> float:
    """The current loss scale of a DeepSpeed fp16 optimizer: ``cur_scale`` (ZeRO, older releases) or
    ``loss_scale_config.cur_scale`` (the ZeRO-0 wrappers of 0.19)."""
    for holder in (optimizer, getattr(optimizer, "loss_scale_config", None), getattr(optimizer, "loss_scaler", None)):
        if holder is not None and getattr(holder, "cur_scale", None) is not None:
            return float(holder.cur_scale)
    raise RuntimeError(f"cannot find the loss scale of {type(optimizer).__name__}")
