"""The DeepSpeed engine the project trains with, and every adaptation it makes to DeepSpeed, in one place.

:func:`build_engine` builds an :class:`Engine` (or :class:`PipeEngine` for a ``PipelineModule``): DeepSpeed's own
engine classes, subclassed the way DeepSpeed's ``DualPipeVEngine`` subclasses its pipeline engine, so DeepSpeed's
objects are never patched per instance. ``PipeEngine(PipelineEngine, Engine)`` puts :class:`Engine` between
DeepSpeed's pipeline engine and ``DeepSpeedEngine`` in the method order, so the pipeline schedule's own calls
(``super().backward``, ``_take_model_step``) reach the overrides below. The other pipeline schedules
(docs/pipeline.md) sit on top the same way: ``InterleavedPipeEngine`` (:mod:`training.optim.pipe_interleaved`) and
``DualPipeEngine`` (DeepSpeed's own ``DualPipeVEngine``) over :class:`PipeEngine`, chosen by the module's class.

============================  =====================================================  ===============================
adaptation                    what it repairs                                         DeepSpeed releases
============================  =====================================================  ===============================
``Engine.backward``           fp16 loss scaling at ZeRO-0: the engine's ``backward``  0.18-0.19 (PR #8393, open);
                              multiplies the loss by the scale only for ZeRO          detected from the source, so a
                              optimizers, so the gradients were never scaled up,      fixed release is left alone
                              Adam saw them divided by 2^16 and overflow could
                              never trigger
``undo_initial_zero_step``    the ZeRO-0 fp16/bf16 wrappers step the client           0.19 (all wrappers that call
                              optimizer once with zero gradients at construction:     ``initialize_optimizer_states``)
                              Adam's bias correction one step late, one weight
                              decay applied (Megatron and ZeRO take no such step)
``Engine._take_model_step``   the optimizer step: the project's own                   0.19: ~490 host syncs and
                              (:class:`~training.optim.mixed_precision.               ~7,300-9,700 launches per step
                              MixedPrecisionStep` for fp16/bf16,                      (1.2B), the norm discarded in
                              :class:`~training.optim.fp32.Fp32Step` for fp32) at     fp32, replicated parameters
                              ZeRO-0, one typed outcome for every step                miscounted under PP
                              (:class:`~training.optim.outcome.StepOutcome`); bf16
                              under pipeline parallelism (DeepSpeed's                 0.19: 2 host reads per step
                              ``BF16_Optimizer``): :class:`~training.optim.           (the norm check, the clip
                              bf16_partitioned.PartitionedBf16Step`                   decision)
``Engine.save_checkpoint``,   fp16 decided on the device: its loss scale written     all (DeepSpeed's checkpoint
``Engine.load_checkpoint``    into DeepSpeed's ``loss_scale_config`` before a save,  holds the wrapper's host state)
                              read back after a load
``Engine.load_checkpoint``    ZeRO-3's universal load gives every parameter group     0.19.8 (losses 2.4e-4 off
                              the first group's hyperparameters (biases and norms     by the 6th step after a load)
                              decayed) and every Adam state one shared ``step``
                              tensor (advanced once per sub-group per step): each
                              group's own and each state's own step put back
``Engine.load_checkpoint``    ``BF16_Optimizer`` without ZeRO (bf16 under pipeline    0.19.8 (every bf16 pipeline
                              parallelism): its state is saved per DP rank in the     run's resume failed with
                              ZeRO files but loaded from the model-state file, a      ``KeyError: 0``)
                              dict indexed by DP rank; loaded from the ZeRO files
``allreduce_gradients``       the data-parallel reduction at ZeRO-0 without           all (DeepSpeed reduces in
                              pipeline parallelism: gradients in static buffers       ``allreduce_gradients`` at the
                              (:class:`~training.optim.grad_buffer.GradBuffer`),      end of backward: one flat copy
                              all-reduced in buckets while backward runs; the         of every gradient, nothing
                              override (``Engine``'s) only waits for them             overlapped, new gradient
                              (DeepSpeed's arithmetic, bitwise on two ranks)          tensors every step)
``Engine.monitor``            DeepSpeed writes the learning rate and loss scale to   all (its engines write after
                              its monitor after every step (the pipeline engine the   every step when a monitor is
                              loss too, read with ``.item()``): a host read per       on)
                              step, a stale loss scale when the step keeps it on
                              the device, a tensor rate in the CSV. The monitor is
                              ``Engine.metrics_monitor``, written by the trainer on
                              log steps (``train/lr``, ``train/loss_scale``, ...)
``enable_backward_allreduce`` off at one data-parallel replica: DeepSpeed would       all (a public switch)
                              flatten every gradient and all-reduce it with itself
``safe_load.install``         ``TorchCheckpointEngine.load`` unpickles with           0.19 (process-wide, at start-up:
                              ``weights_only=False``; routed through                  :func:`install_process_wide`)
                              :func:`training.safe_load.load`
============================  =====================================================  ===============================

:data:`TESTED_DEEPSPEED` names the releases these were written and tested for; another release logs one line at
start-up.
"""
from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.runtime import zero
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine

