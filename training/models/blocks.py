"""The transformer blocks GPT-2 and BERT share: self-attention, MLP and the layer around them.

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name) by
:func:`normal_init`, as a full master weight that is then sliced. So with the same seed a TP=k block is
exactly the TP=1 block split k ways, independent of construction order.

Llama-family options (``training.models.config.ModelConfig``; the defaults are the GPT-2 block):

* ``normalization: rmsnorm`` -> :class:`RMSNorm` in place of both LayerNorms (same attribute names ``ln1``/``ln2``).
* ``position_embedding: rope`` -> :func:`apply_rotary` on each TP-local head's queries and keys after the QKV
  projection (positions are global token positions, so every rank rotates its heads as TP=1 does); the cos/sin
  tables (with ``rope_scaling``, Llama 3's frequencies) come from :mod:`training.models.rotary`, computed once
  per sequence length, device and dtype and shared by all layers.
* ``num_query_groups: g`` (GQA; g < n) -> the fused QKV weight holds whole key/value groups, per group the
  group's n/g query heads then its key head then its value head (Megatron-Core's layout, stride 1); multi-head
  attention (g = n, the default) keeps the GPT-2 layout ``[Q; K; V]`` with stride 3 (:mod:`training.models.qkv`).
  Each key/value head is repeated for its n/g query heads inside the attention core.
* ``activation: swiglu`` -> the MLP's first linear is [gate; up] (2f rows, stride 2: rank r holds gate_r and
  up_r), ``silu(gate) * up``, then the row-parallel down projection (``proj``).
* ``add_bias_linear: false`` -> no bias in the four linears (``add_qkv_bias`` puts one back on QKV).

The attention core (scores, softmax, dropout, times V) is chosen once per layer from the config
(:func:`training.models.core_attention.build_core`: SDPA, the CPU dropout kernel or Megatron's fp32-softmax core,
wrapped for selective recomputation); :class:`ParallelSelfAttention` only projects, rotates, caches and calls it.

Sequence parallelism (``sequence_parallel=True``, from ``parallel.sequence_parallel``; Korthikanti et al. 2022):
a layer takes and returns this rank's sequence chunk x [b, s/p, h]. The norms, dropout and residual adds run on
the chunk; QKV and the MLP's first linear all-gather it (g, instead of f), the two row-parallel projections
reduce-scatter (g-bar, instead of g's all-reduce). The norm weights (and the projections' biases) are replicated
but see only s/p tokens: their gradients are all-reduced over TP (``mark_sequence_parallel``). Dropout on the
chunk draws from the TP-local stream, since each rank holds different tokens.
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

from training.models.config import ModelConfig
from training.models.core_attention import build_core
from training.models.kv_cache import KVCache
from training.models.ops import dropout, dropout_add
from training.models.qkv import qkv_stride, split_heads
from training.models.rotary import apply_rotary, rotary_cos_sin, rotary_table
from training.parallel import random as tp_random
from training.parallel.context import ContextParallel
from training.parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel
from training.parallel.mappings import group_size
from training.parallel.utils import divide


def normal_init(seed: int, name: str, std: float) -> Callable[[torch.Tensor], None]:
    """N(0, std) filled from a generator private to (seed, name): order-independent, TP-invariant."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

    def init(w: torch.Tensor) -> None:
        with torch.no_grad():
            w.normal_(0.0, std, generator=gen)

    return init


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich 2019; Llama): ``x / sqrt(mean(x^2) + eps) * weight``,
    no centring and no bias. Computed in fp32 and cast back before the weight, as ``transformers``' Llama."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


