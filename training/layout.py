"""The one parallel layout (TP x PP x DP and the batch), and the run's, derived from the config in one function.

:class:`Layout` is what both the trainer and the planner (:mod:`training.plan`) reason about; its own rules
(degrees >= 1, the global batch split into micro-batches over DP) live in :meth:`Layout.check`, the only
validator of them. ``derive_layout(cfg, world_size)`` runs before any process group exists (the launchers
call :func:`launch_layout`, on the launched processes, to fail fast with a one-line config error) and once more when the run is
resolved (:func:`training.resolve.resolve_run`, with the tokenizer's vocabulary); nothing else recomputes the
data-parallel size, the gradient accumulation or the padded vocabulary.

    DP  = world / (TP x PP)
    gas = global_batch / (micro_batch x DP)       (micro-batches per step on each DP rank)
    padded vocabulary = the smallest multiple of make_vocab_size_divisible_by x TP >= vocab (Megatron)

The two formulas (``grad_accumulation``, ``padded_vocab_size``) live in :mod:`training.config`, whose
DeepSpeed JSON needs the first; this module builds on the config and the config never imports it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from megatron_ds_suite.core.errors import ConfigError
from training.config import Config, grad_accumulation
from training.models.config import padded_vocab_size
from training.parallel_config import check_micro_batches


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP ranks and the batch of one optimizer step (the planner's defaults: one 8-GPU node)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 8  # samples per micro-batch on one rank
    global_batch: int = 8  # samples per optimizer step over all DP replicas
    gpus_per_node: int = 8  # where TP/DP traffic leaves the node (the planner's time model)
    padded_vocab: int | None = None  # None while the vocabulary size is unknown (the planner never needs it)
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``parallel.sequence_parallel``): activations outside the TP regions
    split along the sequence, i.e. divided by ``tp`` (:func:`training.plan.memory.activation_bytes_per_layer`)."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank under the interleaved schedule (``parallel.virtual_pipeline``; 1 = 1F1B):
    the bubble (p-1)/(v m), v times the stage-to-stage sends, more activations in flight (docs/pipeline.md)."""
    dualpipev: bool = False
    """DeepSpeed's DualPipeV (``parallel.pipeline_schedule: dualpipev``): two stages of l/(2p) layers per rank, rank 0
    holding the first and the last; the planner's bubble, sends and activations in flight follow its schedule
    (:func:`training.plan.memory.micro_batches_in_flight`, :func:`training.plan.timing.bubble_fraction`)."""
    context: int = 1
    """Context-parallel degree c (``parallel.context``, docs/context_parallel.md): each sample's tokens split over c
    ranks, every activation (the s^2 attention scores too) / c, ZeRO's shards over DP x c."""
    context_impl: str = "ulysses"
    """``parallel.context_impl``: ``ulysses`` (all-to-alls around attention) or ``ring`` (K/V passed round the CP
    ring); the planner's CP traffic (:func:`training.plan.context_comm.context_comm`)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.context

    @property
    def world(self) -> int:
        return self.world_size

    @property
    def grad_accumulation(self) -> int:
        """m: micro-batches of one step on each DP rank (raises ConfigError when the global batch does not split)."""
        return grad_accumulation(self.global_batch, self.micro_batch, self.dp)

    @property
    def num_micro(self) -> int:
        """The planner's name for :attr:`grad_accumulation` (m in its formulas)."""
        return self.grad_accumulation

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over all DP replicas (global batch / micro batch)."""
        return self.grad_accumulation * self.dp

    def check(self, flags: bool = False) -> None:
        """One-line ConfigError when the layout itself is impossible: a degree or batch size below 1, or a
        global batch that micro-batches over DP do not fill. ``flags``: name the planner's command-line
        flags (``--tp``) instead of the config keys."""
        names = ({"tp": "--tp", "pp": "--pp", "dp": "--dp", "micro_batch": "micro batch",
                  "global_batch": "global batch", "gpus_per_node": "gpus per node"} if flags else
                 {"tp": "parallel.tensor", "pp": "parallel.pipeline", "dp": "data-parallel size",
                  "micro_batch": "train.micro_batch_size", "global_batch": "train.global_batch_size",
                  "gpus_per_node": "gpus per node"})
        for field, name in names.items():
            if getattr(self, field) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, field)}")
        if self.global_batch % (self.micro_batch * self.dp):
            if flags:
                raise ConfigError(f"global batch {self.global_batch} is not divisible by micro batch x DP = "
                                  f"{self.micro_batch} x {self.dp}: change train.global_batch_size or --dp")
            grad_accumulation(self.global_batch, self.micro_batch, self.dp)  # raises the config keys' error


def virtual_chunks(cfg: Config) -> int:
    """v of ``cfg``'s pipeline schedule for the planner (1 for 1F1B and DualPipeV)."""
    p = cfg.parallel
    return p.virtual_pipeline if p.pipeline > 1 and p.pipeline_schedule == "interleaved" else 1


