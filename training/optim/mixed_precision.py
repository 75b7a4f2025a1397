"""fp16/bf16 at ZeRO-0: the optimizer step in a constant number of kernels and at most one host read.

DeepSpeed 0.19 wraps the client optimizer in ``FP16_Optimizer`` (for its ``FusedAdam``: one flat fp32 master
buffer per group) or ``FP16_UnfusedOptimizer`` (any other optimizer, and bf16 without pipeline parallelism: one
fp32 master per parameter). Their own ``step`` checks overflow tensor by tensor (~12 kernels and one blocking
read per tensor), takes the norm tensor by tensor and casts, unscales and copies back tensor by tensor: for the
1.2B GPT-2 ~7,300-9,700 kernel launches and ~490 host syncs per step (``../shared/reference/gpu_step.md``).

:class:`MixedPrecisionStep` does the same work the Megatron-Core way (``MixedPrecisionOptimizer``:
``_unscale_main_grads_and_check_for_nan`` + multi-tensor norm and clip), on the wrapper's masters and state:

1. all gradients of a group concatenated once and cast to fp32 once (the masters' gradient);
2. one multi-tensor norm, masked so every element of the TP x PP model counts once, all-reduced over the
   model-parallel group; an inf or NaN anywhere makes it non-finite, so the same all-reduce is the overflow flag
   (:class:`~training.optim.grad_layout.GradLayout`);
3. fp16: **one** host read (the norm) decides the skip; a skipped step halves the loss scale
   (:func:`~training.optim.loss_scale.update_loss_scale`, DeepSpeed's rule on DeepSpeed's own loss-scale state).
   A log step's metrics ride on that read (:meth:`MixedPrecisionStep.ride_along`): one read in all. bf16 around
   torch's fused Adam/AdamW: **no** read; the skip is the optimizer's ``found_inf`` on the device (torch's
   ``GradScaler`` protocol) and the clip factor a device scalar; skips are counted on the device and settled when
   the host reads (a log step);
4. unscale and clip in one multiply, the client optimizer's own step (FusedAdam or torch's fused AdamW), and the
   half-precision weights refreshed with one copy (the fused wrapper's parameters are views of one flat buffer) or
   one multi-tensor copy (the unfused wrapper).

One deliberate difference from DeepSpeed's step: DeepSpeed updates the scale *before* unscaling, so on a step
where the scale grows the gradients are divided by twice the scale the loss was multiplied by. Here they are
divided by the scale they carry, as Megatron's grad scaler does.

Not covered (DeepSpeed's own step runs): the legacy fused-Adam/LAMB paths, MoE layers and ``BF16_Optimizer``
(bf16 with pipeline parallelism); ZeRO optimizers have their own step. :meth:`MixedPrecisionStep.create` says
which.
"""
from __future__ import annotations

import math

import torch

from training.optim.grad_layout import GradLayout, views_of
from training.optim.loss_scale import update_loss_scale
from training.optim.outcome import StepOutcome


def _unscale_factor(norm_scaled: float, scale: float, clip: float) -> float:
    """1 / (loss scale x clip factor): DeepSpeed's ``unscale_and_clip_grads`` with the scale the gradients carry."""
    combined = scale
    if clip > 0.0:
        factor = ((norm_scaled / scale) + 1e-6) / clip
        if factor > 1:
            combined = factor * scale
    return 1.0 / combined