from training.optim.bf16_partitioned import PartitionedBf16Step
from training.optim.fp32 import Fp32Step
from training.optim.grad_buffer import DEFAULT_BUCKET_SIZE, DpReduction, GradBuffer
from training.optim.lr_schedule import DeviceLRSchedule
from training.optim.mixed_precision import MixedPrecisionStep
from training.optim.outcome import StepOutcome, deepspeeds_outcome
from training.optim.pipe_bubble import BubbleTimed, timed_instructions
from training.optim.pipe_interleaved import InterleavedPipelineEngine

if TYPE_CHECKING:
    from training.parallel.state import ParallelState

log = logging.getLogger(__name__)

# The DeepSpeed releases the adaptations above were written and tested for; pyproject.toml requires the same
# range and constraints.txt pins the release CI runs.
TESTED_DEEPSPEED = ((0, 19), (0, 20))  # [low, high)


def untested_deepspeed(version: str) -> str | None:
    """One-line warning when ``version`` is outside :data:`TESTED_DEEPSPEED`, else None."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED_DEEPSPEED
    if m and lo <= (int(m.group(1)), int(m.group(2))) < hi:
        return None
    return (f"DeepSpeed {version} is untested here (tested: {lo[0]}.{lo[1]}.x): training/optim/engine.py's fp16 "
            f"loss-scaling repair detects the need by reading DeepSpeed's source; check it with "
            f"tests/parallel/test_fp16_loss_scale.py or install the pinned release (pip install -c constraints.txt deepspeed)")


def _engine_scales_fp16(backward) -> bool:
    """Whether this DeepSpeed's ``DeepSpeedEngine.backward`` handles the fp16 (non-ZeRO) loss itself."""
    try:
        return "fp16_enabled" in inspect.getsource(backward)
    except (OSError, TypeError):  # no source available: assume a fixed, compiled DeepSpeed
        return True


REPAIRS_FP16_BACKWARD = not _engine_scales_fp16(DeepSpeedEngine.backward)
_warned = False


def install_process_wide() -> None:
    """What cannot be done per engine, once per process before any engine or checkpoint read: DeepSpeed's
    checkpoint reads made weights-only, and one warning line on an untested DeepSpeed."""
    global _warned
    from training import safe_load

    safe_load.install()
    warning = untested_deepspeed(deepspeed.__version__)
    if warning and not _warned:
        _warned = True
        log.warning(warning)


class SilentMonitor:
    """Where DeepSpeed's engines write their per-step monitor events: nowhere."""

    enabled = False

    def write_events(self, event_list) -> None:
        pass


class OwnedStep(Protocol):
    reads_on_host: bool
    skipped: torch.Tensor | None  # device count of skips since the last settle (None: the host decides skips)

    def step(self) -> StepOutcome: ...

    def settle(self) -> None: ...


