"""fp32 at ZeRO-0: the optimizer step with the TP x PP gradient norm on the device.

DeepSpeed's fp32 step clips through ``runtime.utils.clip_grad_norm_``, which discards the norm and, under its
pipeline engine, counts replicated parameters only on the first stage's first rank. :class:`Fp32Step` clips with
:func:`training.parallel.grad_norm.clip_grad_norm` (every element of the model counted once, the factor applied on
the device, no host read) and then runs the client optimizer (torch's fused AdamW).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from training.optim.outcome import StepOutcome
from training.parallel.grad_norm import clip_grad_norm


class Fp32Step:
    """Clip (when ``clip`` > 0) and step ``optimizer`` over ``params``; the norm stays a device tensor."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], clip: float, tp_rank: int,
                 tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None):
        self.optimizer, self.params, self.clip = optimizer, params, clip
        self.tp_rank, self.tp_group, self.pp_group = tp_rank, tp_group, pp_group

    reads_on_host = False  # nothing to ride along: the step reads nothing
    skipped = None  # every step is applied: no skips to count

    def settle(self) -> None:
        pass

    def step(self) -> StepOutcome:
        norm = None
        if self.clip > 0.0:
            norm = clip_grad_norm(self.params, self.clip, self.tp_rank, self.tp_group, self.pp_group)
        self.optimizer.step()
        return StepOutcome(applied=True, grad_norm=norm, loss_scale=1.0)
