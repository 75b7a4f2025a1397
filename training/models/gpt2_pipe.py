"""GPT-2 as a DeepSpeed ``PipelineModule``: the same layers as :mod:`training.models.gpt2`, in stages.

Layer list: tied embedding (stage 0) -> L transformer layers (partitioned evenly by type) -> final
LayerNorm -> the tied embedding again as the output layer (last stage). ``TiedLayerSpec('embed')``
keeps one word-embedding weight per end and DeepSpeed all-reduces its gradient between the first and
last stage. Only hidden states [b, s, h] cross stage boundaries: attention is causal inside each
layer (no mask is sent). Parameters are drawn from the same per-name generators as ``GPTModel``,
so a PP=k model holds exactly the PP=1 weights.

With ``model.untie_embeddings_and_output_weights`` the embedding is an ordinary first layer and the output layer
its own last layer (:class:`OutputLayerPipe`, ``output_layer.weight``): nothing is tied between the stages.
RoPE (``position_embedding: rope``) has no table; the final norm is LayerNorm or RMSNorm (``FinalLayerNorm`` /
``FinalRMSNorm``, both named ``final_ln``).

With sequence parallelism (``parallel.sequence_parallel``, as in :mod:`training.models.gpt2`) the stages send
each other this rank's sequence chunk [b, s/p, h]: p times less point-to-point traffic per TP rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from training.models.blocks import (
    RMSNorm,
    TransformerLayer,
    embedding_dropout,
    mark_norm_sequence_parallel,
    normal_init,
)
from training.models.config import ModelConfig
from training.models.gpt2 import output_layer
from training.models.pipe_chunks import schedule_module
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import VocabParallelEmbedding, column_parallel_linear
from training.parallel.mappings import group_size, scatter_to_sequence_parallel_region
from training.parallel.pipe_scatter import scatter_group
from training.parallel.state import ParallelState


class EmbeddingPipe(nn.Module):
    """Token + position embeddings and embedding dropout (stage 0); its word embedding doubles as
    the output layer on the last stage."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        std = cfg.init_method_std
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, group,
                                                      init_method=normal_init(seed, "embedding.word_embeddings", std),
                                                      sequence_parallel=self.sequence_parallel)
        if cfg.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(cfg.positions, cfg.hidden_size)
            normal_init(seed, "embedding.position_embeddings", std)(self.position_embeddings.weight)
        else:  # RoPE: no table
            self.position_embeddings = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)                                           # [b, s, h] ([b, s/p, h] SP)
        if self.position_embeddings is not None:
            pos = self.position_embeddings(torch.arange(tokens.size(1), device=tokens.device))  # [s, h]
            if self.sequence_parallel:
                pos = scatter_to_sequence_parallel_region(pos, self.group, dim=0)
            x = x + pos
        return embedding_dropout(x, self.cfg.hidden_dropout, self.training, self.sequence_parallel)


def output_logits(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """Tied output layer: f (sequence parallel: g), then x @ E_local^T -> vocab-parallel logits [b, s, V/p]."""
    return column_parallel_linear(x, embedding.word_embeddings.weight, None, embedding.group,
                                  sequence_parallel=embedding.sequence_parallel)


class FinalLayerNorm(nn.LayerNorm):
    def __init__(self, hidden_size: int, eps: float, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__(hidden_size, eps=eps)
        if sequence_parallel:
            mark_norm_sequence_parallel(self, group)


class FinalRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__(hidden_size, eps=eps)
        if sequence_parallel:
            mark_norm_sequence_parallel(self, group)


class OutputLayerPipe(nn.Module):
    """The untied output layer on the last stage: f, then x @ W_local^T -> vocab-parallel logits [b, s, V/p]."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel and group_size(group) > 1
        layer = output_layer(cfg, padded_vocab, group, seed)
        assert layer is not None
        self.weight = layer.weight  # the parameter with its partition tag; named "output_layer.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, None, self.group, sequence_parallel=self.sequence_parallel)


def build_gpt2_pipe(cfg: ModelConfig, padded_vocab: int, ps: ParallelState, seed: int,
                    sequence_parallel: bool = False, schedule: str = "1f1b",
                    virtual_pipeline: int = 1) -> PipelineModule:
    """The stages for ``schedule`` (:func:`~training.models.pipe_chunks.schedule_module`: '1f1b', 'interleaved'
    with ``virtual_pipeline`` chunks per rank, 'dualpipev')."""
    group, sp = ps.tp_group, sequence_parallel

    def loss_fn(logits, labels):
        real = cfg.vocab_size if cfg.mask_vocab_padding else None  # model.mask_vocab_padding
        return vocab_parallel_cross_entropy(logits, labels, group, vocab_size=real).mean()

    final_norm = FinalRMSNorm if cfg.normalization == "rmsnorm" else FinalLayerNorm
    layers = [LayerSpec(TransformerLayer, cfg, group, seed, i, sequence_parallel=sp) for i in range(cfg.num_layers)]
    final = LayerSpec(final_norm, cfg.hidden_size, eps=cfg.layernorm_epsilon, group=group, sequence_parallel=sp)
    if cfg.untie_embeddings_and_output_weights:
        specs = [LayerSpec(EmbeddingPipe, cfg, padded_vocab, group, seed, sequence_parallel=sp), *layers, final,
                 LayerSpec(OutputLayerPipe, cfg, padded_vocab, group, seed, sequence_parallel=sp)]
    else:
        specs = [
            TiedLayerSpec("embed", EmbeddingPipe, cfg, padded_vocab, group, seed, sequence_parallel=sp,
                          tied_weight_attr="word_embeddings.weight"),
            *layers, final,
            TiedLayerSpec("embed", EmbeddingPipe, cfg, padded_vocab, group, seed, sequence_parallel=sp,
                          forward_fn=output_logits, tied_weight_attr="word_embeddings.weight"),
        ]
    kwargs = dict(layers=specs, topology=ps.topology, loss_fn=loss_fn, partition_method="type:TransformerLayer",
                  activation_checkpoint_interval=1 if cfg.recompute == "full" else 0,
                  activation_checkpoint_func=tp_random.checkpoint, checkpointable_layers=["TransformerLayer"])
    return schedule_module(schedule, virtual_pipeline, scatter_group(group, sp), **kwargs)


def pipe_layer_names(num_layers: int, untied: bool = False) -> dict[int, str]:
    """PipelineModule layer index -> ``GPTModel`` parameter-name prefix (for merging checkpoints).

    Index num_layers + 2 is the output layer: the tied embedding again (its parameters are DeepSpeed's
    ``tied_modules.embed.*``, no index of its own), or with ``untied`` the separate ``output_layer.``."""
    names = {0: "embedding.", num_layers + 1: "final_ln."}
    names.update({i + 1: f"layers.{i}." for i in range(num_layers)})
    if untied:
        names[num_layers + 2] = "output_layer."
    return names