class Engine(DeepSpeedEngine):
    """DeepSpeed's engine with the project's optimizer step and fp16 backward (the table in the module docstring).

    ``owned_step`` is the step :func:`build_engine` chose (None: DeepSpeed's own, e.g. ZeRO); ``last_outcome`` is
    what the latest optimizer step did, whoever took it; ``grad_buffer`` holds the gradients and reduces them over
    data parallelism during backward (None: DeepSpeed's gradients and reduction, e.g. ZeRO, pipeline parallelism)."""

    owned_step: OwnedStep | None = None
    last_outcome: StepOutcome | None = None
    grad_buffer: GradBuffer | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # DeepSpeed's monitor (TensorBoard, CSV, W&B), kept for the trainer's own writes on log steps; DeepSpeed's
        # own per-step writes stop (the module docstring says why)
        self.metrics_monitor, self.monitor = self.monitor, SilentMonitor()

    def backward(self, loss, *args, **kwargs):
        if self.grad_buffer is not None:  # the step's last micro-batch reduces (DeepSpeed's condition)
            self.grad_buffer.begin(reduce=self.enable_backward_allreduce and not self.inside_no_sync_ctxt
                                   and self.is_gradient_accumulation_boundary())
        opt = self.optimizer
        if (REPAIRS_FP16_BACKWARD and isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer))
                and opt.loss_scale_config.use_grad_scaling):
            step = self.owned_step
            # the device scale when the step decides fp16 on the device (no host read), DeepSpeed's otherwise
            scale = step.backward_scale() if isinstance(step, MixedPrecisionStep) else opt.loss_scale_config.cur_scale
            # the engine returns the (accumulation-scaled) loss it ran backward on: hand back the unscaled one
            return super().backward(loss.float() * scale, *args, **kwargs) / scale
        return super().backward(loss, *args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        if isinstance(self.owned_step, MixedPrecisionStep):
            self.owned_step.sync_host_state()  # the device loss scale into the state DeepSpeed saves
        return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        # BF16_Optimizer without ZeRO (bf16 under pipeline parallelism): DeepSpeed saves its state per DP rank in
        # the ZeRO files but loads it from the model-state file, indexing a dict by DP rank (KeyError: 0); here the
        # engine loads everything else and then the wrapper's state from the files DeepSpeed wrote for it
        bf16_state = (isinstance(self.optimizer, BF16_Optimizer) and not self.zero_optimization()
                      and kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False))
        if bf16_state:
            kwargs["load_optimizer_states"] = False
        z3_universal = self.zero_optimization_stage() == 3 and self.load_universal_checkpoint()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.optimizer.param_groups
                 ] if z3_universal else []
        out = super().load_checkpoint(load_dir, tag, **kwargs)
        if z3_universal:
            self._repair_zero3_universal_load(hyper)
        if bf16_state and out[0] is not None:
            tag = tag if tag is not None else (Path(load_dir) / "latest").read_text().strip()
            if not self._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
                raise RuntimeError(f"{Path(load_dir) / str(tag)}: no bf16 optimizer state files (zero_pp_rank_*"
                                   f"optim_states.pt) for this run's DP ranks: the checkpoint is incomplete")
        if isinstance(self.lr_scheduler, DeviceLRSchedule):  # the optimizer's load put the saved rate in its groups
            self.lr_scheduler.install()
        if isinstance(self.owned_step, MixedPrecisionStep):
            self.owned_step.load_host_state()  # the loaded loss scale onto the device
        return out

    def _repair_zero3_universal_load(self, hyper: list[dict]) -> None:
        """After DeepSpeed's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``): it
        copied the first parameter group's hyperparameters into every group (the no-decay group of biases and norms
        decayed), and gave every sub-group's Adam state one shared ``step`` tensor, which torch's fused AdamW then
        advanced once per sub-group per step (bias correction running ahead): each group's own hyperparameters and
        each state its own step back."""
        inner = self.optimizer.optimizer
        for group, own in zip(inner.param_groups, hyper):
            group.update(own)
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    def allreduce_gradients(self, bucket_size=None):
        """At the end of backward on an accumulation boundary (DeepSpeed calls it only where it would reduce): the
        buffer's bucketed reduction finished, instead of DeepSpeed's flatten-and-reduce."""
        if self.grad_buffer is None:
            return super().allreduce_gradients() if bucket_size is None else super().allreduce_gradients(bucket_size)
        if self.is_gradient_accumulation_boundary():
            self.grad_buffer.finish()

    def _take_model_step(self, lr_kwargs):
        step = self.owned_step
        if step is None:
            super()._take_model_step(lr_kwargs)
            if self.grad_buffer is not None:  # DeepSpeed's step set the gradients to None
                self.grad_buffer.zero()
            self.last_outcome = deepspeeds_outcome(self.optimizer, self._step_applied, self._global_grad_norm,
                                                   self.fp16_enabled())
            return
        outcome = step.step()
        if self.grad_buffer is not None:
            self.grad_buffer.zero()
        elif self.fp16_enabled() or self.bfloat16_enabled():
            self.optimizer.zero_grad()  # the wrapper's: the half-precision gradients
        else:
            self.zero_grad()
        self._global_grad_norm = outcome.grad_norm
        if outcome.decided_on_device:
            # the schedule counts the device's own applied flag; the skip counters are settled when the host
            # reads them (Trainer.read_metrics)
            self._step_applied = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(applied=outcome.applied)
        elif outcome.applied:
            self._step_applied = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self._step_applied = False
            self.skipped_steps += 1
        self.losses = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size()  # the engine owns the accumulation boundary
        self.last_outcome = outcome

    def settle_pending_skips(self) -> int:
        """Read the skips the device decided since the last settle (one host read when there are such skips to
        learn of), settle them (:meth:`settle_device_skips`) and return ``skipped_steps``: for callers that step the
        engine themselves (the benchmarks); the trainer settles at its own reads."""
        step = self.owned_step
        if step is not None and step.skipped is not None:
            self.settle_device_skips(int(step.skipped.item()))
        return self.skipped_steps

    def settle_device_skips(self, skipped: int) -> None:
        """After a read of a device-decided outcome: the ``skipped`` steps the device skipped since the last
        settle are counted as DeepSpeed counts a skip (``skipped_steps``, checkpointed). The LR schedule needs
        nothing: it counted the device's applied flags (:class:`~training.optim.lr_schedule.DeviceLRSchedule`)."""
        self.owned_step.settle()
        self.skipped_steps += skipped


