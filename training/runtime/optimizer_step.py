"""DeepSpeed's ZeRO-0 mixed-precision optimizer step in a constant number of kernels and at most one host read.

DeepSpeed 0.19 wraps the client optimizer in ``FP16_Optimizer`` (for its ``FusedAdam``: one flat fp32
master buffer per group) or ``FP16_UnfusedOptimizer`` (any other optimizer, and bf16 without pipeline
parallelism: one fp32 master per parameter). Both check overflow tensor by tensor
(``CheckOverflow.has_overflow_serial``: ``if has_inf_or_nan(p.grad)``, ~12 kernels and one blocking
device-to-host read per tensor), take the norm tensor by tensor (another read per tensor in the fused
wrapper), and cast, unscale and copy back tensor by tensor. For the 1.2B GPT-2 that is ~7,300-9,700 kernel
launches and ~490 host syncs per step (``../shared/reference/gpu_step.md``).

:func:`install` replaces the wrapper's ``step`` on one engine's optimizer with the Megatron-Core way of
doing the same work (``_unscale_main_grads_and_check_for_nan`` + multi-tensor norm and clip):

1. all gradients of a group concatenated once (one batched ``cat``) and cast to fp32 once: the masters'
   gradient, as DeepSpeed builds it;
2. one multi-tensor norm over the per-parameter slices, squared, weighted 0/1 so every element of the
   TP x PP model counts once (TP-partitioned parameters on every TP rank, replicated ones on TP rank 0,
   pipeline-tied copies never: DeepSpeed's own mask), summed and all-reduced over the model-parallel
   group. An inf or NaN anywhere (masked tensors included: 0 x inf = NaN) makes the sum non-finite, so
   the same all-reduce carries the overflow flag;
3. fp16: **one** host read (the norm): non-finite -> the step is skipped exactly as DeepSpeed skips it
   (``_skip_invalid_grad_norm``: the loss scale halves, ``skipped_steps`` counts it, no scheduler step).
   The loss scale and DeepSpeed's scheduler bookkeeping are host state, so the read stays; on a log step
   the trainer's metrics ride on it (:func:`ride_along`): one read in all. bf16 around torch's fused
   Adam/AdamW: **no** read; the skip is the optimizer's ``found_inf`` on the device and the clip factor a
   device scalar (:func:`_on_device`; skips are counted on the device and read on log steps);
4. unscale and clip in one multiply, the client optimizer's own step (FusedAdam or torch's fused AdamW:
   multi-tensor), and the fp16 weights refreshed with one copy (the fused wrapper's fp16 parameters are
   views of one flat buffer) or one multi-tensor copy (the unfused wrapper).

The loss-scale sequence is DeepSpeed's (its ``_update_scale`` is called as before). One deliberate
difference: DeepSpeed updates the scale *before* unscaling, so on a step where the scale grows the
gradients are divided by twice the scale the loss was multiplied by (half the gradient reaches Adam and
the clip). Here they are divided by the scale they carry, as Megatron's grad scaler does. And in bf16 a
non-finite step is skipped on the device only: the host learns it at the next read (a log step), so until
then the LR schedule runs one step ahead per skipped step (DeepSpeed holds it back on a skipped step;
:func:`settle_skips` rewinds it at the read).

Not covered (DeepSpeed's own step runs): the legacy fused-Adam/LAMB paths, MoE layers, and
``BF16_Optimizer`` (bf16 with pipeline parallelism). ZeRO optimizers have their own step.
"""
from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from training.parallel.state import ParallelState


