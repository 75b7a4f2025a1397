"""Whether a model shape fits a parallel layout: the planner's checks before any arithmetic.

The layout itself is :class:`training.layout.Layout`, the trainer's too (re-exported here for the planner's
modules); its own rules (degrees, batch split) are :meth:`~training.layout.Layout.check`. This module adds
the rules that need the model: heads, query groups, MLP width and padded vocabulary divisible by TP,
layers by PP, positions covering the sequence.
"""
from __future__ import annotations

from megatron_ds_suite.core.errors import ConfigError
from training.layout import Layout
from training.plan.accounting import ModelShape

__all__ = ["Layout", "validate"]


def validate(shape: ModelShape, lay: Layout) -> None:
    """One-line ConfigError for every impossible combination, before any arithmetic."""
    lay.check(flags=True)
    if shape.hidden % shape.heads:
        raise ConfigError(f"hidden size {shape.hidden} is not divisible by {shape.heads} heads")
    if shape.heads % lay.tp:
        raise ConfigError(f"--tp {lay.tp} does not divide the {shape.heads} attention heads: choose a TP "
                          f"degree that divides the head count")
    if shape.kv_heads is not None and (shape.kv_heads < 1 or shape.heads % shape.kv_heads):
        raise ConfigError(f"{shape.kv_heads} query groups do not divide the {shape.heads} attention heads")
    if shape.kv_heads is not None and shape.kv_heads % lay.tp:
        raise ConfigError(f"--tp {lay.tp} does not divide the {shape.kv_heads} query groups (key/value heads): "
                          f"choose a TP degree that divides model.num_query_groups")
    if shape.ffn % lay.tp:
        raise ConfigError(f"--tp {lay.tp} does not divide the MLP width {shape.ffn}")
    if shape.vocab % lay.tp:
        raise ConfigError(f"--tp {lay.tp} does not divide the padded vocabulary {shape.vocab}")
    if shape.num_layers % lay.pp:
        raise ConfigError(f"--pp {lay.pp} does not divide the {shape.num_layers} layers: choose a PP degree "
                          f"that divides model.num_layers")
    if lay.pp > 1 and shape.arch == "bert":
        raise ConfigError("--pp > 1 with BERT: pipeline parallelism is GPT-only (BERT is TP-only under DeepSpeed)")
    if lay.sequence_parallel and lay.tp == 1:
        raise ConfigError("sequence parallelism needs --tp > 1 (it splits the sequence across the TP ranks)")
    if lay.sequence_parallel and shape.seq % lay.tp:
        raise ConfigError(f"sequence parallelism: seq_length {shape.seq} is not a multiple of --tp {lay.tp}")
    if shape.positions < shape.seq:
        raise ConfigError(f"max_position_embeddings {shape.positions} < seq_length {shape.seq}")