class PipeEngine(BubbleTimed, PipelineEngine, Engine):
    """DeepSpeed's pipeline engine over :class:`Engine` (its schedule calls reach Engine's overrides); ``comm_timer``
    times the pipeline communication of each step (:mod:`training.optim.pipe_bubble`: ``pipeline_bubble``)."""


class InterleavedPipeEngine(InterleavedPipelineEngine, PipeEngine):
    """Megatron's interleaved 1F1B (:mod:`training.optim.pipe_interleaved`) over :class:`PipeEngine`."""

    _INSTRUCTION_MAP = timed_instructions(InterleavedPipelineEngine._INSTRUCTION_MAP)  # pipeline_bubble


class DualPipeEngine(DualPipeVEngine, PipeEngine):
    """DeepSpeed's own DualPipeV engine over :class:`PipeEngine` (the schedule and p2p are DeepSpeed's)."""

    _INSTRUCTION_MAP = timed_instructions(DualPipeVEngine._INSTRUCTION_MAP)  # pipeline_bubble


def pipe_engine_class(model: PipelineModule) -> type[PipeEngine]:
    """The engine that runs ``model``'s stages: by the module's class (built for the configured schedule)."""
    if isinstance(model, DualPipeVModule):
        return DualPipeEngine
    if hasattr(model, "activate_chunk"):  # training.models.pipe_chunks.InterleavedPipeModule
        return InterleavedPipeEngine
    return PipeEngine