def runs_dualpipev(cfg: Config) -> bool:
    """Whether ``cfg`` pipelines with DualPipeV (the planner's :attr:`Layout.dualpipev`)."""
    return cfg.parallel.pipeline > 1 and cfg.parallel.pipeline_schedule == "dualpipev"


def launched_world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``; 1 for one plain process), known before any
    process group exists: the one place that reads it for a layout."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def entry_module() -> str | None:
    """The module this process was started as (``python -m X``: X, without a package's ``.__main__``), or None."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return name.removesuffix(".__main__") if name else None


def data_parallel_size(world_size: int, tp: int, pp: int = 1, flags: bool = False) -> int:
    """DP = world / (TP x PP): the one check that ``world_size`` processes split into model-parallel groups (the
    run config's in :func:`derive_layout`, evaluation's ``--tp``). One-line ConfigError otherwise, naming the config
    keys or, with ``flags``, the command-line flags."""
    mp = tp * pp
    if world_size == 1 and mp > 1:  # one plain process: the launcher is what is missing
        needs = f"--tp {tp}" + (f" x --pp {pp}" if pp > 1 else "") if flags else f"TP x PP = {tp} x {pp}"
        module = entry_module() or ("evaluation" if flags else "training.pretrain")
        raise ConfigError(f"{needs} needs {mp} processes and this is one: run under the launcher, `deepspeed "
                          f"--num_gpus {mp} --module {module} ...` (DS_ACCELERATOR=cpu on a CPU machine)"
                          + ("" if flags else ", or set parallel.tensor=1 and parallel.pipeline=1"))
    if world_size % mp:
        if flags:
            degrees = f"--tp {tp}" + (f" x --pp {pp}" if pp > 1 else "")
            raise ConfigError(f"{world_size} processes are not divisible by {degrees}: launch a multiple of {mp} "
                              "processes")
        raise ConfigError(f"world size {world_size} is not divisible by TP x PP = {tp} x "
                          f"{pp}: launch a multiple of {mp} processes or change parallel.*")
    return world_size // mp


def derive_layout(cfg: Config, world_size: int, vocab_size: int | None = None) -> Layout:
    """The layout of ``cfg`` on ``world_size`` ranks. ``vocab_size`` (else ``model.vocab_size``) gives the
    padded vocabulary; without either it is None. Raises ConfigError when the layout does not fit."""
    tp, pp, cp = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.context
    if cp > 1 and world_size % (cp * tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by TP x CP x PP = {tp} x {cp} x {pp}: launch a "
                          f"multiple of {tp * cp * pp} processes")
    dp = data_parallel_size(world_size // max(cp, 1), tp, pp)  # context-parallel ranks share their samples
    t = cfg.train
    vocab = vocab_size or cfg.model.vocab_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp) if vocab else None
    lay = Layout(tp=tp, pp=pp, dp=dp, micro_batch=t.micro_batch_size, global_batch=t.global_batch_size,
                 padded_vocab=padded, sequence_parallel=cfg.parallel.sequence_parallel,
                 virtual_pipeline=virtual_chunks(cfg), dualpipev=runs_dualpipev(cfg), context=cp,
                 context_impl=cfg.parallel.context_impl)
    lay.check()
    check_micro_batches(cfg.parallel, lay.grad_accumulation)  # the pipeline schedule's rule on m
    return lay


def launch_layout(cfg: Config) -> Layout:
    """The layout of ``cfg`` on the processes the launcher started: what every training entry point checks
    before any process group exists (a one-line ConfigError when they do not fit)."""
    return derive_layout(cfg, launched_world_size())


def check_world(cfg: Config, world_size: int) -> int:
    """Data-parallel size for ``world_size`` ranks; raises ConfigError if the layout does not fit."""
    return derive_layout(cfg, world_size).dp
