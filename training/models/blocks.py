"""The transformer blocks GPT-2 and BERT share: self-attention, MLP and the layer around them.

Notation: b batch, s sequence, h hidden, n heads, hn = h/n head size, p = TP degree.
Each rank holds n/p heads and a 4h/p slice of the MLP; one all-reduce per sub-block in forward (g,
after the row-parallel projection) and one in backward (f, before the column-parallel projection).

Weights: every parameter is drawn from its own CPU generator seeded by (seed, parameter name) by
:func:`normal_init`, as a full master weight that is then sliced. So with the same seed a TP=k block is
exactly the TP=1 block split k ways, independent of construction order.

Llama-family options (``training.config.ModelConfig``; the defaults are the GPT-2 block):

* ``normalization: rmsnorm`` -> :class:`RMSNorm` in place of both LayerNorms (same attribute names ``ln1``/``ln2``).
* ``position_embedding: rope`` -> :func:`apply_rotary` on each TP-local head's queries and keys after the QKV
  projection (positions are global token positions, so every rank rotates its heads as TP=1 does); the cos/sin
  tables (with ``rope_scaling``, Llama 3's frequencies) come from :mod:`training.models.rotary`, computed once
  per sequence length, device and dtype and shared by all layers.
* ``num_query_groups: g`` (GQA; g < n) -> the fused QKV weight holds, per key/value group, the group's n/g query
  heads then its key head then its value head (Megatron-Core's layout): global rows
  ``[q_{0..n/g-1}, k_0, v_0 | q_{n/g..2n/g-1}, k_1, v_1 | ...]``, each ``hn`` rows per head. Split by output rows
  with stride 1, rank r holds groups r g/p .. (r+1) g/p - 1 whole: its n/p query heads and their g/p key/value
  heads. Multi-head attention (g = n, the default) keeps the GPT-2 layout ``[Q; K; V]`` with stride 3.
  Each key/value head is repeated for its n/g query heads before the attention core.
* ``activation: swiglu`` -> the MLP's first linear is [gate; up] (2f rows, stride 2: rank r holds gate_r and
  up_r), ``silu(gate) * up``, then the row-parallel down projection (``proj``).
* ``add_bias_linear: false`` -> no bias in the four linears (``add_qkv_bias`` puts one back on QKV).

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
from training.models.core_attention import core_attention
from training.models.kv_cache import KVCache
from training.models.ops import causal_attention_with_dropout, dropout, dropout_add
from training.models.rotary import apply_rotary, rotary_cos_sin, rotary_table
from training.parallel import random as tp_random
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


NORMS = (nn.LayerNorm, RMSNorm)
"""Normalisation modules (their parameters are exempt from weight decay, ``training.optim``)."""


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """The full fused QKV weight (or bias) of :class:`ParallelSelfAttention` from separate ones: q [n hn, ...],
    k and v [g hn, ...] (rows = output features, as ``nn.Linear``). g = n: ``[Q; K; V]``; g < n: per group
    ``[q heads of the group; k; v]`` (the module docstring's layouts). Inverse: :func:`split_qkv`."""
    if groups == heads:
        return torch.cat([q, k, v], dim=0)
    rest = q.shape[1:]
    hn = k.size(0) // groups
    per = heads // groups
    parts = [q.reshape(groups, per * hn, *rest), k.reshape(groups, hn, *rest), v.reshape(groups, hn, *rest)]
    return torch.cat(parts, dim=1).reshape((heads + 2 * groups) * hn, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n hn, ...], k [g hn, ...], v [g hn, ...]) of a full fused QKV weight or bias (:func:`fuse_qkv`)."""
    rest = qkv.shape[1:]
    hn = qkv.size(0) // (heads + 2 * groups)
    if groups == heads:
        q, k, v = qkv.split([heads * hn, groups * hn, groups * hn], dim=0)
        return q, k, v
    per = heads // groups
    grouped = qkv.reshape(groups, (per + 2) * hn, *rest)
    q, k, v = grouped.split([per * hn, hn, hn], dim=1)
    return q.reshape(heads * hn, *rest), k.reshape(groups * hn, *rest), v.reshape(groups * hn, *rest)


class ParallelSelfAttention(nn.Module):
    """Multi-head or grouped-query self-attention (causal or with a key mask) with heads split across TP
    ranks, optionally with rotary position embeddings on the queries and keys."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, prefix: str, causal: bool = True,
                 layer_number: int = 1, sequence_parallel: bool = False):
        super().__init__()
        h, n, g = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups
        tp = group_size(group)
        # Megatron's fp16 stabilisers (training/models/core_attention.py); off = SDPA below
        self.layer_number = layer_number
        self.qk_layer_scaling = cfg.apply_query_key_layer_scaling
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        self.head_dim = divide(h, n)
        self.local_heads = divide(n, tp)
        self.grouped = g != n
        self.local_kv_heads = divide(g, tp)                                # = local_heads without GQA
        self.rotary_dim = cfg.rotary_dim                                   # 0: no RoPE
        self.rotary_base = cfg.rotary_base
        self.rope_scaling = cfg.llama3_rope_scaling                        # None: plain RoPE
        self.causal = causal
        self.dropout = cfg.attention_dropout
        self.selective = cfg.recompute == "selective"                     # recompute the core in backward
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        qkv_init = normal_init(seed, prefix + "qkv", cfg.init_method_std)
        if self.grouped:
            # per group [q heads of the group; k; v] (module docstring): stride 1 keeps groups whole
            self.qkv = ColumnParallelLinear(h, (n + 2 * g) * self.head_dim, group, bias=cfg.qkv_bias,
                                            init_method=qkv_init, sequence_parallel=sequence_parallel)
        else:
            # Fused QKV: global rows [Q; K; V], stride 3 so rank r holds [Q_r; K_r; V_r].
            self.qkv = ColumnParallelLinear(h, 3 * h, group, bias=cfg.qkv_bias, init_method=qkv_init, stride=3,
                                            sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(h, h, group, bias=cfg.add_bias_linear,
                                      init_method=normal_init(seed, prefix + "proj", out_std),
                                      sequence_parallel=sequence_parallel)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, h] (sequence parallel: [b, s/p, h]) -> q [b, n/p, s, hn], k and v [b, g/p, s, hn] (RoPE applied
        to q and k).

        ``positions``: token positions [s] or [b, s] for RoPE (None = 0 .. s-1)."""
        qkv = self.qkv(x)                                                  # [b, s, (n + 2g)/p * hn]
        b, s = qkv.shape[:2]                                               # the whole sequence, also with SP
        if self.grouped:
            per = self.local_heads // self.local_kv_heads
            qkv = qkv.view(b, s, self.local_kv_heads, per + 2, self.head_dim)
            q = qkv[:, :, :, :per].reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)
            k = qkv[:, :, :, per].transpose(1, 2)                          # [b, g/p, s, hn]
            v = qkv[:, :, :, per + 1].transpose(1, 2)
        else:
            q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [b, n/p, s, hn]
        if self.rotary_dim:
            if positions is None:  # 0 .. s-1: one cached table for every layer and step (models/rotary.py)
                cos, sin = rotary_table(s, self.rotary_dim, self.rotary_base, q.dtype, x.device, self.rope_scaling)
            else:
                cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rotary_base, q.dtype, self.rope_scaling)
            if cos.dim() == 3:                                             # per-sequence positions [b, s, d]
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[b, g/p, s, hn] -> [b, n/p, s, hn]: each key/value head repeated for its n/g query heads."""
        if not self.grouped:
            return t
        b, g, s, hn = t.shape
        rep = self.local_heads // g
        return t[:, :, None].expand(b, g, rep, s, hn).reshape(b, g * rep, s, hn)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]. ``positions`` [s] or [b, s] for RoPE (None = 0 .. s-1). With a ``cache`` the s
        new positions attend over the cached keys and values as well, under ``attn_mask`` (:meth:`KVCache.attn_mask`)."""
        q, k, v = self.project(x, positions)
        b, s = q.size(0), q.size(2)                                        # s: the whole sequence under SP
        if cache is not None:
            k, v = cache.update(self.layer_number - 1, k, v)               # [b, g/p, cached + s, hn]
        p = self.dropout if self.training else 0.0
        if self.selective and self.training and torch.is_grad_enabled() and self._keeps_scores(q, p):
            # a compiled layer runs the recomputed core eagerly, with the compiled path's traceable dropout mask
            y = self._recomputed_attention(q, k, v, attn_mask, p, torch.compiler.is_compiling())
        else:
            y = self._attention(q, k, v, attn_mask, p)                      # [b, n/p, s, hn]
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, h/p]
        return self.proj(y)                                                # [b, s, h], all-reduced

    def _attention(self, q, k, v, attn_mask, p: float, traced_mask: bool = False) -> torch.Tensor:
        """The attention core of q [b, n/p, s, hn], k and v [b, g/p, s, hn] -> [b, n/p, s, hn]: key/value
        heads repeated for their query heads, scores, softmax, dropout p, times V."""
        k, v = self.expand_kv(k), self.expand_kv(v)
        if p > 0.0:
            # Attention-probability dropout acts on TP-local heads: it uses the model-parallel stream (eager:
            # the tracker's generator fork; compiled: a counter-based mask, no graph break). Without dropout
            # no number is drawn and no switch made.
            return self._core_on_model_parallel_stream(q, k, v, attn_mask, p, traced_mask)
        return self._core(q, k, v, attn_mask, 0.0)

    def _keeps_scores(self, q: torch.Tensor, p: float) -> bool:
        """Whether :meth:`_core` keeps s x s tensors for backward (what selective recomputation saves):
        Megatron's core (the fp16 stabilisers) and the CPU dropout path keep the probabilities, their dropout
        mask and output; SDPA's fused kernels (flash, memory-efficient: on GPUs, and on CPU without dropout)
        keep only q, k, v, the output and the log-sum-exp, and recompute the scores in their backward kernel."""
        return self.qk_layer_scaling or self.softmax_in_fp32 or (p > 0.0 and q.device.type != "cuda")

    @torch.compiler.disable
    def _recomputed_attention(self, q, k, v, attn_mask, p: float, traced_mask: bool = False) -> torch.Tensor:
        """``model.recompute: selective`` (Korthikanti et al. 2022): :meth:`_attention` keeping only q, k, v
        (k, v before the GQA repeat); backward runs it again from the same RNG states (same dropout mask)."""
        return tp_random.recompute(functools.partial(self._attention, attn_mask=attn_mask, p=p, traced_mask=traced_mask),
                                   q, k, v)

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

    def _core_on_model_parallel_stream(self, q, k, v, attn_mask, p: float, traced_mask: bool = False) -> torch.Tensor:
        """The attention core with dropout on the model-parallel stream: the tracker's generator fork (eager), or
        the counter-based mask under compilation and in a compiled layer's eagerly recomputed core (``traced_mask``),
        so that a compiled layer draws the same masks with or without selective recomputation."""
        if traced_mask or torch.compiler.is_compiling():
            # a generator's state cannot be switched inside a graph: the explicit core with the traceable
            # model-parallel mask (training/parallel/random.py model_parallel_dropout), fused by the compiler
            return core_attention(q, k, v, layer_number=self.layer_number, query_key_layer_scaling=self.qk_layer_scaling,
                                  softmax_in_fp32=self.softmax_in_fp32, causal=self.causal, attn_mask=attn_mask,
                                  dropout_p=p, dropout_fn=tp_random.model_parallel_dropout)
        with tp_random.model_parallel_rng():
            return self._core(q, k, v, attn_mask, p)


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
    ``sequence_parallel``: x is this rank's sequence chunk [b, s/p, h] (module docstring).
    """

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, index: int,
                 causal: bool = True, pre_ln: bool = True, sequence_parallel: bool = False):
        super().__init__()
        prefix = f"layers.{index}."
        self.pre_ln = pre_ln
        self.ln1 = norm(cfg)
        self.attn = ParallelSelfAttention(cfg, group, seed, prefix + "attn.", causal=causal, layer_number=index + 1,
                                          sequence_parallel=sequence_parallel)
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