def dp_partitioned_state(engine: DeepSpeedEngine) -> str | None:
    """What partitions this engine's optimizer state over the data-parallel ranks (a checkpoint of it loads at its
    own DP size only), or None."""
    if engine.zero_optimization():
        return f"ZeRO-{engine.zero_optimization_stage()}"
    if isinstance(engine.optimizer, BF16_Optimizer):
        return "bf16 under pipeline parallelism, DeepSpeed's BF16_Optimizer"
    return None


def undo_initial_zero_step(optimizer) -> bool:
    """Undo the zero-gradient optimizer step DeepSpeed's ZeRO-0 fp16/bf16 wrappers take at construction.

    ``initialize_optimizer_states`` of ``FP16_UnfusedOptimizer`` (torch AdamW) and of ``FP16_Optimizer``
    (DeepSpeed's FusedAdam) runs the client optimizer once with all-zero gradients to create its state. For AdamW
    that step changes no moment but counts as step 1 (so every later bias correction is one step late: the first
    real update is 0.744 lr instead of lr) and applies one weight decay to the fp32 masters. Here the optimizer
    state is dropped (FusedAdam's per-group ``step`` back to 0) and the masters copied back from the half-precision
    weights they were cloned from. Returns whether anything was undone (call before any step)."""
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        with torch.no_grad():
            for masters, params in zip(optimizer.fp32_groups, optimizer.fp16_groups):
                torch._foreach_copy_(masters, [p.detach() for p in params])
    elif isinstance(optimizer, FP16_Optimizer):
        with torch.no_grad():
            for master, flat16 in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat):
                master.copy_(flat16)
        for group in optimizer.optimizer.param_groups:
            if "step" in group:  # FusedAdam seeds a new state's step from its group's
                group["step"] = 0
    else:
        return False
    optimizer.optimizer.state.clear()
    return True


def owned_step_for(engine: Engine, ps: ParallelState | None, pipe: bool) -> OwnedStep | None:
    """The project's step for this engine's optimizer, or None where DeepSpeed's own runs (ZeRO, the legacy fused
    paths, MoE)."""
    if engine.zero_optimization():
        return None
    if isinstance(engine.optimizer, BF16_Optimizer):  # bf16 under pipeline parallelism
        return PartitionedBf16Step.create(engine.optimizer)
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        return MixedPrecisionStep.create(engine.optimizer, scale_on_device=REPAIRS_FP16_BACKWARD)
    tp_rank = ps.tp_rank if ps is not None else 0
    return Fp32Step(engine.optimizer, list(engine.module.parameters()), float(engine.gradient_clipping()), tp_rank,
                    ps.tp_group if ps is not None else None, ps.pp_group if ps is not None and pipe else None)


def dp_reduction(engine: Engine) -> DpReduction | None:
    """DeepSpeed's ZeRO-0 data-parallel reduction as this engine would run it (``_reduce_non_expert_gradients``:
    the sequence-data-parallel group, the world size over the Ulysses degree; ``allreduce_bucket``: average,
    pre/post scaling, communication dtype), or None where the engine does not reduce."""
    if not engine.enable_backward_allreduce:
        return None
    group = engine.seq_data_parallel_group
    return DpReduction(group=group, world_size=dist.get_world_size(group) / float(engine.sequence_parallel_size),
                       average=engine.gradient_average, postscale=engine.postscale_gradients(),
                       predivide=engine.gradient_predivide_factor(), comm_dtype=engine.communication_data_type)


def grad_buffer_for(engine: Engine, bucket_size: int = DEFAULT_BUCKET_SIZE) -> GradBuffer | None:
    """A :class:`~training.optim.grad_buffer.GradBuffer` over the engine's module, laid out by its optimizer's
    parameter groups (the ZeRO-0 wrappers' ``fp16_groups``), or None where DeepSpeed's reduction stays: ZeRO
    (its own buckets and partitions), ``BF16_Optimizer`` (its own fp32 accumulation), MoE and sparse gradients
    (other groups, other tensors). Pipeline parallelism keeps DeepSpeed's too (:func:`build_engine`): its schedule
    reduces after its last backward, tied weights across stages included."""
    opt = engine.optimizer
    if (engine.zero_optimization() or hasattr(opt, "get_grads_for_reduction") or engine.has_moe_layers
            or any(isinstance(m, torch.nn.Embedding) and m.sparse for m in engine.module.modules())):
        return None
    groups = getattr(opt, "fp16_groups", None) or [g["params"] for g in opt.param_groups]
    buffer = GradBuffer(list(engine.module.parameters()), groups, dp_reduction(engine), bucket_size)
    step = engine.owned_step
    if isinstance(step, MixedPrecisionStep):  # each group's gradients one cast of a slice, and kept
        step.layout.use_buffer(groups, buffer.span_of)
    return buffer


