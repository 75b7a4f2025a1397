"""GPT-2 with Megatron tensor parallelism (pre-LayerNorm, learned positions, tied vocab-parallel head).

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree, V padded vocab.
The layers are :class:`training.models.blocks.TransformerLayer` (pre-LN, causal), shared with BERT.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name), as a
full master weight that is then sliced. So with the same seed and padded vocabulary a TP=k model is
exactly the TP=1 model split k ways, independent of construction order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.models.blocks import TransformerLayer, normal_init
from training.models.ops import dropout
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import VocabParallelEmbedding
from training.parallel.mappings import copy_to_parallel_region, gather_from_parallel_region, group_size


class GPT2Model(nn.Module):
    """GPT-2 language model. ``forward(tokens)`` -> vocab-parallel logits [b, s, V/p];
    ``forward(tokens, labels)`` -> per-token loss [b, s] (vocab-parallel cross-entropy, fp32)."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None = None,
                 seed: int = 1234):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.padded_vocab_size = padded_vocab_size
        std = cfg.init_method_std
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, cfg.hidden_size, group, init_method=normal_init(seed, "embedding.word_embeddings", std))
        self.embedding.position_embeddings = nn.Embedding(cfg.positions, cfg.hidden_size)
        normal_init(seed, "embedding.position_embeddings", std)(self.embedding.position_embeddings.weight)
        self.layers = nn.ModuleList(TransformerLayer(cfg, group, seed, i) for i in range(cfg.num_layers))
        self.final_ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> final hidden states [b, s, h] (after the final LayerNorm)."""
        b, s = tokens.shape
        if s > self.cfg.positions:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings {self.cfg.positions}")
        pos = torch.arange(s, device=tokens.device)
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(pos)  # [b, s, h]
        x = dropout(x, self.cfg.hidden_dropout, self.training)
        for layer in self.layers:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = tp_random.checkpoint(layer, x)
            else:
                x = layer(x)
        return self.final_ln(x)                                            # [b, s, h]

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output layer: f, then x @ E_local^T -> logits for this rank's vocabulary rows.

        hidden [..., h] (replicated, e.g. :meth:`hidden_states`) -> vocab-parallel logits [..., V/p]."""
        return F.linear(copy_to_parallel_region(hidden, self.group), self.embedding.word_embeddings.weight)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.output_logits(self.hidden_states(tokens))           # [b, s, V/p]
        if labels is None:
            return logits
        # the logits are ours and unused after this (the linear's backward needs x and E, not its
        # output): the loss may overwrite them instead of allocating another [b, s, V/p] buffer
        return vocab_parallel_cross_entropy(logits, labels, self.group, inplace=True)  # [b, s]

    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the whole padded vocabulary [b, s, V] (gathers across TP; for evaluation)."""
        return gather_from_parallel_region(self(tokens), self.group)

    def num_parameters(self, exclude_padding: bool = False) -> int:
        """Parameters of the whole model (all TP shards), counting tied weights once."""
        world = group_size(self.group)
        n = 0
        for p in self.parameters():
            n += p.numel() * (world if getattr(p, "tensor_model_parallel", False) else 1)
        if exclude_padding and self.cfg.vocab_size:
            n -= (self.padded_vocab_size - self.cfg.vocab_size) * self.cfg.hidden_size
        return n
