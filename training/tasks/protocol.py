"""What the trainer trains: the task protocol, and the one path by which a batch reaches the device.

The trainer (:class:`training.trainer.Trainer`: DeepSpeed engine, steps, clipping, metrics, checkpoints)
is the same for every task; a task (GPT-2 pretraining, BERT pretraining, RACE fine-tuning) owns its data,
its model and its loss. Batches come from the task on the host and reach the device through one function,
:func:`batch_to_device`: :meth:`Task.loss` calls it on the batch it is given (a no-op for a batch already
there), and the trainer calls it for the pipeline engine, which runs the model on the batches itself.

Tasks subclass :class:`Task` explicitly to inherit the optional hooks' defaults. The hooks get explicit
parts, never the trainer: the engine (to run the model), the :class:`~training.checkpoint.TrainState`
(iteration, consumed samples) and a ``save_checkpoint()`` callable (the trainer's parts bound).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch

from training.runtime import device as tdev

if TYPE_CHECKING:
    from training.checkpoint import TrainState
    from training.layout import Layout
    from training.metrics import MetricsWriter


def batch_to_device(batch: Any, engine: torch.nn.Module) -> Any:
    """``batch`` (tensors in tuples, lists or dicts) on the device DeepSpeed put ``engine``'s model on;
    DeepSpeed's engine does not move inputs itself."""
    return tdev.to_device(batch, tdev.module_device(engine))


class Task(Protocol):
    tokenizer: Any  # megatron_ds_suite.core.tokenizer.Tokenizer: saved with every checkpoint
    tokens_per_sample: int  # tokens of one sample (throughput metric)
    # True: the trainer saves at train.save_interval and at the end; False: the task's hooks save
    periodic_checkpoints: bool = True
    # True: every step's metrics are read back as numbers (one host sync per step) before on_step_end; False:
    # only log steps' (the others carry device tensors, so the host can run ahead of the GPU)
    reads_every_step: bool = False

    # ---- required ---------------------------------------------------------------------------------
    def build_data(self) -> None:
        """Build (or load rank 0's cached) datasets; collective when torch.distributed is initialised."""
        ...

    def build_model(self, padded_vocab: int) -> torch.nn.Module:
        """The model of this rank (its TP shards, or its pipeline stage)."""
        ...

    def micro_batches(self, consumed_samples: int) -> Iterable[Any]:
        """The host micro-batches of this DP rank for the step that starts at ``consumed_samples``."""
        ...

    def valid_micro_batches(self, i: int) -> Iterable[Any] | None:
        """The same for validation batch ``i``; None when there is no validation split."""
        ...

    def loss(self, engine: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """(scalar loss to back-propagate, {name: scalar} parts to log) of a host batch, moved to the engine's
        device with :func:`batch_to_device`."""
        ...

    # ---- optional hooks (defaults) ------------------------------------------------------------------
    def config_changes(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` the task needs set in the run config (e.g. RACE's ``train.iters`` and
        warmup, from its data); :func:`training.resolve.resolve_run` sets them before it validates and freezes
        the config. A task never writes the config itself. Default: nothing."""
        return {}

    def padded_vocab(self, layout: Layout) -> int:
        """The padded vocabulary of the model (default: the layout's, Megatron's padding)."""
        assert layout.padded_vocab is not None
        return layout.padded_vocab

    def step_metrics(self, consumed_samples: int) -> dict:
        """Extra values logged with the step that started at ``consumed_samples``."""
        return {}

    def on_train_start(self, engine: torch.nn.Module, writer: MetricsWriter) -> None:
        """Before the first step (after the run directory is locked and the checkpoint loaded)."""

    def on_step_end(self, engine: torch.nn.Module, state: TrainState, metrics: dict, writer: MetricsWriter,
                    save_checkpoint: Callable[[], Path]) -> None:
        """After every optimizer step (e.g. an end-of-epoch evaluation); ``save_checkpoint()`` saves the run's
        checkpoint (collective). ``metrics`` holds device tensors on steps that were not read (see
        ``reads_every_step``)."""

    def on_train_end(self, state: TrainState) -> dict | None:
        """After the last step; what it returns is ``Trainer.train()['task']``."""
        return None