def optimizer_device(ds_config: dict, device: torch.device) -> torch.device:
    """Where the optimizer steps: the host under ZeRO-Offload (``offload_optimizer.device: cpu``), else ``device``."""
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return torch.device("cpu") if offload.get("device") == "cpu" else torch.device(device)


def build_engine(model: torch.nn.Module, optimizer, scheduler, ds_config: dict, ps: ParallelState | None = None, *,
                 own_step: bool = True, grad_buffer: bool | None = None,
                 bucket_size: int = DEFAULT_BUCKET_SIZE) -> Engine:
    """The engine for ``model`` (a ``PipelineModule``: :class:`PipeEngine`, its grid from the module; otherwise
    :class:`Engine` with ``ps`` as DeepSpeed's mpu), with every adaptation of the module docstring applied.
    ``own_step=False`` keeps DeepSpeed's own optimizer step (the A/B baseline of the benchmarks and tests);
    ``grad_buffer`` (default: ``own_step``) the static gradient buffer with the overlapped reduction in buckets of
    ``bucket_size`` elements (:func:`grad_buffer_for`; False: DeepSpeed's gradients and reduction).

    This is what ``deepspeed.initialize`` does for these two engine classes (the hybrid engine, mesh devices and
    automatic TP are not used here): its comm layer started (a no-op once torch.distributed runs), any
    ``zero.Init`` context paused around the construction."""
    install_process_wide()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), auto_mpi_discovery=False,
                               verbose=False, dist_init_required=False)
    pipe = isinstance(model, PipelineModule)
    mpu = model.mpu() if pipe else ps
    config_class = DeepSpeedConfig(ds_config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    zero.partition_parameters.shutdown_init_context()
    engine = (pipe_engine_class(model) if pipe else Engine)(
        args=None, model=model, optimizer=optimizer, lr_scheduler=scheduler, mpu=mpu, dist_init_required=False,
        config=ds_config, config_class=config_class)
    zero.partition_parameters.restore_init_context()
    if isinstance(scheduler, DeviceLRSchedule):  # the rate where the optimizer steps (ZeRO-Offload: the host)
        scheduler.install(optimizer_device(ds_config, engine.device))
    undo_initial_zero_step(engine.optimizer)  # fp16/bf16 at ZeRO-0: Adam starts at step 0, as in fp32
    if own_step:
        engine.owned_step = owned_step_for(engine, ps, pipe)
        decides_on_device = engine.owned_step is not None and engine.owned_step.skipped is not None
        if decides_on_device and scheduler is not None and not isinstance(scheduler, DeviceLRSchedule):
            raise TypeError(f"the step decides fp16/bf16 skips on the device, so its learning-rate schedule must count "
                            f"them there: pass a training.optim.lr_schedule.DeviceLRSchedule, not "
                            f"{type(scheduler).__name__}")
    dp = ps.get_sequence_data_parallel_world_size() if ps is not None else 1  # data x context parallel ranks
    if dp == 1 and not pipe and not engine.zero_optimization():
        engine.enable_backward_allreduce = False
    # pipeline parallelism keeps DeepSpeed's gradients and reduction: its schedule reduces after the last backward
    # of the batch, the tied weights of the stages included (a buffer there is for another issue)
    if (own_step if grad_buffer is None else grad_buffer) and not pipe:
        engine.grad_buffer = grad_buffer_for(engine, bucket_size)
    return engine
