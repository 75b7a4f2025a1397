"""The transformer blocks GPT-2 and BERT share: self-attention, MLP and the layer around them.

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name) by
:func:`normal_init`, as a full master weight that is then sliced. So with the same seed a TP=k block is
exactly the TP=1 block split k ways, independent of construction order.
"""
from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.models.core_attention import core_attention
from training.models.ops import causal_attention_with_dropout, dropout_add
from training.parallel import random as tp_random
from training.parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.parallel.mappings import group_size
from training.parallel.utils import divide


def normal_init(seed: int, name: str, std: float) -> Callable[[torch.Tensor], None]:
    """N(0, std) filled from a generator private to (seed, name): order-independent, TP-invariant."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

    def init(w: torch.Tensor) -> None:
        with torch.no_grad():
            w.normal_(0.0, std, generator=gen)

    return init


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention (causal or with a key mask) with heads split across TP ranks."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, prefix: str, causal: bool = True,
                 layer_number: int = 1):
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
        if p > 0.0:
            # Attention-probability dropout acts on TP-local heads: it uses the model-parallel stream. The
            # stream switch sets the generator's state, which torch.compile cannot trace: compiled layers run
            # this one call eagerly between two graphs. Without dropout no number is drawn and no switch made.
            y = self._core_on_model_parallel_stream(q, k, v, attn_mask, p)
        else:
            y = self._core(q, k, v, attn_mask, 0.0)                          # [b, n/p, s, hn]
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, h/p]
        return self.proj(y)                                                # [b, s, h], all-reduced

    def _core(self, q, k, v, attn_mask, p: float) -> torch.Tensor:
        """softmax(Q K^T / sqrt(hn) + mask) with dropout p, times V: [b, n/p, s, hn]."""
        if self.qk_layer_scaling or self.softmax_in_fp32:
            return core_attention(q, k, v, layer_number=self.layer_number, query_key_layer_scaling=self.qk_layer_scaling,
                                  softmax_in_fp32=self.softmax_in_fp32, causal=self.causal, attn_mask=attn_mask,
                                  dropout_p=p)
        if (p > 0.0 and self.causal and attn_mask is None and q.device.type == "cpu" and q.dtype == torch.float32
                and not torch.compiler.is_compiling()):
            return causal_attention_with_dropout(q, k, v, p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                              is_causal=self.causal and attn_mask is None)

    @torch.compiler.disable
    def _core_on_model_parallel_stream(self, q, k, v, attn_mask, p: float) -> torch.Tensor:
        with tp_random.model_parallel_rng():
            return self._core(q, k, v, attn_mask, p)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model.activation`` -> function: 'gelu' exact (erf), 'gelu_new' tanh approximation (GPT-2's)."""
    if name == "gelu_new":
        return functools.partial(F.gelu, approximate="tanh")
    return F.gelu


class ParallelMLP(nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, prefix: str):
        super().__init__()
        self.act = activation(cfg.activation)
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.fc = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, group,
                                       init_method=normal_init(seed, prefix + "fc", cfg.init_method_std))
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, group,
                                      init_method=normal_init(seed, prefix + "proj", out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))                             # [b, s, 4h/p] -> [b, s, h]


class TransformerLayer(nn.Module):
    """One transformer layer: attention and MLP sub-blocks with residuals, in either LayerNorm order.

    ``pre_ln`` (GPT-2; the Megatron-LM paper's rearranged BERT)  x = x + Drop(Attn(LN1(x)));  x = x + Drop(MLP(LN2(x)))
    ``post_ln`` (original BERT)                                  x = LN1(x + Drop(Attn(x)));  x = LN2(x + Drop(MLP(x)))

    ``causal`` masks future positions (GPT-2); ``mask`` [b, 1, 1, s] bool (True = attend) masks padding keys (BERT).
    """

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, index: int,
                 causal: bool = True, pre_ln: bool = True):
        super().__init__()
        prefix = f"layers.{index}."
        self.pre_ln = pre_ln
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = ParallelSelfAttention(cfg, group, seed, prefix + "attn.", causal=causal, layer_number=index + 1)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = ParallelMLP(cfg, group, seed, prefix + "mlp.")
        self.dropout = cfg.hidden_dropout  # TP-replicated activations: default generator

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]."""
        p, train = self.dropout, self.training
        if self.pre_ln:
            x = dropout_add(self.attn(self.ln1(x), mask), x, p, train)
            return dropout_add(self.mlp(self.ln2(x)), x, p, train)
        x = self.ln1(dropout_add(self.attn(x, mask), x, p, train))
        return self.ln2(dropout_add(self.mlp(x), x, p, train))
