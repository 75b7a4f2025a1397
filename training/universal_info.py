"""How DeepSpeed's universal checkpoint merges this project's tensor-parallel shards: the
``universal_checkpoint_info`` every checkpoint's client state carries (DeepSpeed's
``deepspeed.checkpoint.ds_to_universal`` reads it from the ``mp_rank_XX_model_states.pt`` files).

``ds_to_universal`` concatenates the TP slices of each parameter along dim 0 unless a pattern says otherwise.
The patterns are derived from each parameter's partition tag (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, set by ``training.parallel.layers``), one pattern per parameter type (the layer index
generalised to ``\\d+``):

| parameter | tag | DeepSpeed category |
|---|---|---|
| LayerNorm/RMSNorm, position embeddings, RowParallelLinear bias, BERT pooler/heads | none (replicated) | ``tp_replicated_parameter_patterns`` (every TP copy equal; one is kept) |
| RowParallelLinear weight | dim 1 | ``parameter_with_row_parallelism_patterns`` (concatenated on dim 1) |
| ColumnParallelLinear weight/bias, stride 1 | dim 0 | none: DeepSpeed's default, dim 0 |
| fused QKV ``[Q; K; V]`` (stride 3), swiglu fc ``[gate; up]`` (stride 2) | dim 0, stride s | ``parameter_with_sub_params``: s equal sub-parameters, each cut over the TP ranks |
| word embeddings, untied output layer (2-D, one row per padded vocabulary entry) | dim 0 | ``vocabulary_parameter_patterns`` as well |

DeepSpeed strips a vocabulary parameter to ``original_vocab_size`` rows and pads it with zero rows on load up to
the target's padded size. It is given the *padded* vocabulary here, so the trained padding rows are kept (a run at
the same TP continues exactly; a run at another TP must pad alike: ``training.universal.check_vocab``). BERT's 1-D
LM-head bias is left out of the vocabulary list (DeepSpeed's strip indexes two dimensions).

:func:`classify` is the one place the tags are read; a tag of a kind not in the table raises, so a new kind of
partition cannot reach a checkpoint without a rule (``tests/unit/test_universal.py`` checks every parameter of the
GPT-2, Llama and BERT models against the TP layers that hold it).
"""
from __future__ import annotations

import re

import torch
from deepspeed.checkpoint.constants import (
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCABULARY_PARAMETER_PATTERNS,
)

from training.parallel.sharding import is_vocab_sized

UNIVERSAL_INFO_KEY = UNIVERSAL_CHECKPOINT_INFO  # the client-state key DeepSpeed's converter reads
INFO_VERSION = 0.4  # the universal format whose sub-parameters carry their per-rank widths

REPLICATED, ROW, COLUMN, SUB_PARAMS = "replicated", "row", "column", "sub_params"


def name_pattern(name: str) -> str:
    """The regular expression of a parameter's type: its name with every layer index generalised
    (``layers.3.attn.qkv.weight`` -> ``^layers\\.\\d+\\.attn\\.qkv\\.weight$``)."""
    return "^" + r"\.\d+\.".join(re.escape(part) for part in re.split(r"\.\d+\.", name)) + "$"


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """This rank's shape of ``param`` (under ZeRO-3 the shape before DeepSpeed partitioned it: ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def classify(param: torch.nn.Parameter) -> str:
    """A parameter's category from its partition tag: replicated (untagged), row (dim 1), column (dim 0, stride 1)
    or sub_params (dim 0, stride > 1). Any other tag raises ValueError."""
    if not getattr(param, "tensor_model_parallel", False):
        return REPLICATED
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if dim == 1 and stride == 1:
        return ROW
    if dim == 0:
        return COLUMN if stride == 1 else SUB_PARAMS
    raise ValueError(f"partition_dim={dim} stride={stride}: no universal-checkpoint rule for this partition")


def _sub_params(pattern: str, param: torch.nn.Parameter, tp: int) -> tuple[dict, list]:
    """The DeepSpeed ``SubparamShape`` of a strided column-parallel parameter (``stride`` equal parts along dim 0,
    each cut into ``tp`` pieces: ``training.parallel.sharding.shard``) and its per-rank widths."""
    stride, local = param.partition_stride, full_shape(param)
    size = local[0] * tp // stride  # one sub-parameter's full rows
    shape = ((size,) * stride, *local[1:])
    return ({"patterns": [pattern], "shape": shape, "partition_dim": 0},
            [[size // tp] * tp for _ in range(stride)])


def universal_checkpoint_info(model: torch.nn.Module, padded_vocab: int, tp: int) -> dict:
    """DeepSpeed's ``universal_checkpoint_info`` for ``model`` (this rank's TP shards, TP degree ``tp``): the
    patterns of the module docstring's table, one per parameter type."""
    replicated: list[str] = []
    row: list[str] = []
    vocab: list[str] = []
    sub_params: list[dict] = []
    widths: dict[str, list] = {}
    for name, p in model.named_parameters():
        pattern, kind = name_pattern(name), classify(p)
        if kind == REPLICATED and pattern not in replicated:
            replicated.append(pattern)
        elif kind == ROW and pattern not in row:
            row.append(pattern)
        elif kind == SUB_PARAMS and pattern not in widths:
            shape, widths[pattern] = _sub_params(pattern, p, tp)
            sub_params.append(shape)
        if is_vocab_sized(name) and len(full_shape(p)) == 2 and pattern not in vocab:
            vocab.append(pattern)
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: INFO_VERSION,
            TP_REPLICATED_PARAMETER_PATTERNS: replicated,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
            PARAMETER_WITH_SUB_PARAMS: sub_params,
            SUB_PARAM_SHARD_WIDTHS: widths,
            VOCABULARY_PARAMETER_PATTERNS: vocab,
            "original_vocab_size": padded_vocab}
