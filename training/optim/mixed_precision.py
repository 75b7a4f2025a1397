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
3. around torch's fused Adam/AdamW (every dtype; the trainer's choice on CPU and GPU): **no** host read. The skip
   is the optimizer's ``found_inf`` on the device (torch's ``GradScaler`` protocol: the fused kernel leaves
   weights, moments and step count untouched), the unscale-and-clip factor a device scalar, and in fp16 the loss
   scale a device scalar advanced by DeepSpeed's rule on the device (:meth:`MixedPrecisionStep.sync_host_state`
   writes it back into DeepSpeed's ``loss_scale_config`` before a checkpoint; :meth:`load_host_state` reads it
   after one). Skips are counted on the device and settled when the host reads (a log step). Around DeepSpeed's
   FusedAdam (no ``found_inf``): **one** host read (the norm) decides the skip
   (:func:`~training.optim.loss_scale.update_loss_scale`, DeepSpeed's rule on its own state), and a log step's
   metrics ride on it (:meth:`MixedPrecisionStep.ride_along`): one read in all;
4. unscale and clip in one multiply, the client optimizer's own step (FusedAdam or torch's fused AdamW), and the
   half-precision weights refreshed with one copy (the fused wrapper's parameters are views of one flat buffer) or
   one multi-tensor copy (the unfused wrapper).

One deliberate difference from DeepSpeed's step: DeepSpeed updates the scale *before* unscaling, so on a step
where the scale grows the gradients are divided by twice the scale the loss was multiplied by. Here they are
divided by the scale they carry, as Megatron's grad scaler does.

Not covered (DeepSpeed's own step runs): the legacy fused-Adam/LAMB paths and MoE layers; ZeRO optimizers have
their own step. ``BF16_Optimizer`` (bf16 with pipeline parallelism) has its own:
:mod:`training.optim.bf16_partitioned`. :meth:`MixedPrecisionStep.create` says
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
    # around torch's fused Adam/AdamW: skips decided on the device (None otherwise)
    skipped: torch.Tensor | None  # steps skipped since the last settle
    consecutive: torch.Tensor | None  # skipped in a row up to the latest step
    worst: torch.Tensor | None  # the longest such run since the last settle
    # fp16 decided on the device: DeepSpeed's loss-scale state as device scalars (None otherwise)
    scale: torch.Tensor | None  # float32, the current loss scale
    scale_iter: torch.Tensor | None  # float64, DeepSpeed's cur_iter
    last_overflow: torch.Tensor | None  # float64, DeepSpeed's last_overflow_iter
    _riders: torch.Tensor | None = None

    def __init__(self, wrapper, flat_masters: bool, scale_on_device: bool = True):
        self.wrapper, self.flat_masters = wrapper, flat_masters
        self.layout = GradLayout(wrapper.fp16_groups, wrapper.mpu)  # the engine's mpu (the pipeline grid under PP)
        first = wrapper.fp16_groups[0][0]
        self.fp16 = first.dtype == torch.float16
        self.clip = float(wrapper.clip_grad)
        self.skipped = self.consecutive = self.worst = None
        self.scale = self.scale_iter = self.last_overflow = None
        if not flat_masters and self._fused_torch_adam() and (scale_on_device or not self.fp16):
            self.skipped = torch.zeros((), device=first.device)
            self.consecutive = torch.zeros((), device=first.device)
            self.worst = torch.zeros((), device=first.device)
            if self.fp16:
                self.load_host_state()

    @classmethod
    def create(cls, wrapper, scale_on_device: bool = True) -> MixedPrecisionStep | None:
        """The step for ``wrapper`` (DeepSpeed's ZeRO-0 fp16/bf16 wrapper), or None for any other optimizer or a
        configuration this step does not cover (DeepSpeed's own step then runs). ``scale_on_device=False`` keeps
        fp16's loss scale on the host (an engine whose backward reads DeepSpeed's host scale itself)."""
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
        return cls(wrapper, flat, scale_on_device)

    def _fused_torch_adam(self) -> bool:
        """torch's fused Adam/AdamW, whose ``found_inf`` skips an update on the device."""
        inner = self.wrapper.optimizer
        return isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups)

    def load_host_state(self) -> None:
        """fp16 on the device: (re)start the device loss scale from DeepSpeed's ``loss_scale_config`` (at
        construction, and after a checkpoint load restored it)."""
        if self.skipped is None or not self.fp16:
            return
        ls, dev = self.wrapper.loss_scale_config, self.skipped.device
        last = ls.last_overflow_iter if ls.last_overflow_iter is not None else -1
        self.scale = torch.tensor(float(ls.cur_scale), dtype=torch.float32, device=dev)
        self.scale_iter = torch.tensor(float(ls.cur_iter), dtype=torch.float64, device=dev)
        self.last_overflow = torch.tensor(float(last), dtype=torch.float64, device=dev)

    def sync_host_state(self) -> None:
        """fp16 on the device: write the device loss scale back into DeepSpeed's ``loss_scale_config`` (one host
        read), which its checkpoint saves."""
        if self.scale is None:
            return
        scale, it, last = torch.stack([self.scale.double(), self.scale_iter, self.last_overflow]).tolist()
        ls = self.wrapper.loss_scale_config
        ls.cur_scale, ls.cur_iter = scale, int(it)
        if ls.dynamic_loss_scale:
            ls.last_overflow_iter = int(last)

    def backward_scale(self) -> float | torch.Tensor:
        """What the loss is multiplied by before backward: the device scale when fp16 is decided on the device,
        DeepSpeed's host scale otherwise."""
        return self.scale if self.scale is not None else self.wrapper.loss_scale_config.cur_scale

    # ------------------------------------------------------------------------------------------------
    @property
    def reads_on_host(self) -> bool:
        """Whether the step makes one host read (around DeepSpeed's FusedAdam) that :meth:`ride_along` can
        share."""
        return self.skipped is None

    @property
    def loss_scale(self) -> float | torch.Tensor:
        """The current loss scale (a device scalar when fp16 is decided on the device; 1.0 in bf16)."""
        if not self.fp16:
            return 1.0
        return self.scale if self.scale is not None else float(self.wrapper.loss_scale_config.cur_scale)

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
        """Around torch's fused Adam/AdamW: a non-finite norm sets the client optimizer's ``found_inf``, the
        unscale-and-clip factor ``1 / (scale max(1, (norm / scale + 1e-6) / clip))`` is the host rule's in float64
        cast to fp32 as a Python scalar is (the update is bitwise the one a host-read step makes), and fp16's loss
        scale moves by DeepSpeed's rule, all on the device."""
        norm_scaled = total_sq.sqrt()  # float64; NaN and inf stay so
        found = (~torch.isfinite(norm_scaled)).float()
        self.wrapper.optimizer.found_inf = found
        self.skipped.add_(found)
        self.consecutive.add_(1).mul_(found)  # reset to 0 by an applied step
        torch.maximum(self.worst, self.consecutive, out=self.worst)
        if self.scale is None:  # bf16: no loss scale
            norm = norm_scaled
            if self.clip > 0.0:
                torch._foreach_mul_(flats, ((norm + 1e-6) / self.clip).clamp(min=1).reciprocal().float())
        else:
            scale = self.scale.double()
            norm = norm_scaled / scale
            combined = scale
            if self.clip > 0.0:
                factor = (norm + 1e-6) / self.clip
                combined = torch.where(factor > 1, factor * scale, scale)
            torch._foreach_mul_(flats, combined.reciprocal().float())
            self._advance_scale(found)
        return StepOutcome(applied=1 - found, grad_norm=norm, loss_scale=self.loss_scale, pending_skips=self.skipped,
                           longest_skip_run=self.worst)

    def _advance_scale(self, found: torch.Tensor) -> None:
        """:func:`~training.optim.loss_scale.update_loss_scale` on the device scalars."""
        ls = self.wrapper.loss_scale_config
        if ls.dynamic_loss_scale:
            over = found.bool()
            stable = self.scale_iter - self.last_overflow - 1  # applied steps since the last overflow
            grow = ~over & (stable > 0) & (torch.remainder(stable, ls.scale_window) == 0)
            shrunk = (self.scale / ls.scale_factor).clamp(min=ls.min_loss_scale)
            self.scale.copy_(torch.where(over, shrunk, torch.where(grow, self.scale * ls.scale_factor, self.scale)))
            self.last_overflow.copy_(torch.where(over, self.scale_iter, self.last_overflow))
        self.scale_iter.add_(1)

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
