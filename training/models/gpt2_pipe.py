"""GPT-2 as a DeepSpeed ``PipelineModule``: the same layers as :mod:`training.models.gpt2`, in stages.

Layer list: tied embedding (stage 0) -> L transformer layers (partitioned evenly by type) -> final
LayerNorm -> the tied embedding again as the output layer (last stage). ``TiedLayerSpec('embed')``
keeps one word-embedding weight per end and DeepSpeed all-reduces its gradient between the first and
last stage. Only hidden states [b, s, h] cross stage boundaries: attention is causal inside each
layer (no mask is sent). Parameters are drawn from the same per-name generators as ``GPT2Model``,
so a PP=k model holds exactly the PP=1 weights.

With ``model.untie_embeddings_and_output_weights`` the embedding is an ordinary first layer and the output layer
its own last layer (:class:`OutputLayerPipe`, ``output_layer.weight``): nothing is tied between the stages.
RoPE (``position_embedding: rope``) has no table; the final norm is LayerNorm or RMSNorm (``FinalLayerNorm`` /
``FinalRMSNorm``, both named ``final_ln``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from training.config import ModelConfig
from training.models.blocks import RMSNorm, TransformerLayer, normal_init
from training.models.gpt2 import output_layer
from training.models.ops import dropout
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import VocabParallelEmbedding
from training.parallel.mappings import copy_to_parallel_region
from training.parallel.state import ParallelState


class EmbeddingPipe(nn.Module):
    """Token + position embeddings and embedding dropout (stage 0); its word embedding doubles as
    the output layer on the last stage."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int):
        super().__init__()
        self.cfg, self.group = cfg, group
        std = cfg.init_method_std
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, group,
                                                      init_method=normal_init(seed, "embedding.word_embeddings", std))
        if cfg.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(cfg.positions, cfg.hidden_size)
            normal_init(seed, "embedding.position_embeddings", std)(self.position_embeddings.weight)
        else:  # RoPE: no table
            self.position_embeddings = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)                                           # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.size(1), device=tokens.device))
        return dropout(x, self.cfg.hidden_dropout, self.training)


def output_logits(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """Tied output layer: f, then x @ E_local^T -> vocab-parallel logits [b, s, V/p]."""
    return F.linear(copy_to_parallel_region(x, embedding.group), embedding.word_embeddings.weight)


class FinalLayerNorm(nn.LayerNorm):
    pass


class FinalRMSNorm(RMSNorm):
    pass


class OutputLayerPipe(nn.Module):
    """The untied output layer on the last stage: f, then x @ W_local^T -> vocab-parallel logits [b, s, V/p]."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int):
        super().__init__()
        self.group = group
        layer = output_layer(cfg, padded_vocab, group, seed)
        assert layer is not None
        self.weight = layer.weight  # the parameter with its partition tag; named "output_layer.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel_region(x, self.group), self.weight)


def build_gpt2_pipe(cfg: ModelConfig, padded_vocab: int, ps: ParallelState, seed: int) -> PipelineModule:
    group = ps.tp_group

    def loss_fn(logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, group).mean()

    final_norm = FinalRMSNorm if cfg.normalization == "rmsnorm" else FinalLayerNorm
    layers = [LayerSpec(TransformerLayer, cfg, group, seed, i) for i in range(cfg.num_layers)]
    final = LayerSpec(final_norm, cfg.hidden_size, eps=cfg.layernorm_epsilon)
    if cfg.untie_embeddings_and_output_weights:
        specs = [LayerSpec(EmbeddingPipe, cfg, padded_vocab, group, seed), *layers, final,
                 LayerSpec(OutputLayerPipe, cfg, padded_vocab, group, seed)]
    else:
        specs = [
            TiedLayerSpec("embed", EmbeddingPipe, cfg, padded_vocab, group, seed,
                          tied_weight_attr="word_embeddings.weight"),
            *layers, final,
            TiedLayerSpec("embed", EmbeddingPipe, cfg, padded_vocab, group, seed, forward_fn=output_logits,
                          tied_weight_attr="word_embeddings.weight"),
        ]
    return PipelineModule(layers=specs, topology=ps.topology, loss_fn=loss_fn,
                          partition_method="type:TransformerLayer",
                          activation_checkpoint_interval=1 if cfg.recompute == "full" else 0,
                          activation_checkpoint_func=tp_random.checkpoint,
                          checkpointable_layers=["TransformerLayer"])


def pipe_layer_names(num_layers: int, untied: bool = False) -> dict[int, str]:
    """PipelineModule layer index -> ``GPT2Model`` parameter-name prefix (for merging checkpoints).

    Index num_layers + 2 is the output layer: the tied embedding again (its parameters are DeepSpeed's
    ``tied_modules.embed.*``, no index of its own), or with ``untied`` the separate ``output_layer.``."""
    names = {0: "embedding.", num_layers + 1: "final_ln."}
    names.update({i + 1: f"layers.{i}." for i in range(num_layers)})
    if untied:
        names[num_layers + 2] = "output_layer."
    return names
