"""The parallel layout the planner evaluates (TP x PP x DP, micro and global batch) and its checks."""
from __future__ import annotations

from dataclasses import dataclass

from training.config import ConfigError
from training.plan.accounting import ModelShape
from training.layout import grad_accumulation


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 8
    global_batch: int = 8
    gpus_per_node: int = 8
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``parallel.sequence_parallel``): activations outside the TP regions
    split along the sequence, i.e. divided by ``tp`` (:func:`training.plan.memory.activation_bytes_per_layer`)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_micro(self) -> int:
        """m: micro-batches per optimizer step on one data-parallel replica (training.layout's rule)."""
        return grad_accumulation(self.global_batch, self.micro_batch, self.dp)


def validate(shape: ModelShape, lay: Layout) -> None:
    """One-line ConfigError for every impossible combination, before any arithmetic."""
    for name, v in [("--tp", lay.tp), ("--pp", lay.pp), ("--dp", lay.dp), ("micro batch", lay.micro_batch),
                    ("global batch", lay.global_batch), ("gpus per node", lay.gpus_per_node)]:
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
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
    if lay.global_batch % (lay.micro_batch * lay.dp):
        raise ConfigError(f"global batch {lay.global_batch} is not divisible by micro batch x DP = "
                          f"{lay.micro_batch} x {lay.dp}: change train.global_batch_size or --dp")
    if lay.sequence_parallel and lay.tp == 1:
        raise ConfigError("sequence parallelism needs --tp > 1 (it splits the sequence across the TP ranks)")
    if lay.sequence_parallel and shape.seq % lay.tp:
        raise ConfigError(f"sequence parallelism: seq_length {shape.seq} is not a multiple of --tp {lay.tp}")
    if shape.positions < shape.seq:
        raise ConfigError(f"max_position_embeddings {shape.positions} < seq_length {shape.seq}")

