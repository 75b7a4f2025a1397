""":class:`GPTModel` (``model.arch: gpt``; ``gpt2`` is the same): GPT-2 with Megatron tensor parallelism
(pre-LayerNorm, learned positions, tied vocab-parallel head), and the Llama family on the same core: RoPE instead
of the position table, RMSNorm, SwiGLU, grouped-query attention, an untied vocab-parallel output layer
(``output_layer.weight`` [V/p, h] per rank), no biases (the options of ``training.models.config.ModelConfig``; the blocks
are in :mod:`training.models.blocks`).

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree, V padded vocab.
The layers are :class:`training.models.blocks.TransformerLayer` (pre-LN, causal), shared with BERT.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Sequence parallelism (``sequence_parallel=True``, ``parallel.sequence_parallel``; see
:mod:`training.models.blocks`): the word embedding's partial sums are reduce-scattered to this rank's sequence
chunk [b, s/p, h] (g-bar, instead of the all-reduce), the learned position embeddings of the chunk's positions
added, dropout, the layers and the final norm run on the chunk, and the output layer all-gathers it (g) before
the vocab-parallel projection. The weights are the same as without it (checkpoints are interchangeable); the
sequence length must be a multiple of p.

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name), as a
full master weight that is then sliced. So with the same seed and padded vocabulary a TP=k model is
exactly the TP=1 model split k ways, independent of construction order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from training.models.blocks import (
    TransformerLayer,
    embedding_dropout,
    mark_norm_sequence_parallel,
    norm,
    normal_init,
)
from training.models.config import ModelConfig
from training.models.kv_cache import KVCache
from training.models.sliding_window import within_window
from training.parallel import random as tp_random
from training.parallel.context import ContextParallel
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, column_parallel_linear
from training.parallel.mappings import (
    gather_from_parallel_region,
    group_size,
    scatter_to_sequence_parallel_region,
)


class GPTModel(nn.Module):
    """The GPT language model (GPT-2, and the Llama family by its options; ``model.arch: gpt``).
    ``forward(tokens)`` -> vocab-parallel logits [b, s, V/p]; ``forward(tokens, labels)`` -> per-token loss [b, s]
    (vocab-parallel cross-entropy, fp32); ``forward(tokens, positions=..., cache=...)``: the next tokens of a
    generation (:class:`KVCache`). ``sequence_parallel``: Megatron's sequence parallelism over ``group`` (module docstring).
    ``context``: context parallelism (:class:`ContextParallel`): ``tokens`` are this rank's part of each sample and
    ``positions`` their global positions (:meth:`ContextParallel.split`), the attention exchanges the rest."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None = None,
                 seed: int = 1234, sequence_parallel: bool = False, context: ContextParallel | None = None):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        sp = self.sequence_parallel
        self.padded_vocab_size = padded_vocab_size
        std = cfg.init_method_std
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, cfg.hidden_size, group, init_method=normal_init(seed, "embedding.word_embeddings", std),
            sequence_parallel=sp)
        if cfg.position_embedding == "learned":
            self.embedding.position_embeddings = nn.Embedding(cfg.positions, cfg.hidden_size)
            normal_init(seed, "embedding.position_embeddings", std)(self.embedding.position_embeddings.weight)
        else:  # RoPE: positions enter each layer's attention; no table
            self.embedding.position_embeddings = None
        self.layers = nn.ModuleList(TransformerLayer(cfg, group, seed, i, sequence_parallel=sp, context=context)
                                    for i in range(cfg.num_layers))
        self.final_ln = norm(cfg)
        if sp:
            mark_norm_sequence_parallel(self.final_ln, group)
        self.output_layer = output_layer(cfg, padded_vocab_size, group, seed)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Word (+ learned position) embeddings and embedding dropout: tokens [b, s] -> [b, s, h] ([b, s/p, h]
        with sequence parallelism)."""
        s = tokens.size(1)
        x = self.embedding.word_embeddings(tokens)                         # [b, s, h] ([b, s/p, h] SP)
        if self.embedding.position_embeddings is not None:
            pos = self.embedding.position_embeddings(torch.arange(s, device=tokens.device) if positions is None
                                                     else positions)          # [s, h] or [b, s, h]
            if self.sequence_parallel:  # this chunk's positions; backward gathers the whole gradient on every rank
                pos = scatter_to_sequence_parallel_region(pos, self.group, dim=pos.dim() - 2)
            x = x + pos
        return embedding_dropout(x, self.cfg.hidden_dropout, self.training, self.sequence_parallel)

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: KVCache | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> final hidden states [b, s, h] (after the final LayerNorm); with sequence parallelism
        this rank's chunk [b, s/p, h].

        ``positions`` [s] or [b, s]: the tokens' positions (learned table or RoPE; None = 0 .. s-1, or the s
        positions after the cached ones). ``cache``: incremental decoding, the s tokens follow the ``cache.length``
        cached ones, whose keys and values every layer reads and extends (:class:`KVCache`). ``attn_mask``: bool
        [b, 1, s, s], True = attend, causality included (packed documents: :mod:`training.data.documents`); None =
        causal over the whole sequence. ``model.sliding_window`` narrows either to the window
        (:mod:`training.models.sliding_window`)."""
        b, s = tokens.shape
        start = 0 if cache is None else cache.length
        if start + s > self.cfg.positions:
            raise ValueError(f"sequence length {start + s} exceeds max_position_embeddings {self.cfg.positions}")
        mask = attn_mask
        if cache is not None:
            if attn_mask is not None:
                raise ValueError("attn_mask is for training on packed documents; a KV-cache step builds its own")
            mask = cache.attn_mask(s)                                      # [b or 1, 1, s, start + s]
            if positions is None:
                positions = torch.arange(start, start + s, device=tokens.device)
        mask = within_window(mask, start, s, self.cfg.sliding_window, tokens.device)  # Mistral's window
        x = self.embed(tokens, positions)
        for layer in self.layers:
            if self.cfg.recompute == "full" and self.training and torch.is_grad_enabled() and cache is None:
                x = tp_random.checkpoint(layer, x, mask, positions)       # a cached forward is never recomputed
            else:
                x = layer(x, mask, positions, cache)
        if cache is not None:
            cache.advance(s)
        return self.final_ln(x)                                            # [b, s, h] ([b, s/p, h] SP)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output layer: f, then x @ W_local^T -> logits for this rank's vocabulary rows; W is the word
        embedding (tied) or ``output_layer.weight`` (untied), both [V/p, h] per rank.

        hidden [..., h] (replicated, e.g. :meth:`hidden_states`) -> vocab-parallel logits [..., V/p]; with
        sequence parallelism hidden is this rank's chunk [b, s/p, h], all-gathered first (g)."""
        weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return column_parallel_linear(hidden, weight, None, self.group, sequence_parallel=self.sequence_parallel)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``, ``cache`` and ``attn_mask`` as :meth:`hidden_states`."""
        logits = self.output_logits(self.hidden_states(tokens, positions, cache, attn_mask))  # [b, s, V/p]
        if labels is None:
            return logits
        # the logits are ours and unused after this (the linear's backward needs x and E, not its
        # output): the loss may overwrite them instead of allocating another [b, s, V/p] buffer
        real = self.cfg.vocab_size if self.cfg.mask_vocab_padding else None  # padding out of the softmax
        return vocab_parallel_cross_entropy(logits, labels, self.group, inplace=True, vocab_size=real)  # [b, s]

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
            copies = 1 if self.output_layer is None else 2
            n -= copies * (self.padded_vocab_size - self.cfg.vocab_size) * self.cfg.hidden_size
        return n


GPT2Model = GPTModel
"""The class's name before the Llama options made it more than GPT-2; kept for code written against it."""


def output_layer(cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None,
                 seed: int) -> ColumnParallelLinear | None:
    """``model.untie_embeddings_and_output_weights``: the separate vocab-parallel output weight [V, h] (rows
    split like the word embedding's, no bias; only its ``weight`` is used), else None (tied)."""
    if not cfg.untie_embeddings_and_output_weights:
        return None
    return ColumnParallelLinear(cfg.hidden_size, padded_vocab_size, group, bias=False,
                                init_method=normal_init(seed, "output_layer", cfg.init_method_std))