def _counted(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``p``'s gradient enters the global norm on this rank (DeepSpeed's
    ``_require_avoid_recompute_norm``, inverted)."""
    if getattr(p, "ds_pipe_replicated", False):
        return False
    tp = getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False)
    return bool(tp) or tp_rank == 0


class _Layout:
    """What the step needs to know of the wrapper's parameters, computed once at install."""

    def __init__(self, groups: list[list[torch.Tensor]], mpu: ParallelState | None):
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

        tp_rank = bwc_tensor_model_parallel_rank(mpu) if mpu is not None else 0
        params = [p for g in groups for p in g]
        device = params[0].device if params else torch.device("cpu")
        self.sizes = [[p.numel() for p in g] for g in groups]
        self.weights = torch.tensor([1.0 if _counted(p, tp_rank) else 0.0 for p in params], dtype=torch.float64,
                                    device=device)
        group = mpu.get_model_parallel_group() if mpu is not None else None
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.zeros: torch.Tensor | None = None  # stands in for a missing gradient (sliced, never written)

    def grad_views(self, group: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's gradient as a 1-D view (zeros for a parameter without one)."""
        out = []
        for p in group:
            if p.grad is not None:
                out.append(p.grad.reshape(-1))
                continue
            if self.zeros is None or self.zeros.numel() < p.numel() or self.zeros.dtype != p.dtype:
                self.zeros = torch.zeros(max(q.numel() for q in group), dtype=p.dtype, device=p.device)
            out.append(self.zeros[:p.numel()])
        return out

    def flat_fp32(self, group: list[torch.Tensor]) -> torch.Tensor:
        """The group's gradients, concatenated (one batched cat) and cast to fp32 (one kernel)."""
        return torch.cat(self.grad_views(group)).float()

    def norm_sq(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squared gradient elements of the model replica (device tensor, float64), all-reduced over
        the model-parallel group; non-finite when any gradient holds an inf or NaN."""
        slices = [s for flat, sizes in zip(flats, self.sizes) for s in flat.split(sizes)]
        norms = torch._foreach_norm(slices, 2)
        total = (torch.stack(norms).double().square() * self.weights).sum()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return total


def _unscale_factor(opt, norm_scaled: float, scale: float) -> float:
    """1 / (loss scale x clip factor): DeepSpeed's ``unscale_and_clip_grads`` with the scale the gradients
    carry."""
    combined = scale
    if opt.clip_grad > 0.0:
        clip = ((norm_scaled / scale) + 1e-6) / opt.clip_grad
        if clip > 1:
            combined = clip * scale
    return 1.0 / combined


def _decide(opt, total_sq: torch.Tensor, scale: float) -> float | None:
    """The step's one host read (fp16: it decides the skip). Returns the scaled global norm, or None when the
    step is skipped. Values staged with :func:`ride_along` (a log step's loss ...) are read in the same read."""
    riders, opt._o1_riders = getattr(opt, "_o1_riders", None), None
    if riders is None:
        sq = total_sq.item()
    else:
        sq, *opt._o1_ridden = torch.cat([total_sq.reshape(1), riders.to(total_sq.device, total_sq.dtype)]).tolist()
    norm_scaled = math.sqrt(sq) if sq >= 0 else float("nan")  # NaN >= 0 is False: NaN stays NaN
    if not math.isfinite(norm_scaled):
        return None
    opt.overflow = False
    if opt.loss_scale_config.use_grad_scaling:
        opt._update_scale(False)
    opt._global_grad_norm = norm_scaled / scale
    return norm_scaled


def _on_device(opt, flats: list[torch.Tensor], total_sq: torch.Tensor) -> None:
    """bf16 (no loss scale): the skip decided and the clip applied on the device, no host read.

    A non-finite norm sets the client optimizer's ``found_inf`` (torch's fused Adam/AdamW then leaves
    weights, moments and step count untouched, as DeepSpeed's skip does); the host sees ``overflow=False``.
    The clip factor ``1 / max(1, (norm + 1e-6) / clip)`` is the host rule's, in float64, cast to fp32 as a
    Python scalar is, so the update is bitwise the one the host-read step makes."""
    norm = total_sq.sqrt()  # float64; NaN and inf stay so
    found = (~torch.isfinite(norm)).float()
    opt.optimizer.found_inf = found
    opt._o1_skipped.add_(found)
    opt._o1_consecutive.add_(1).mul_(found)  # reset to 0 by an applied step
    torch.maximum(opt._o1_worst, opt._o1_consecutive, out=opt._o1_worst)  # the longest run since the last read
    opt._global_grad_norm = norm
    if opt.clip_grad > 0.0:
        torch._foreach_mul_(flats, ((norm + 1e-6) / opt.clip_grad).clamp(min=1).reciprocal().float())
    opt.overflow = False


def _fused_step(self, closure=None):
    """``FP16_Optimizer.step`` (flat fp32 masters) in O(1) kernels and one host read."""
    lay: _Layout = self._o1_layout
    scale = self.loss_scale_config.cur_scale
    flats = [lay.flat_fp32(group) for group in self.fp16_groups]
    for group in self.fp16_groups:
        for p in group:
            p.grad = None
    norm_scaled = _decide(self, lay.norm_sq(flats), scale)
    if norm_scaled is None:
        return self._skip_invalid_grad_norm()
    torch._foreach_mul_(flats, _unscale_factor(self, norm_scaled, scale))
    for master, flat in zip(self.fp32_groups_flat, flats):
        master.grad = flat
    self.optimizer.step()
    for master in self.fp32_groups_flat:
        master.grad = None
    for group, flat16, flat32 in zip(self.fp16_groups, self.fp16_groups_flat, self.fp32_groups_flat):
        if _views_of(group, flat16):
            flat16.copy_(flat32)
        else:  # the parameters were re-pointed (not by DeepSpeed): copy per parameter, still one multi-tensor op
            torch._foreach_copy_([p.data for p in group],
                                 [s.view_as(p) for s, p in zip(flat32.split([p.numel() for p in group]), group)])
    self.has_executed_step = True
    return self.overflow


def _views_of(group: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether the parameters are still consecutive views of ``flat`` (as FP16_Optimizer made them)."""
    ptr, step = flat.data_ptr(), flat.element_size()
    for p in group:
        if p.data_ptr() != ptr or not p.is_contiguous():
            return False
        ptr += p.numel() * step
    return True


def _unfused_step(self, closure=None):
    """``FP16_UnfusedOptimizer.step`` (one fp32 master per parameter) in O(1) kernels and one host read (fp16),
    or none (bf16 around torch's fused Adam/AdamW: :func:`_on_device`)."""
    lay: _Layout = self._o1_layout
    scale = self.loss_scale_config.cur_scale
    flats = [lay.flat_fp32(group) for group in self.fp16_groups]
    if getattr(self, "_o1_skipped", None) is not None:  # bf16 around torch's fused Adam: no host read
        _on_device(self, flats, lay.norm_sq(flats))
    else:
        norm_scaled = _decide(self, lay.norm_sq(flats), scale)
        if norm_scaled is None:
            return self._skip_invalid_grad_norm()
        torch._foreach_mul_(flats, _unscale_factor(self, norm_scaled, scale))
    for masters, flat, sizes in zip(self.fp32_groups, flats, lay.sizes):
        for m, g in zip(masters, flat.split(sizes)):
            m.grad = g.view_as(m)
    self.optimizer.step()
    for masters, group in zip(self.fp32_groups, self.fp16_groups):
        for m in masters:
            m.grad = None
        torch._foreach_copy_([p.data for p in group], masters)
    return self.overflow


def install(engine: DeepSpeedEngine) -> bool:
    """Give ``engine.optimizer`` (DeepSpeed's ZeRO-0 fp16/bf16 wrapper) the O(1) step. Returns whether it
    was installed (False for any other optimizer, or a configuration this step does not cover)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if isinstance(opt, FP16_Optimizer):
        if opt.fused_adam_legacy or opt.has_moe_layers:
            return False
        step = _fused_step
    elif isinstance(opt, FP16_UnfusedOptimizer):
        if opt.fused_lamb_legacy or getattr(opt, "has_moe_layers", False):
            return False
        step = _unfused_step
    else:
        return False
    if not any(opt.fp16_groups):
        return False
    opt._o1_layout = _Layout(opt.fp16_groups, opt.mpu)
    opt._o1_skipped = opt._o1_consecutive = opt._o1_worst = None
    if step is _unfused_step and _skips_on_device(opt):
        device = opt.fp16_groups[0][0].device
        opt._o1_skipped = torch.zeros((), device=device)  # steps skipped since the last settle_skips
        opt._o1_consecutive = torch.zeros((), device=device)  # skipped in a row up to the latest step
        opt._o1_worst = torch.zeros((), device=device)  # the longest such run since the last settle_skips
    opt.step = types.MethodType(step, opt)
    return True


def _skips_on_device(opt) -> bool:
    """bf16 (no loss scaling) around torch's fused Adam/AdamW, whose ``found_inf`` skips an update on the
    device. Anything else (fp16: the loss scale and DeepSpeed's scheduler bookkeeping are host state) reads."""
    inner = opt.optimizer
    return (not opt.loss_scale_config.use_grad_scaling and opt.fp16_groups[0][0].dtype == torch.bfloat16
            and isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups))


def reads_on_host(engine: DeepSpeedEngine) -> bool:
    """Whether the installed step makes one host read (fp16), that :func:`ride_along` can share."""
    return installed(engine) and getattr(engine.optimizer, "_o1_skipped", None) is None


def ride_along(engine: DeepSpeedEngine, values: torch.Tensor) -> None:
    """Stage a 1-D device tensor to be read in the next step's one host read (a log step's metrics: one read,
    not two); :func:`take_ridden` returns the values after that step."""
    if not reads_on_host(engine):
        raise RuntimeError("ride_along needs the O(1) step with a host read (fp16)")
    engine.optimizer._o1_riders = values.reshape(-1)
    engine.optimizer._o1_ridden = None


def take_ridden(engine: DeepSpeedEngine) -> list[float] | None:
    """The values staged with :func:`ride_along`, as read by the last step (None when nothing rode)."""
    opt = engine.optimizer
    values = getattr(opt, "_o1_ridden", None)
    opt._o1_ridden = opt._o1_riders = None
    return values


def device_skips(engine: DeepSpeedEngine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """bf16's device-side skip state (the last step's found-inf 0/1, steps skipped since the last
    :func:`settle_skips`, the longest run of consecutive skipped steps since then), or None when skips are
    decided on the host."""
    opt = engine.optimizer
    if not installed(engine) or getattr(opt, "_o1_skipped", None) is None:
        return None
    return opt.optimizer.found_inf, opt._o1_skipped, opt._o1_worst


def settle_skips(engine: DeepSpeedEngine, skipped: int) -> None:
    """After a read, the ``skipped`` steps the device skipped since the last one are settled on the host as
    DeepSpeed settles a skip: counted in ``engine.skipped_steps`` (checkpointed), and the LR schedule (a torch
    scheduler; it stepped on them unknowingly) rewound by as many steps, so the schedule is DeepSpeed's again
    from the next step on. The longest-run count starts again."""
    engine.optimizer._o1_worst.zero_()
    if not skipped:
        return
    engine.skipped_steps += skipped
    engine.optimizer._o1_skipped.zero_()
    sched = engine.lr_scheduler
    if isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
        sched.last_epoch -= skipped + 1
        sched.step()  # sets the groups' rates for the rewound epoch


def installed(engine: DeepSpeedEngine) -> bool:
    """Whether :func:`install` gave this engine's optimizer the O(1) step."""
    return getattr(engine.optimizer, "_o1_layout", None) is not None


def uninstall(engine: DeepSpeedEngine) -> None:
    """Back to DeepSpeed's own step (for A/B measurements)."""
    opt = engine.optimizer
    if getattr(opt, "_o1_layout", None) is not None:
        del opt.step
        opt._o1_layout = opt._o1_skipped = opt._o1_consecutive = opt._o1_worst = None
        if hasattr(opt.optimizer, "found_inf"):
            del opt.optimizer.found_inf