def norm(cfg: ModelConfig, hidden_size: int | None = None) -> nn.Module:
    """``model.normalization``: nn.LayerNorm (weight and bias) or :class:`RMSNorm` (weight)."""
    h = hidden_size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        return RMSNorm(h, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(h, eps=cfg.layernorm_epsilon)


def mark_norm_sequence_parallel(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """A norm run on the sequence chunk: its weight (and bias) gradients all-reduced over TP."""
    for param in module.parameters():
        mark_sequence_parallel(param, group)


@torch.compiler.disable
def dropout_on_shard(x: torch.Tensor, residual: torch.Tensor | None, p: float, training: bool) -> torch.Tensor:
    """``residual + dropout(x)`` (or ``dropout(x)``) on a sequence-parallel chunk: every TP rank holds different
    tokens, so the mask comes from the TP-local stream (as Megatron's sequence-parallel dropout). The stream
    switch cannot be traced by torch.compile: it runs eagerly between graphs."""
    with tp_random.model_parallel_rng():
        return dropout(x, p, training) if residual is None else dropout_add(x, residual, p, training)


def embedding_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """The embedding's dropout: on a sequence-parallel chunk from the TP-local stream (:func:`dropout_on_shard`),
    otherwise plain (every TP rank holds the same tokens and draws the same mask)."""
    if sequence_parallel and training and p > 0.0:
        return dropout_on_shard(x, None, p, True)
    return dropout(x, p, training)


NORMS = (nn.LayerNorm, RMSNorm)
"""Normalisation modules (their parameters are exempt from weight decay, ``training.optim.adamw``)."""


class ParallelSelfAttention(nn.Module):
    """Multi-head or grouped-query self-attention (causal or with a key mask) with heads split across TP
    ranks, optionally with rotary position embeddings on the queries and keys. The attention core (kernel,
    dropout stream, selective recomputation) is chosen once here (:func:`~training.models.core_attention.build_core`)."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, prefix: str, causal: bool = True,
                 layer_number: int = 1, sequence_parallel: bool = False, context: ContextParallel | None = None):
        super().__init__()
        h, n, g = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups
        tp = group_size(group)
        self.layer_number = layer_number                                   # 1-based; the KV cache's layer + 1
        self.head_dim = divide(h, n)
        self.local_heads = divide(n, tp)
        self.local_kv_heads = divide(g, tp)                                # = local_heads without GQA
        self.rotary_dim = cfg.rotary_dim                                   # 0: no RoPE
        self.rotary_base = cfg.rotary_base
        self.rope_scaling = cfg.llama3_rope_scaling                        # None: plain RoPE
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        # fused QKV in the layout of training/models/qkv.py: [Q; K; V] (stride 3) or whole GQA groups (stride 1)
        self.qkv = ColumnParallelLinear(h, (n + 2 * g) * self.head_dim, group, bias=cfg.qkv_bias,
                                        init_method=normal_init(seed, prefix + "qkv", cfg.init_method_std),
                                        stride=qkv_stride(n, g), sequence_parallel=sequence_parallel)
        core = build_core(cfg, layer_number, causal)
        # context parallelism: the CP core around (Ulysses) or instead of (ring) it (training/parallel/context.py)
        self.core_attention = core if context is None else context.wrap(core)
        self.proj = RowParallelLinear(h, h, group, bias=cfg.add_bias_linear,
                                      init_method=normal_init(seed, prefix + "proj", out_std),
                                      sequence_parallel=sequence_parallel)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, h] (sequence parallel: [b, s/p, h]) -> q [b, n/p, s, hn], k and v [b, g/p, s, hn] (RoPE applied
        to q and k).

        ``positions``: token positions [s] or [b, s] for RoPE (None = 0 .. s-1)."""
        qkv = self.qkv(x)                                                  # [b, s, (n + 2g)/p * hn]
        q, k, v = split_heads(qkv, self.local_heads, self.local_kv_heads, self.head_dim)
        if self.rotary_dim:
            s = qkv.size(1)                                                # the whole sequence, also with SP
            if positions is None:  # 0 .. s-1: one cached table for every layer and step (models/rotary.py)
                cos, sin = rotary_table(s, self.rotary_dim, self.rotary_base, q.dtype, x.device, self.rope_scaling)
            else:
                cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rotary_base, q.dtype, self.rope_scaling)
            if cos.dim() == 3:                                             # per-sequence positions [b, s, d]
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]. ``positions`` [s] or [b, s] for RoPE (None = 0 .. s-1). With a ``cache`` the s
        new positions attend over the cached keys and values as well, under ``attn_mask`` (:meth:`KVCache.attn_mask`)."""
        q, k, v = self.project(x, positions)
        b, s = q.size(0), q.size(2)                                        # s: the whole sequence under SP
        if cache is not None:
            k, v = cache.update(self.layer_number - 1, k, v)               # [b, g/p, cached + s, hn]
        y = self.core_attention(q, k, v, attn_mask)                        # [b, n/p, s, hn]
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, h/p]
        return self.proj(y)                                                # [b, s, h], all-reduced


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model.activation`` -> function: 'gelu' exact (erf), 'gelu_new' tanh approximation (GPT-2's),
    'swiglu' ``silu(gate) * up`` of a [..., 2 f/p] input holding [gate_r, up_r] (halves of the last dim)."""
    if name == "gelu_new":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "swiglu":
        return swiglu
    return F.gelu


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """[..., 2f] = [gate, up] -> silu(gate) * up [..., f] (Shazeer 2020)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class ParallelMLP(nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel); with SwiGLU h -> [gate; up] 2 x f
    (column-parallel, stride 2) -> silu(gate) * up -> h (row-parallel)."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, prefix: str,
                 sequence_parallel: bool = False):
        super().__init__()
        self.act = activation(cfg.activation)
        gated = cfg.activation == "swiglu"
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.fc = ColumnParallelLinear(cfg.hidden_size, (2 if gated else 1) * cfg.ffn_size, group,
                                       bias=cfg.add_bias_linear, stride=2 if gated else 1,
                                       init_method=normal_init(seed, prefix + "fc", cfg.init_method_std),
                                       sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, group, bias=cfg.add_bias_linear,
                                      init_method=normal_init(seed, prefix + "proj", out_std),
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))                             # [b, s, 4h/p] -> [b, s, h]


class TransformerLayer(nn.Module):
    """One transformer layer: attention and MLP sub-blocks with residuals, in either LayerNorm order
    (``LN`` is :func:`norm`: LayerNorm or RMSNorm).

    ``pre_ln`` (GPT-2; the Megatron-LM paper's rearranged BERT)  x = x + Drop(Attn(LN1(x)));  x = x + Drop(MLP(LN2(x)))
    ``post_ln`` (original BERT)                                  x = LN1(x + Drop(Attn(x)));  x = LN2(x + Drop(MLP(x)))

    ``causal`` masks future positions (GPT-2); ``mask`` [b, 1, 1, s] bool (True = attend) masks padding keys (BERT).
    ``sequence_parallel``: x is this rank's sequence chunk [b, s/p, h] (module docstring). ``context``: x holds
    this context-parallel rank's tokens, the attention exchanges the rest (:mod:`training.parallel.context`).
    """

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, index: int,
                 causal: bool = True, pre_ln: bool = True, sequence_parallel: bool = False,
                 context: ContextParallel | None = None):
        super().__init__()
        prefix = f"layers.{index}."
        self.pre_ln = pre_ln
        self.ln1 = norm(cfg)
        self.attn = ParallelSelfAttention(cfg, group, seed, prefix + "attn.", causal=causal, layer_number=index + 1,
                                          sequence_parallel=sequence_parallel, context=context)
        self.ln2 = norm(cfg)
        self.mlp = ParallelMLP(cfg, group, seed, prefix + "mlp.", sequence_parallel=sequence_parallel)
        # TP-replicated activations: default generator; sequence chunks: the TP-local stream
        self.dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        if self.sequence_parallel:
            mark_norm_sequence_parallel(self.ln1, group)
            mark_norm_sequence_parallel(self.ln2, group)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and self.dropout > 0.0:
            return dropout_on_shard(x, residual, self.dropout, True)
        return dropout_add(x, residual, self.dropout, self.training)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] (sequence parallel: [b, s/p, h] -> [b, s/p, h]); ``positions`` and ``cache`` as
        :meth:`ParallelSelfAttention.forward`."""
        if self.pre_ln:
            x = self._dropout_add(self.attn(self.ln1(x), mask, positions, cache), x)
            return self._dropout_add(self.mlp(self.ln2(x)), x)
        x = self.ln1(self._dropout_add(self.attn(x, mask, positions, cache), x))
        return self.ln2(self._dropout_add(self.mlp(x), x))
