"""The training loop under DeepSpeed: engine set-up, steps, overflow handling, validation, checkpoints.

``Trainer(run)`` takes a :class:`~training.resolve.ResolvedRun`: the config resolved for this process group
and frozen by :func:`training.resolve.resolve_run` (the one place a loaded config changes), with its layout,
parallel state, dtype and task. The trainer builds data, model and engine from it and never writes the config;
its attributes are declared on the class. Expects torch.distributed initialised through
``deepspeed.init_distributed``.

The resumable counters live in ``trainer.state`` (:class:`training.checkpoint.TrainState`); checkpoints,
``init_from`` and the task's hooks get explicit parts (engine, model, state, parallel state, a
:class:`training.checkpoint.ModelDescription`), never the trainer. ``train()`` runs to ``train.iters``.
Tests drive the same object directly (e.g. to inject an fp16 overflow with a gradient hook).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training import checkpoint as ckpt
from training import init_from, tracking, universal
from training.config import Config
from training.ds_json import deepspeed_config
from training.layout import Layout
from training.metrics import MetricsWriter, progress_enabled
from training.models.compile_layers import compile_layers
from training.optim.adamw import build_optimizer
from training.optim.engine import Engine, build_engine
from training.optim.outcome import StepOutcome
from training.optim.pipe_bubble import bubble_metrics, gather_stage_fractions
from training.parallel.state import ParallelState
from training.plan.accounting import flops_per_iteration
from training.plan.recompute import RecomputeChoice
from training.resolve import ResolvedRun
from training.runtime import device as tdev
from training.runtime import run_lock
from training.runtime.cpu_peak import CpuPeak, measure_cpu_peak_together
from training.runtime.distributed import agreed
from training.runtime.hardware import canonical_kind, detect_device_kind, peak_tflops
from training.tasks.protocol import Task, batch_to_device

logger = logging.getLogger("training")


def count_parameters(model: torch.nn.Module, ps: ParallelState) -> int:
    """Parameters of the whole model over all TP and PP ranks, tied copies counted once (a collective
    under PP: the count is summed over the stages on the model's device, as NCCL requires). A ZeRO-3 parameter
    counts its whole size (``ds_numel``), not its local partition (shape 0 outside a gather)."""
    n = sum(getattr(p, "ds_numel", p.numel()) * (ps.dims.tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in model.parameters() if not getattr(p, "ds_pipe_replicated", False))
    t = torch.tensor(n, dtype=torch.int64, device=tdev.module_device(model))
    if ps.dims.pp > 1:
        dist.all_reduce(t, group=ps.pp_group)
    return int(t)


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (e.g. too many consecutive overflow-skipped steps)."""


class Trainer:
    """The one training loop over a :class:`~training.resolve.ResolvedRun` (its config frozen; build one with
    :func:`training.resolve.resolve_run`, RACE fine-tuning with its own task factory: ``training.finetune_race``).
    Its attributes, declared here, are set once in ``__init__``; the counters that change live in ``state``."""

    # from the resolved run
    cfg: Config  # frozen
    run_dir: Path
    ps: ParallelState
    dtype: str  # fp32 / fp16 / bf16
    task: Task
    layout: Layout
    world: int
    dp: int
    is_rank0: bool
    recompute_choice: RecomputeChoice | None
    padded_vocab: int
    desc: ckpt.ModelDescription
    # built from it
    model: torch.nn.Module
    from_universal: bool  # starts from train.load_universal (training.universal)
    ds_config: dict[str, Any]  # the DeepSpeed JSON (training.ds_json), saved as RUN_DIR/ds_config.json
    pipe: bool  # pipeline-parallel: DeepSpeed's PipelineModule and train_batch
    engine: Engine  # DeepSpeed's engine with the project's optimizer step (training.optim.engine)
    gas: int  # micro-batches per step on each DP rank
    state: ckpt.TrainState  # iteration, consumed samples, skips: what a resume restores
    flops_per_step: float
    tokens_per_step: int
    cpu_peak: CpuPeak | None  # the measured CPU matmul rate (CPU runs)
    peak: float | None  # the device's dense peak TFLOP/s in the training dtype (MFU)
    # with validation, on the live model: (model, tokenizer, ps, iteration) -> {metric: value}, logged as the event
    # named by the evaluator's ``name`` (eval.tasks: evaluation.lm_eval_train, built by training.pretrain)
    evaluators: Sequence[Callable[..., dict]]
    # per step
    _unread: bool = False  # the latest step's device-decided skip has not been read yet
    _clock: tuple[float, int] | None = None  # (start, steps) of the steps since the last read

    def __init__(self, run: ResolvedRun, evaluators: Sequence[Callable[..., dict]] = ()):
        if not isinstance(run, ResolvedRun):
            raise TypeError(f"Trainer takes a ResolvedRun (training.resolve.resolve_run(cfg)), got {type(run).__name__}")
        cfg = self.cfg = run.cfg
        self.run_dir = Path(cfg.run.dir)
        self.ps, self.dtype, self.task, self.layout = run.ps, run.dtype, run.task, run.layout
        self.world, self.dp, self.is_rank0 = run.layout.world_size, run.layout.dp, run.is_rank0
        self.recompute_choice = run.recompute_choice
        self.evaluators = tuple(evaluators)
        self.padded_vocab = self.task.padded_vocab(self.layout)
        self.desc = ckpt.ModelDescription(cfg, self.dtype, self.padded_vocab, self.task.tokenizer)
        # train.load_universal, before this run's first save (the engine is built for it)
        self.from_universal = from_universal = universal.starts_from_universal(cfg)
        if from_universal:  # its refusals before any work
            universal.check_source(cfg, self.ps.dims.tp, self.ps.dims.pp, self.task.tokenizer.file_sha256(),
                                   self.padded_vocab)
        t = cfg.train
        self.task.build_data()
        self.model = self.task.build_model(self.padded_vocab)
        if cfg.model.compile or cfg.model.cuda_graph:  # every transformer layer through torch.compile
            compile_layers(self.model, cuda_graph=cfg.model.cuda_graph)  # (training/models/compile_layers.py)
        init_from.load_weights(self.model, self.desc, self.ps)  # train.init_from's weights, before the engine copies them
        optimizer, scheduler = build_optimizer(self.model, cfg.optimizer, t.iters)
        self.ds_config = deepspeed_config(cfg, self.dp, self.dtype, from_universal)
        tracking.start(cfg)  # W&B mode/dir before DeepSpeed's monitor calls wandb.init
        self.pipe = cfg.parallel.pipeline > 1
        # the engine with the project's optimizer step and every DeepSpeed adaptation (training/optim/engine.py)
        self.engine = build_engine(self.model, optimizer, scheduler, self.ds_config, self.ps)
        tracking.record_config(cfg, self.is_rank0)
        self.gas = self.layout.grad_accumulation
        self.state = ckpt.TrainState()
        self.flops_per_step = flops_per_iteration(cfg, self.padded_vocab)  # GPT-2 or BERT count (model.arch)
        self.tokens_per_step = t.global_batch_size * self.task.tokens_per_sample
        self.cpu_peak = None
        self.peak = self._peak_tflops()
        n_params = count_parameters(self.model, self.ps)  # collective under PP: every rank calls it
        if self.is_rank0:
            logger.info("%r | dtype %s | padded vocab %d | parameters %s | grad accumulation %d | iterations %d",
                        self.ps, self.dtype, self.padded_vocab, f"{n_params:,}", self.gas, t.iters)

    def save_checkpoint(self, config: dict | None = None) -> Path:
        """:func:`training.checkpoint.save` of this trainer's parts (collective). Skips the device decided since
        the last read are settled first (one read), so the checkpoint's counters and LR schedule are exact."""
        self._settle_unread()
        return ckpt.save(self.engine, self.model, self.state, self.ps, self.desc, config)

    def _settle_unread(self) -> None:
        outcome = self.engine.last_outcome
        if not self._unread or outcome is None or not outcome.decided_on_device:
            return
        applied, pending, longest = torch.stack([outcome.applied.double(), outcome.pending_skips.double(),
                                                 outcome.longest_skip_run.double()]).tolist()
        self.engine.settle_device_skips(int(pending))
        self._count_skips(applied == 1.0, int(longest), outcome.loss_scale)
        self._unread = False

    # the train state's counters, read-only (the state itself is ``self.state``)
    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def consumed_samples(self) -> int:
        return self.state.consumed_samples

    def _peak_tflops(self) -> float | None:
        if self.cfg.run.device_peak_tflops:
            return self.cfg.run.device_peak_tflops
        kind = self.cfg.run.device_kind or detect_device_kind()
        if canonical_kind(kind) == "cpu":
            # measured dense matmul rate in the training dtype, all ranks at once (training/runtime/cpu_peak.py)
            self.cpu_peak = measure_cpu_peak_together(self.dtype)
            if self.is_rank0:
                logger.info("%s", self.cpu_peak.describe())
            return self.cpu_peak.tflops
        return peak_tflops(kind, self.dtype)

    @property
    def o1_step(self) -> bool:
        """Whether the project's own optimizer step runs (ZeRO-0), not DeepSpeed's."""
        return self.engine.owned_step is not None

    def restart_step_clock(self) -> None:
        """Time steps from now (after work that is not a training step: evaluation, checkpoints)."""
        self._clock = (time.perf_counter(), 0)

    def train_step(self, read: bool = True) -> dict:
        """One optimizer step (gradient accumulation inside); returns the step's metrics.

        The step itself reads nothing back from the device except, in fp16, the one value that decides
        whether the update is applied (training.optim.mixed_precision; bf16 decides it on the device). With
        ``read=False`` the loss, its parts and the gradient norm stay device tensors and are not all-reduced
        over data parallelism (the host can run ahead of the GPU); ``read=True`` (what log steps and direct
        callers use) makes them Python numbers in one read, and checks the loss: in fp16 that read is the
        step's own (the metrics ride on the skip decision), so a log step reads once in every dtype. Every
        rank must pass the same ``read``: it is collective. Step time is the mean over the steps since the
        last read (or :meth:`restart_step_clock`)."""
        start, steps = self._clock or (time.perf_counter(), 0)
        self._clock = (start, steps + 1)
        st = self.state
        lr = self.engine.lr_scheduler.rate()  # the rate this step uses (a device scalar, read with the metrics)
        extra_metrics = self.task.step_metrics(st.consumed_samples)
        loss, parts, riders = self._run_micro_batches(read)
        outcome: StepOutcome = self.engine.last_outcome
        st.iteration += 1
        st.consumed_samples += self.cfg.train.global_batch_size
        pending = outcome.pending_skips  # bf16: skips the host has not read yet
        m = {
            "iteration": st.iteration,
            "lr": lr,
            "loss": loss,  # mean over micro-batches (and DP replicas once read)
            "loss_scale": outcome.loss_scale,
            "grad_norm": outcome.grad_norm,
            "skipped": self.engine.skipped_steps + (pending if pending is not None else 0),
            "step_applied": outcome.applied,
            "consumed_samples": st.consumed_samples,
            **parts,
            **extra_metrics,
        }
        if outcome.read is not None:
            m.update(zip(riders, outcome.read))
        if not outcome.decided_on_device:
            self._count_skips(bool(outcome.applied), 0 if outcome.applied else st.consecutive_skipped + 1,
                              outcome.loss_scale)
        self._unread = outcome.decided_on_device
        return self.read_metrics(m) if read else m

    def _run_micro_batches(self, read: bool) -> tuple[torch.Tensor, dict, list[str]]:
        """Forward and backward over the step's micro-batches, then the optimizer step (the pipeline engine runs
        all of it in ``train_batch``). Returns the mean loss, the task's loss parts and, when the step's one host
        read carries them (fp16 on a read step), the names of the values that rode along."""
        consumed = self.state.consumed_samples
        if self.pipe:
            batches = [batch_to_device(b, self.engine) for b in self.task.micro_batches(consumed)]
            return self.engine.train_batch(data_iter=iter(batches)).detach().float().sum(), {}, []
        step = self.engine.owned_step
        ride = read and step is not None and step.reads_on_host
        losses, parts, riders = [], {}, []
        for batch in self.task.micro_batches(consumed):
            loss, extra = self.task.loss(self.engine, batch)
            for k, v in extra.items():
                parts[k] = parts.get(k, 0.0) + torch.as_tensor(v).detach().float() / self.gas
            self.engine.backward(loss)
            losses.append(loss.detach().float())
            if ride and self.engine.is_gradient_accumulation_boundary():
                # fp16: the step reads the host anyway (the skip decision); the metrics ride on that read
                on_device = {"loss": torch.stack(losses).mean(), **parts}
                step.ride_along(self._stack(on_device))
                riders = list(on_device)
            self.engine.step()
        return torch.stack(losses).mean(), parts, riders

    def _count_skips(self, applied: bool, consecutive: int, scale) -> None:
        """Note the latest step's skip (an fp16 overflow, a non-finite bf16 gradient); abort past
        ``precision.max_consecutive_skipped`` in a row (decided on the device: ``consecutive`` is the longest run
        since the last read, known only then)."""
        st = self.state
        st.consecutive_skipped = consecutive
        if isinstance(scale, torch.Tensor):
            scale = float(scale)  # a read: only where the skip was just read anyway
        if not applied and self.is_rank0:
            logger.warning("iteration %d: %s overflow, step skipped; loss scale now %s", st.iteration, self.dtype, scale)
        limit = self.cfg.precision.max_consecutive_skipped
        if limit and consecutive >= limit:
            raise TrainingAborted(
                f"{consecutive} consecutive steps skipped for {self.dtype} overflow (loss scale {scale}): "
                f"the loss or gradients are inf/NaN; lower optimizer.lr, use precision.dtype=bf16, or raise "
                f"precision.max_consecutive_skipped")

    def _stack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Device values stacked into one float64 tensor (one read), the loss averaged over DP replicas (a
        collective; the other values are this replica's)."""
        dev = tdev.module_device(self.engine)
        stacked = torch.stack([v.detach().to(dev, torch.float64).reshape(()) for v in values.values()])
        if self.dp > 1 and "loss" in values:
            loss_mask = torch.tensor([k == "loss" for k in values], device=dev)
            mean = stacked.clone()
            dist.all_reduce(mean, group=self.ps.dp_group)
            stacked = torch.where(loss_mask, mean / self.dp, stacked)
        return stacked

    def read_metrics(self, m: dict) -> dict:
        """The step's device values as Python numbers, in one device-to-host read: the loss averaged over DP
        replicas (a collective: every rank calls this for the same step), its parts, the gradient norm, bf16's
        device-side skip (``m`` must then be the latest step's), under pipeline parallelism every stage's bubble
        (``pipeline_bubble``: gathered over the pipeline, collective); and the timing since the last read. Raises
        :class:`TrainingAborted` for a non-finite loss on an applied step (fp32/bf16 have no loss scaling to
        skip it) or too many skipped steps in a row."""
        on_device = {k: v for k, v in m.items() if isinstance(v, torch.Tensor)}
        device_skip = isinstance(m["step_applied"], torch.Tensor)
        if device_skip:  # the longest run of skipped steps since the last read
            on_device["consecutive_skipped"] = self.engine.last_outcome.longest_skip_run
        parts = [self._stack(on_device)] if on_device else []
        if self.pipe:  # every stage's bubble, gathered on the device and read with the metrics: one read
            parts.append(gather_stage_fractions(self.engine.comm_timer, self.ps.pp_group, self.ps.dims.pp,
                                                tdev.module_device(self.engine)))
        values = torch.cat(parts).tolist() if parts else []
        if on_device:
            read = dict(zip(on_device, values))
            consecutive = int(read.pop("consecutive_skipped", 0))
            m = {**m, **read}
        if device_skip:
            m["step_applied"], m["skipped"] = m["step_applied"] == 1.0, int(m["skipped"])
            self.engine.settle_device_skips(m["skipped"] - self.engine.skipped_steps)
            if not m["step_applied"]:
                m["grad_norm"] = None
            self._count_skips(m["step_applied"], consecutive, m["loss_scale"])
            self._unread = False
        start, steps = self._clock or (time.perf_counter(), 1)
        elapsed = (time.perf_counter() - start) / max(steps, 1)
        self.restart_step_clock()
        tflops = self.flops_per_step / elapsed / self.world / 1e12
        m.update({"tokens_per_s": self.tokens_per_step / elapsed, "tflops_per_device": tflops,
                  "mfu": tflops / self.peak if self.peak else None, "step_time_s": elapsed,
                  "memory_gib": tdev.peak_memory_gib(tdev.module_device(self.engine))})  # this rank's peak so far
        if self.pipe:
            m.update(bubble_metrics(values[len(on_device):]))
        loss = m["loss"]
        if not math.isfinite(loss) and m["step_applied"]:
            raise TrainingAborted(f"iteration {m['iteration']}: loss is {loss} but the step was applied (no loss "
                                  f"scaling in {self.dtype}); lower optimizer.lr or check the data")
        return m

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over ``train.eval_iters`` global batches (same on every rank)."""
        if self.task.valid_micro_batches(0) is None:
            return None
        self.engine.eval()
        dev = tdev.module_device(self.engine)
        total = torch.zeros((), dtype=torch.float64, device=dev)  # all-reduced below: on the engine's device
        n = 0
        for i in range(self.cfg.train.eval_iters):
            if self.pipe:
                batches = [batch_to_device(b, self.engine) for b in self.task.valid_micro_batches(i)]
                total += self.engine.eval_batch(data_iter=iter(batches)).detach().float().sum()
                n += 1
                continue
            for batch in self.task.valid_micro_batches(i):
                total += self.task.loss(self.engine, batch)[0].detach().float()
                n += 1
        self.engine.train()
        dist.all_reduce(total, group=self.ps.dp_group)
        return total.item() / (n * self.dp)

    def run_evaluators(self, writer: MetricsWriter) -> None:
        """Each evaluator on the live model at this iteration (collective), its metrics an event of ``writer``."""
        for ev in self.evaluators:
            writer.event(ev.name, ev(self.model, self.task.tokenizer, self.ps, self.iteration), self.iteration)

    def train(self, run_dir_locked: bool = False) -> dict:  # noqa: C901
        """Train to ``train.iters``, resuming from the newest checkpoint in RUN_DIR if there is one.

        One run per run directory: train() takes RUN_DIR's lock (:func:`run_lock.acquire_for_rank0`, a
        collective) and releases it when it ends, unless ``run_dir_locked``: the caller took it on every
        rank before building this trainer and releases it itself (``training.pretrain``, so a refused
        launch builds nothing). ``run_dir_locked`` must be the same on every rank, never derived from
        whether this rank holds the lock object (only rank 0 does): a rank that skipped the collective
        another rank entered would deadlock the job."""
        from tqdm import tqdm

        cfg = self.cfg
        # one run per run.dir (collective, entered by every rank or by none)
        lock = None if run_dir_locked else run_lock.acquire_for_rank0(self.run_dir, self.is_rank0)
        try:
            # a shard one rank cannot read stops every rank, with one line
            resumed = agreed(lambda: ckpt.load(self.engine, self.state, self.ps, self.desc)
                             or (self.from_universal and universal.load(self.engine, self.state, self.ps, self.desc)))
            writer = MetricsWriter(self.run_dir, cfg.train.iters, self.is_rank0,
                                   self.engine.metrics_monitor,
                                   resume_iteration=self.iteration if resumed else None,
                                   samples=self.consumed_samples)
            if self.is_rank0:  # only once the run is known to start (the run directory is ours, its checkpoint
                # loaded): a launch refused on the way (a bad checkpoint, another tokenizer) leaves the
                # config.json that describes the checkpoints already there as it was
                ckpt.atomic_write_text(self.run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
                ckpt.atomic_write_text(self.run_dir / "ds_config.json", json.dumps(self.ds_config, indent=2))
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if self.cpu_peak is not None:
            writer.event("cpu_peak", self.cpu_peak.as_dict(), self.iteration)
        bar = tqdm(total=cfg.train.iters, initial=self.iteration, desc="train", unit="it",
                   disable=not (self.is_rank0 and progress_enabled(cfg.train.progress_bar)), leave=False)
        last, vl = {}, None
        saves = self.task.periodic_checkpoints
        try:
            self.task.on_train_start(self.engine, writer)
            if (cfg.model.compile or cfg.model.cuda_graph) and self.is_rank0 and self.iteration < cfg.train.iters:
                logger.info("compiling the transformer layers (model.compile%s): the first step traces and compiles "
                            "their forward and backward and takes much longer than the rest",
                            ", CUDA graphs" if cfg.model.cuda_graph else "")
            stop = min(cfg.train.iters, cfg.train.exit_at or cfg.train.iters)
            self.restart_step_clock()
            while self.iteration < stop:
                it = self.iteration + 1
                log = bool(cfg.train.log_interval) and (it % cfg.train.log_interval == 0 or it == cfg.train.iters)
                # device values are read (one sync) on log steps and the last step only
                # and before a checkpoint or evaluation, which record or depend on the settled counters
                save_due = saves and bool(cfg.train.save_interval) and it % cfg.train.save_interval == 0
                eval_due = bool(cfg.train.eval_interval) and it % cfg.train.eval_interval == 0
                last = self.train_step(read=log or it == stop or save_due or eval_due
                                       or getattr(self.task, "reads_every_step", False))
                if log:
                    writer.step(last)
                bar.update(1)
                if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval == 0:
                    vl = self.evaluate()
                    if vl is not None:
                        writer.event("valid", {"loss": vl, "ppl": math.exp(min(vl, 20))}, self.iteration)
                    self.run_evaluators(writer)
                    self.restart_step_clock()
                self.task.on_step_end(self.engine, self.state, last, writer, self.save_checkpoint)
                if saves and cfg.train.save_interval and self.iteration % cfg.train.save_interval == 0:
                    self.save_checkpoint()
                    self.restart_step_clock()
            evaluated_now = bool(cfg.train.eval_interval) and self.iteration % cfg.train.eval_interval == 0 and bool(last)
            valid = vl if evaluated_now else self.evaluate()
            if valid is not None and not evaluated_now:
                writer.event("valid", {"loss": valid, "ppl": math.exp(min(valid, 20))}, self.iteration)
                if self.is_rank0:
                    logger.info("validation loss %.4f | ppl %.2f", valid, math.exp(min(valid, 20)))
            if not evaluated_now:
                self.run_evaluators(writer)
            if saves and not (cfg.train.save_interval and self.iteration % cfg.train.save_interval == 0 and last):
                self.save_checkpoint()
            task_result = self.task.on_train_end(self.state)
        finally:
            bar.close()
            writer.close()
            if lock is not None:
                lock.release()
            tracking.finish(cfg, self.is_rank0)
        return {"last": last, "valid_loss": valid, "task": task_result}
