"""The run layout: every value derived from the config and the world size, in one pure function.

``derive_layout(cfg, world_size)`` runs before any process group exists (the launchers call it with
``WORLD_SIZE`` to fail fast with a one-line config error) and again inside the trainer; nothing else
recomputes the data-parallel size, the gradient accumulation or the padded vocabulary.

    DP  = world / (TP x PP)
    gas = global_batch / (micro_batch x DP)       (micro-batches per step on each DP rank)
    padded vocabulary = the smallest multiple of make_vocab_size_divisible_by x TP >= vocab (Megatron)

The two formulas (``grad_accumulation``, ``padded_vocab_size``) live in :mod:`training.config`, whose
DeepSpeed JSON needs the first; this module builds on the config and the config never imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from training.config import Config, ConfigError, grad_accumulation, padded_vocab_size


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    grad_accumulation: int  # micro-batches of one step on each DP rank
    padded_vocab: int | None  # None while the vocabulary size is unknown (taken from the tokenizer later)

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over all DP replicas (global batch / micro batch)."""
        return self.grad_accumulation * self.dp


def derive_layout(cfg: Config, world_size: int, vocab_size: int | None = None) -> Layout:
    """The layout of ``cfg`` on ``world_size`` ranks. ``vocab_size`` (else ``model.vocab_size``) gives the
    padded vocabulary; without either it is None. Raises ConfigError when the layout does not fit."""
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    mp = tp * pp
    if world_size % mp:
        raise ConfigError(f"world size {world_size} is not divisible by TP x PP = {tp} x "
                          f"{pp}: launch a multiple of {mp} processes or change parallel.*")
    dp = world_size // mp
    t = cfg.train
    gas = grad_accumulation(t.global_batch_size, t.micro_batch_size, dp)
    vocab = vocab_size or cfg.model.vocab_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp) if vocab else None
    return Layout(world_size=world_size, tp=tp, pp=pp, dp=dp, micro_batch_size=t.micro_batch_size,
                  global_batch_size=t.global_batch_size, grad_accumulation=gas, padded_vocab=padded)


def check_world(cfg: Config, world_size: int) -> int:
    """Data-parallel size for ``world_size`` ranks; raises ConfigError if the layout does not fit."""
    return derive_layout(cfg, world_size).dp
