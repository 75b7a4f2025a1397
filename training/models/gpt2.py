"""GPT-2 with Megatron tensor parallelism (pre-LayerNorm, learned positions, tied vocab-parallel head).

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree, V padded vocab.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name), as a
full master weight that is then sliced. So with the same seed and padded vocabulary a TP=k model is
exactly the TP=1 model split k ways, independent of construction order.
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.models.core_attention import core_attention
from training.models.ops import causal_attention_with_dropout, dropout, dropout_add
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from training.parallel.mappings import copy_to_parallel_region, gather_from_parallel_region, group_size
from training.parallel.utils import divide


def normal_init(seed: int, name: str, std: float):
    """N(0, std) filled from a generator private to (seed, name): order-independent, TP-invariant."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

    def init(w: torch.Tensor) -> None:
        with torch.no_grad():
            w.normal_(0.0, std, generator=gen)

    return init


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with heads split across TP ranks."""

    def __init__(self, cfg: ModelConfig, group, seed: int, prefix: str, causal: bool = True, layer_number: int = 1):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_attention_heads
        # Megatron's fp16 stabilisers (training/models/core_attention.py); off = SDPA below
        self.layer_number = layer_number
        self.qk_layer_scaling = cfg.apply_query_key_layer_scaling
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        self.head_dim = divide(h, n)
        self.local_heads = divide(n, group_size(group))
        self.causal = causal
        self.dropout = cfg.attention_dropout
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        # Fused QKV: global rows [Q; K; V], stride 3 so rank r holds [Q_r; K_r; V_r].
        self.qkv = ColumnParallelLinear(h, 3 * h, group, init_method=normal_init(seed, prefix + "qkv", cfg.init_method_std),
                                        stride=3)
        self.proj = RowParallelLinear(h, h, group, init_method=normal_init(seed, prefix + "proj", out_std))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)                                                  # [b, s, 3 * n/p * hn]
        q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [b, n/p, s, hn]
        p = self.dropout if self.training else 0.0
        # Attention-probability dropout acts on TP-local heads: it uses the model-parallel stream.
        with tp_random.model_parallel_rng():
            if self.qk_layer_scaling or self.softmax_in_fp32:
                y = core_attention(q, k, v, layer_number=self.layer_number,
                                   query_key_layer_scaling=self.qk_layer_scaling, softmax_in_fp32=self.softmax_in_fp32,
                                   causal=self.causal, attn_mask=attn_mask, dropout_p=p)  # [b, n/p, s, hn]
            elif p > 0.0 and self.causal and attn_mask is None and q.device.type == "cpu" and q.dtype == torch.float32:
                y = causal_attention_with_dropout(q, k, v, p)                  # [b, n/p, s, hn]
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                                   is_causal=self.causal and attn_mask is None)  # [b, n/p, s, hn]
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, h/p]
        return self.proj(y)                                                # [b, s, h], all-reduced


def activation(name: str):
    """``model.activation`` -> function: 'gelu' exact (erf), 'gelu_new' tanh approximation (GPT-2's)."""
    if name == "gelu_new":
        return functools.partial(F.gelu, approximate="tanh")
    return F.gelu


class ParallelMLP(nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, cfg: ModelConfig, group, seed: int, prefix: str):
        super().__init__()
        self.act = activation(cfg.activation)
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.fc = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, group,
                                       init_method=normal_init(seed, prefix + "fc", cfg.init_method_std))
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, group,
                                      init_method=normal_init(seed, prefix + "proj", out_std))

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))                             # [b, s, 4h/p] -> [b, s, h]


class TransformerLayer(nn.Module):
    """Pre-LN block: x + drop(Attn(LN1(x))), then + drop(MLP(LN2(.)))."""

    def __init__(self, cfg: ModelConfig, group, seed: int, index: int):
        super().__init__()
        prefix = f"layers.{index}."
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = ParallelSelfAttention(cfg, group, seed, prefix + "attn.", layer_number=index + 1)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = ParallelMLP(cfg, group, seed, prefix + "mlp.")
        self.dropout = cfg.hidden_dropout  # TP-replicated activations: default generator

    def forward(self, x):
        x = dropout_add(self.attn(self.ln1(x)), x, self.dropout, self.training)
        return dropout_add(self.mlp(self.ln2(x)), x, self.dropout, self.training)


class GPT2Model(nn.Module):
    """GPT-2 language model. ``forward(tokens)`` -> vocab-parallel logits [b, s, V/p];
    ``forward(tokens, labels)`` -> per-token loss [b, s] (vocab-parallel cross-entropy, fp32)."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group=None, seed: int = 1234):
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