class MixedPrecisionStep:
    """The optimizer step over one DeepSpeed ZeRO-0 fp16/bf16 wrapper (its masters, client optimizer and loss-scale
    state), created once per engine by :meth:`create`. :meth:`step` returns a
    :class:`~training.optim.outcome.StepOutcome`; the step's own state (riders, device-side skip counters) lives
    here, not on the wrapper."""

    wrapper: object  # DeepSpeed's FP16_Optimizer or FP16_UnfusedOptimizer
    flat_masters: bool  # FP16_Optimizer: one flat fp32 master per group
    layout: GradLayout
    fp16: bool  # loss-scaled half precision (bf16 otherwise)
    clip: float
    # bf16 around torch's fused Adam/AdamW: skips decided on the device (None otherwise)
    skipped: torch.Tensor | None  # steps skipped since the last settle
    consecutive: torch.Tensor | None  # skipped in a row up to the latest step
    worst: torch.Tensor | None  # the longest such run since the last settle
    _riders: torch.Tensor | None = None

    def __init__(self, wrapper, flat_masters: bool):
        self.wrapper, self.flat_masters = wrapper, flat_masters
        self.layout = GradLayout(wrapper.fp16_groups, wrapper.mpu)  # the engine's mpu (the pipeline grid under PP)
        first = wrapper.fp16_groups[0][0]
        self.fp16 = first.dtype == torch.float16
        self.clip = float(wrapper.clip_grad)
        self.skipped = self.consecutive = self.worst = None
        if not flat_masters and self._skips_on_device():
            self.skipped = torch.zeros((), device=first.device)
            self.consecutive = torch.zeros((), device=first.device)
            self.worst = torch.zeros((), device=first.device)

    @classmethod
    def create(cls, wrapper) -> MixedPrecisionStep | None:
        """The step for ``wrapper`` (DeepSpeed's ZeRO-0 fp16/bf16 wrapper), or None for any other optimizer or a
        configuration this step does not cover (DeepSpeed's own step then runs)."""
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        if isinstance(wrapper, FP16_Optimizer):
            if wrapper.fused_adam_legacy or wrapper.has_moe_layers:
                return None
            flat = True
        elif isinstance(wrapper, FP16_UnfusedOptimizer):
            if wrapper.fused_lamb_legacy or getattr(wrapper, "has_moe_layers", False):
                return None
            flat = False
        else:
            return None
        if not any(wrapper.fp16_groups):
            return None
        return cls(wrapper, flat)

    def _skips_on_device(self) -> bool:
        """bf16 (no loss scaling) around torch's fused Adam/AdamW, whose ``found_inf`` skips an update on the
        device. fp16 reads: the loss scale and DeepSpeed's scheduler bookkeeping are host state."""
        inner = self.wrapper.optimizer
        return (not self.wrapper.loss_scale_config.use_grad_scaling and not self.fp16
                and isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups))

    # ------------------------------------------------------------------------------------------------
    @property
    def reads_on_host(self) -> bool:
        """Whether the step makes one host read (fp16, or bf16 around another optimizer) that
        :meth:`ride_along` can share."""
        return self.skipped is None

    @property
    def loss_scale(self) -> float:
        return float(self.wrapper.loss_scale_config.cur_scale) if self.fp16 else 1.0

    def ride_along(self, values: torch.Tensor) -> None:
        """Stage a 1-D device tensor to be read in the next step's one host read (a log step's metrics: one read,
        not two); the step's outcome carries the values (``read``)."""
        if not self.reads_on_host:
            raise RuntimeError("ride_along needs a step with a host read (fp16)")
        self._riders = values.reshape(-1)

    def settle(self) -> None:
        """The host has read the device-side skip counters: start counting again."""
        self.worst.zero_()
        self.skipped.zero_()

    # ------------------------------------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """Unscale, check, clip and apply (or skip) the update; the wrapper's fp16/bf16 gradients are consumed."""
        w, lay = self.wrapper, self.layout
        scale = float(w.loss_scale_config.cur_scale)
        flats = [lay.flat_fp32(group) for group in w.fp16_groups]
        if self.flat_masters and not lay.in_buffer:  # free the half-precision gradients before Adam (not a buffer's)
            for group in w.fp16_groups:
                for p in group:
                    p.grad = None
        total_sq = lay.norm_sq(flats)
        if self.skipped is not None:
            outcome = self._decide_on_device(flats, total_sq)
        else:
            norm_scaled, read = self._read(total_sq)
            if norm_scaled is None:
                if w.loss_scale_config.use_grad_scaling or not self.flat_masters:  # as each wrapper's skip does
                    update_loss_scale(w.loss_scale_config, overflow=True)
                return StepOutcome(applied=False, grad_norm=None, loss_scale=self.loss_scale, read=read)
            if w.loss_scale_config.use_grad_scaling:
                update_loss_scale(w.loss_scale_config, overflow=False)
            torch._foreach_mul_(flats, _unscale_factor(norm_scaled, scale, self.clip))
            outcome = StepOutcome(applied=True, grad_norm=norm_scaled / scale, loss_scale=self.loss_scale, read=read)
        self._apply(flats)
        return outcome

    def _read(self, total_sq: torch.Tensor) -> tuple[float | None, tuple[float, ...] | None]:
        """The step's one host read: the scaled global norm (None when non-finite: skip) and the riders."""
        riders, self._riders = self._riders, None
        read = None
        if riders is None:
            sq = total_sq.item()
        else:
            sq, *rest = torch.cat([total_sq.reshape(1), riders.to(total_sq.device, total_sq.dtype)]).tolist()
            read = tuple(rest)
        norm_scaled = math.sqrt(sq) if sq >= 0 else float("nan")  # NaN >= 0 is False: NaN stays NaN
        return (norm_scaled if math.isfinite(norm_scaled) else None), read

    def _decide_on_device(self, flats: list[torch.Tensor], total_sq: torch.Tensor) -> StepOutcome:
        """bf16: a non-finite norm sets the client optimizer's ``found_inf`` (torch's fused Adam/AdamW then leaves
        weights, moments and step count untouched, as DeepSpeed's skip does). The clip factor
        ``1 / max(1, (norm + 1e-6) / clip)`` is the host rule's, in float64 cast to fp32 as a Python scalar is, so
        the update is bitwise the one a host-read step makes."""
        norm = total_sq.sqrt()  # float64; NaN and inf stay so
        found = (~torch.isfinite(norm)).float()
        self.wrapper.optimizer.found_inf = found
        self.skipped.add_(found)
        self.consecutive.add_(1).mul_(found)  # reset to 0 by an applied step
        torch.maximum(self.worst, self.consecutive, out=self.worst)
        if self.clip > 0.0:
            torch._foreach_mul_(flats, ((norm + 1e-6) / self.clip).clamp(min=1).reciprocal().float())
        return StepOutcome(applied=1 - found, grad_norm=norm, loss_scale=1.0, pending_skips=self.skipped,
                           longest_skip_run=self.worst)

    def _apply(self, flats: list[torch.Tensor]) -> None:
        """The client optimizer's step on the masters, and the half-precision weights refreshed from them."""
        w = self.wrapper
        if self.flat_masters:
            for master, flat in zip(w.fp32_groups_flat, flats):
                master.grad = flat
            w.optimizer.step()
            for master in w.fp32_groups_flat:
                master.grad = None
            for group, flat16, flat32 in zip(w.fp16_groups, w.fp16_groups_flat, w.fp32_groups_flat):
                if views_of(group, flat16):
                    flat16.copy_(flat32)
                else:  # the parameters were re-pointed (not by DeepSpeed): one multi-tensor copy
                    torch._foreach_copy_([p.data for p in group],
                                         [s.view_as(p) for s, p in zip(flat32.split([p.numel() for p in group]), group)])
            return
        for masters, flat, sizes in zip(w.fp32_groups, flats, self.layout.sizes):
            for m, g in zip(masters, flat.split(sizes)):
                m.grad = g.view_as(m)
        w.optimizer.step()
        for masters, group in zip(w.fp32_groups, w.fp16_groups):
            for m in masters:
                m.grad = None
            torch._foreach_copy_([p.data for p in group], masters)
