"""Workarounds for DeepSpeed behaviour this project depends on, applied once per process at start-up.

fp16 loss scaling without ZeRO. With ``fp16`` enabled and ZeRO stage 0, DeepSpeed wraps the client
optimizer in ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``, whose ``step()`` divides every gradient by
the current loss scale (and checks the scaled gradients for overflow). Since DeepSpeed's 0.18-0.19
rewrite of ``DeepSpeedEngine.backward``, the engine multiplies the loss by that scale only for ZeRO
optimizers (``scale_if_loss``): at ZeRO-0 the gradients are never scaled up, ``step()`` still divides
them by 2^initial_scale_power, Adam sees gradients ~1e-12 and the model does not train; overflow can
never trigger, so dynamic loss scaling is dead too (DeepSpeed PR #8393, open). This affects every fp16
run at ``parallel.zero_stage: 0``, the pipeline engine included (its last stage calls
``DeepSpeedEngine.backward``).

:func:`apply` restores the documented behaviour: ``DeepSpeedEngine.backward`` multiplies the loss by the
optimizer's current scale, as these optimizers' own ``backward()`` does, when the engine's optimizer is
one of the two and scales (fp16; the bf16 variant has no scaling). It patches only a DeepSpeed whose
``backward`` does not handle fp16 itself (older releases route fp16 through the optimizer's
``backward``; the fix upstream adds such a branch), so a fixed DeepSpeed is left alone.
``tests/parallel/test_fp16_loss_scale.py`` checks the result on the installed version: gradients after
``engine.backward`` equal the fp32 gradients times the scale, and an fp16 step moves the weights as far
as the fp32 step does.

Checkpoint reads. DeepSpeed's ``TorchCheckpointEngine.load`` unpickles with ``weights_only=False``;
:func:`apply` also routes it through ``training.safe_load.load`` (weights only, one-line refusal).
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger(__name__)


def _engine_scales_fp16(backward) -> bool:
    """Whether this DeepSpeed's ``DeepSpeedEngine.backward`` handles the fp16 (non-ZeRO) loss itself."""
    try:
        return "fp16_enabled" in inspect.getsource(backward)
    except (OSError, TypeError):  # no source available: assume a fixed, compiled DeepSpeed
        return True


# The DeepSpeed releases this module (and trainer.loss_scale) was written and tested for; pyproject.toml
# requires the same range and constraints.txt pins the release CI runs.
TESTED_DEEPSPEED = ((0, 19), (0, 20))  # [low, high)


def untested_deepspeed(version: str) -> str | None:
    """One-line warning when ``version`` is outside :data:`TESTED_DEEPSPEED`, else None."""
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED_DEEPSPEED
    if m and lo <= (int(m.group(1)), int(m.group(2))) < hi:
        return None
    return (f"DeepSpeed {version} is untested here (tested: {lo[0]}.{lo[1]}.x): training/runtime/ds_compat.py's fp16 "
            f"loss-scaling repair detects the need by reading DeepSpeed's source; check it with "
            f"tests/parallel/test_fp16_loss_scale.py or install the pinned release (pip install -c constraints.txt deepspeed)")


def apply() -> None:
    """Install the workarounds (idempotent). Call before ``deepspeed.initialize``. Warns once, in one line,
    on a DeepSpeed outside the tested releases."""
    import deepspeed

    from training import safe_load

    safe_load.install()  # DeepSpeed's checkpoint reads with weights_only=True (training/safe_load.py)
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    original = DeepSpeedEngine.backward
    if getattr(original, "_scales_fp16_loss", False):
        return
    warning = untested_deepspeed(deepspeed.__version__)
    if warning and not getattr(DeepSpeedEngine, "_untested_warned", False):
        DeepSpeedEngine._untested_warned = True
        log.warning(warning)
    if _engine_scales_fp16(original):
        return

    @functools.wraps(original)
    def backward(self, loss, *args, **kwargs):
        opt = self.optimizer
        if isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer)) and opt.loss_scale_config.use_grad_scaling:
            scale = opt.loss_scale_config.cur_scale
            # the engine returns the (accumulation-scaled) loss it ran backward on: hand back the unscaled one
            return original(self, loss.float() * scale, *args, **kwargs) / scale
        return original(self, loss, *args, **kwargs)

    backward._scales_fp16_loss = True
    DeepSpeedEngine.backward = backward
    log.debug("DeepSpeedEngine.backward: fp16 loss scaling at ZeRO-0 restored (DeepSpeed PR #8393)")


def undo_initial_zero_step(engine: DeepSpeedEngine) -> bool:
    """Undo the zero-gradient optimizer step DeepSpeed's ZeRO-0 fp16/bf16 wrappers take at construction.

    ``initialize_optimizer_states`` of ``FP16_UnfusedOptimizer`` (torch AdamW) and of ``FP16_Optimizer``
    (DeepSpeed's FusedAdam, what the trainer uses for fp16 on GPU) runs the client optimizer once with
    all-zero gradients to create its state. For AdamW that step changes no moment but counts as step 1 (so
    every later bias correction is one step late: the first real update is 0.744 lr instead of lr) and
    applies one weight decay to the fp32 masters. Megatron's fp16 optimizer has no such step, and ZeRO's
    optimizer does not take it, so fp16 at ZeRO-0 (the pipeline engine included) would drift from fp32 and
    ZeRO-1. Here the optimizer state is dropped (FusedAdam's per-group ``step`` stays 0) and the masters are
    copied back from the fp16 weights they were cloned from. Returns whether anything was undone (call right
    after ``deepspeed.initialize``, before any step)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    import torch

    if isinstance(opt, FP16_UnfusedOptimizer):
        with torch.no_grad():
            for masters, params in zip(opt.fp32_groups, opt.fp16_groups):
                torch._foreach_copy_(masters, [p.detach() for p in params])
    elif isinstance(opt, FP16_Optimizer):
        with torch.no_grad():
            for master, flat16 in zip(opt.fp32_groups_flat, opt.fp16_groups_flat):
                master.copy_(flat16)
        for group in opt.optimizer.param_groups:
            if "step" in group:  # FusedAdam seeds a new state's step from its group's
                group["step"] = 0
    else:
        return False
    opt.optimizer.state.clear()
    return True
