"""Resolving a loaded run config for this process group: the one place a config changes after loading.

:func:`resolve_run` gathers every change first, applies them (:func:`apply`, the only writer of a config's
fields outside the loader and the tools that build a new config), validates once (``validate_static``) and
freezes the config; nothing writes it afterwards (the sections refuse writes once frozen). In order:

1. ``train.init_from``'s model shape (:func:`training.init_from.adopted_shape`, read from the source run);
2. the process groups and RNG streams (:func:`start_process`);
3. the task (:class:`training.tasks.protocol.Task`: GPT-2, BERT, RACE), built from the config, and what it
   needs changed (:meth:`~training.tasks.protocol.Task.config_changes`: RACE's ``train.iters`` and warmup from
   its data);
4. ``model.vocab_size`` from the task's tokenizer when unset (it may be larger, never smaller);
5. ``model.recompute: auto`` decided by the planner for the smallest device memory over all ranks;

then the one validation, the layout (derived once, :func:`training.layout.derive_layout`) and the freeze. The
:class:`ResolvedRun` holds the frozen config with what resolving it built; ``Trainer(run)`` takes only that.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeAlias

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron_ds_suite.core.config import freeze
from megatron_ds_suite.core.errors import ConfigError
from training import init_from
from training.config import Config, resolve_dtype, validate_static
from training.layout import Layout, derive_layout
from training.optim.pipe_channels import check_backend
from training.parallel import random as tp_random
from training.parallel.state import ParallelState
from training.plan import recompute
from training.plan.recompute import RecomputeChoice
from training.runtime import device as tdev
from training.runtime.hardware import device_memory_gib
from training.tasks.gpt import make_task
from training.tasks.protocol import Task

logger = logging.getLogger("training")

TaskFactory: TypeAlias = Callable[[Config, ParallelState, int], Task]
"""``(cfg, parallel state, DP size) -> Task``; the default picks GPT-2 or BERT by ``model.arch``."""

Changes: TypeAlias = dict[str, dict[str, Any]]
"""``{section: {key: value}}``: values a resolution step sets in a config not yet frozen."""


@dataclass(frozen=True)
class ResolvedRun:
    """A config resolved for this process group and frozen, with what resolving it needed to build."""

    cfg: Config  # frozen: model shape adopted, vocabulary set, task schedule applied, recomputation decided
    layout: Layout  # derived once, with the padded vocabulary
    ps: ParallelState
    dtype: str  # fp32 / fp16 / bf16
    task: Task  # its tokenizer set the vocabulary; RACE's data set train.iters
    recompute_choice: RecomputeChoice | None  # the planner's decision for model.recompute: auto

    @property
    def is_rank0(self) -> bool:
        return self.ps.rank == 0


def apply(cfg: Config, changes: Changes) -> list[str]:
    """Set ``changes`` in ``cfg`` (not yet frozen: a frozen section raises); returns the ``section.key=value``
    that differed. The one writer of a loaded config's fields."""
    changed = []
    for section, values in changes.items():
        part = getattr(cfg, section)
        for key, value in values.items():
            if getattr(part, key) != value:
                changed.append(f"{section}.{key}={value}")
                setattr(part, key, value)
    return changed


def adopt_model_config(cfg: Config) -> None:
    """``train.init_from``'s model shape set in ``cfg.model`` (no-op without ``train.init_from``); the first
    step of :func:`resolve_run`, not yet validated (the one validation comes at its end)."""
    changed = apply(cfg, {"model": init_from.adopted_shape(cfg)})
    if changed:
        logger.info("train.init_from=%s: model shape from the checkpoint (%s)", cfg.train.init_from,
                    ", ".join(c.removeprefix("model.") for c in changed))


def allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 unless the accelerator claims support; the CPU accelerator claims it
    only on CPUs with native fp16 (AVX512-FP16/AMX). torch still runs fp16 on any CPU, slowly."""
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        acc.is_fp16_supported = lambda: True
        acc.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]


def start_process(cfg: Config) -> tuple[str, ParallelState]:
    """Per-process start-up shared by every training entry point: dtype, CPU threads, process groups
    (which check the world size against TP x PP), then the RNG streams (DeepSpeed's tracker configured
    before any seeding). Returns (dtype, ParallelState)."""
    on_gpu = tdev.local_device().type == "cuda"  # the accelerator DeepSpeed will use, not just torch's view
    dtype = resolve_dtype(cfg, on_gpu)
    if cfg.parallel.pipeline_schedule == "interleaved" and on_gpu:  # before any process group: NCCL's one refusal
        check_backend("nccl", os.environ)
    if dtype == "fp16" and not on_gpu:
        allow_fp16_on_cpu()
    if not on_gpu:
        # one process per core share: avoid oversubscribing the CPU with intra-op threads
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    ps = ParallelState(tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, cp=cfg.parallel.context)
    tp_random.configure(ps, cfg.model.num_layers)  # before any seeding
    tp_random.set_seed(cfg.train.seed)
    return dtype, ps


def resolve_recompute(cfg: Config, dp: int, dtype: str) -> RecomputeChoice | None:
    """``model.recompute: auto`` decided by the planner (none, selective or full) for the smallest device memory
    over all ranks (a collective: every rank must decide alike, or TP ranks would recompute differently). Returns
    the choice; :func:`resolve_run` sets it."""
    if cfg.model.recompute != "auto":
        return None
    dev = tdev.local_device()
    gib = torch.tensor(device_memory_gib(dev), dtype=torch.float64, device=dev)
    dist.all_reduce(gib, op=dist.ReduceOp.MIN)
    return recompute.resolve(cfg, dp, dtype, float(gib), dev.type == "cuda")


def resolve_run(cfg: Config, task_factory: TaskFactory | None = None) -> ResolvedRun:
    """Resolve ``cfg`` in place and freeze it (a collective: every rank calls it); see the module's text."""
    adopt_model_config(cfg)  # train.init_from: the source's model shape (no-op when unset)
    dtype, ps = start_process(cfg)
    task = (task_factory or make_task)(cfg, ps, ps.dims.dp)
    apply(cfg, task.config_changes())  # e.g. RACE's schedule from its data
    tok_vocab = task.tokenizer.vocab_size
    vocab = cfg.model.vocab_size or tok_vocab
    if vocab < tok_vocab:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {tok_vocab}")
    apply(cfg, {"model": {"vocab_size": vocab}})
    choice = resolve_recompute(cfg, ps.dims.dp, dtype)
    if choice is not None:
        apply(cfg, {"model": {"recompute": choice.recompute}})
        if ps.rank == 0:
            logger.info("model.recompute=auto -> %s: %s", choice.recompute, choice.describe())
    validate_static(cfg)  # the one validation of the resolved config
    layout = derive_layout(cfg, ps.dims.world_size, vocab)
    freeze(cfg)  # everything derived from the config is in the layout (or the task) from here on
    return ResolvedRun(cfg=cfg, layout=layout, ps=ps, dtype=dtype, task=task, recompute_choice=choice)
