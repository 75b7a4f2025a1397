"""Memory and speed planner for TP x PP x DP runs of our GPT-2 / BERT (``python -m training.plan``).

What it computes, per device, for one optimizer step (all formulas in docs/plan.md):

* parameters of every TP/PP shard, exactly as our models build them (pre-LN layers, 4h MLP with
  biases, learned positions, tied output embedding, padded vocabulary, final LayerNorm; BERT adds
  token types, pooler, LM-head dense+LN+bias and the binary head);
* memory: fp16/bf16 weights 2 B + grads 2 B + fp32 master/m/v 12 B per parameter (fp32 training:
  4 + 4 + 8), ZeRO-1 dividing the optimizer part by DP; activations per Korthikanti et al. 2022
  with and without full activation checkpointing;
* FLOPs per step (Narayanan et al. 2021 eq. 3), communication volume per step for TP, PP, DP;
* a predicted step time from an alpha-beta model (``TimeModel``; every constant documented there).

Notation: l layers, h hidden, a heads, s sequence, f MLP width (4h), V padded vocabulary, P positions,
b micro-batch, B global batch, t/p/d = TP/PP/DP degrees, m = B / (b d) micro-batches per step.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from training.config import (BertDataConfig, Config, ConfigError, ModelConfig, _build, _merge, padded_vocab_size,
                             parse_overrides)
from training.runtime.hardware import Hardware, canonical_kind, get_hardware
from training.metrics import bert_expected_masked_positions

log = logging.getLogger(__name__)

GIB = 1024**3

# --------------------------------------------------------------------------------------------------
# Presets: the Megatron-LM paper's configurations (Shoeybi et al. 2019, Tables 1 and 4)
# --------------------------------------------------------------------------------------------------
# GPT-2: vocabulary 51,200 = GPT-2's 50,257 padded to a multiple of 1024 (the paper's padding for all
# sizes; 51,200 is also a multiple of 128 x t for t <= 8, so our padding leaves it unchanged).
_GPT2 = dict(arch="gpt2", seq_length=1024, vocab_size=51200, make_vocab_size_divisible_by=128)
# BERT: WordPiece 30,522 -> padded by Megatron's rule; seq 512.
_BERT = dict(arch="bert", seq_length=512, vocab_size=30522, make_vocab_size_divisible_by=128)
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-1.2b": {**_GPT2, "hidden_size": 1536, "num_layers": 40, "num_attention_heads": 16},
    "gpt2-2.5b": {**_GPT2, "hidden_size": 1920, "num_layers": 54, "num_attention_heads": 20},
    "gpt2-4.2b": {**_GPT2, "hidden_size": 2304, "num_layers": 64, "num_attention_heads": 24},
    "gpt2-8.3b": {**_GPT2, "hidden_size": 3072, "num_layers": 72, "num_attention_heads": 32},
    "bert-336m": {**_BERT, "hidden_size": 1024, "num_layers": 24, "num_attention_heads": 16},
    "bert-1.3b": {**_BERT, "hidden_size": 2048, "num_layers": 24, "num_attention_heads": 32},
    "bert-3.9b": {**_BERT, "hidden_size": 2560, "num_layers": 48, "num_attention_heads": 40},
}
# The paper's weak-scaling runs: model, TP degree; batch 8 per model replica; DP 64 in the DP runs.
PAPER_WEAK_SCALING: list[tuple[str, int, float, float]] = [
    # preset, tp, paper efficiency TP only (Fig. 5), paper efficiency TP x 64-way DP (Fig. 5)
    ("gpt2-1.2b", 1, 1.00, 0.96),
    ("gpt2-2.5b", 2, 0.95, 0.83),
    ("gpt2-4.2b", 4, 0.82, 0.79),
    ("gpt2-8.3b", 8, 0.77, 0.74),
]
PAPER_BASELINE_TFLOPS = 39.0  # 1.2B GPT-2 on one V100, the paper's 100% point ("30% of peak")


# --------------------------------------------------------------------------------------------------
# Shapes and layout
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """Everything the formulas need about the model; V is the *padded* vocabulary."""

    arch: str
    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    positions: int
    ffn: int
    num_tokentypes: int = 0
    binary_head: bool = False
    masked: float | None = None
    """BERT: expected masked (predicted) positions per sequence, where the LM head runs; None = all."""

    @classmethod
    def from_config(cls, m: ModelConfig, tp: int, bert_cfg: BertDataConfig | None = None) -> ModelShape:
        if m.vocab_size is None:
            raise ConfigError("model.vocab_size must be set for planning (e.g. model.vocab_size=50257)")
        bert = m.arch == "bert"
        masked = None
        if bert:
            b = bert_cfg or BertDataConfig()
            masked = bert_expected_masked_positions(b.masked_lm_prob, b.short_seq_prob, m.seq_length)
        return cls(arch=m.arch, num_layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                   seq=m.seq_length, vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
                   positions=m.positions, ffn=m.ffn_size,
                   num_tokentypes=m.num_tokentypes if bert else 0, binary_head=bert and m.binary_head,
                   masked=masked)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 8
    global_batch: int = 8
    gpus_per_node: int = 8

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_micro(self) -> int:
        """m: micro-batches per optimizer step on one data-parallel replica."""
        return self.global_batch // (self.micro_batch * self.dp)


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
    if shape.positions < shape.seq:
        raise ConfigError(f"max_position_embeddings {shape.positions} < seq_length {shape.seq}")


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------
def layer_params(shape: ModelShape, tp: int = 1) -> int:
    """One transformer layer on one TP rank.

    QKV [3h, h] + bias 3h and h->f [f, h] + bias f are column-parallel (divided by t); the two
    row-parallel weights [h, h] and [h, f] are divided by t but their biases (h each) are replicated;
    the two LayerNorms (2h each) are replicated. t = 1: 4h^2 + 2hf + 3h + f + 2h + 4h (= 12h^2 + 13h).
    """
    h, f = shape.hidden, shape.ffn
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h
    return split // tp + 2 * h + 4 * h


def embedding_params(shape: ModelShape, tp: int = 1) -> int:
    """Word embedding V x h (vocab-parallel) + positions P x h (+ BERT token types T x h), per TP rank."""
    h = shape.hidden
    return shape.vocab * h // tp + shape.positions * h + shape.num_tokentypes * h


def head_params(shape: ModelShape, tp: int = 1) -> int:
    """Everything after the last layer except the tied output weight: final LN (2h); BERT adds the
    LM head dense (h^2 + h) + LN (2h) + vocab-parallel bias (V/t), pooler (h^2 + h) and binary head
    (2h + 2) when the binary head is on."""
    h = shape.hidden
    n = 2 * h
    if shape.arch == "bert":
        n += h * h + h + 2 * h + shape.vocab // tp
        if shape.binary_head:
            n += h * h + h + 2 * h + 2
    return n


def total_params(shape: ModelShape) -> int:
    """Whole model, tied output embedding counted once (this is the number the paper quotes)."""
    return embedding_params(shape) + shape.num_layers * layer_params(shape) + head_params(shape)


def stage_params(shape: ModelShape, tp: int, pp: int) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage.

    Stage 0 holds the embeddings, the last stage the final LN/heads; with pp > 1 the last stage also
    keeps its own copy of the word embedding for the tied output layer (Megatron 2021), so the tied
    weight is stored twice in the pipeline.
    """
    per_stage_layers = shape.num_layers // pp
    out = []
    for i in range(pp):
        n = per_stage_layers * layer_params(shape, tp)
        if i == 0:
            n += embedding_params(shape, tp)
        if i == pp - 1:
            n += head_params(shape, tp)
            if pp > 1:
                n += shape.vocab * shape.hidden // tp
        out.append(n)
    return out


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------
def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per parameter for Adam.

    fp16/bf16 mixed precision: 2 (half weights) + 2 (half grads) + 12 (fp32 master, m, v).
    fp32: 4 + 4 + 8 (m, v; the weights are the master).
    """
    return (2, 2, 12) if dtype in ("fp16", "bf16") else (4, 4, 8)


def activation_bytes_per_layer(shape: ModelShape, micro_batch: int, tp: int, scores_stored: bool = True) -> float:
    """Korthikanti et al. 2022, eq. (1)/(2) (no sequence parallelism), 16-bit activations:

        s b h (34 + 5 a s / h)                       t = 1
        s b h (10 + 24/t + 5 a s / (h t))            tensor parallel

    Terms: 10 sbh replicated on every TP rank (two LN inputs 4, QKV and h->4h inputs 4, two dropout
    masks 2); 24/t split (Q, K, V 6, projection input 2, GeLU input and output 2 x 8); 5 a s^2 b / t
    for the attention scores (softmax output 2, dropout mask 1, dropout output 2). For an MLP width f
    the 16 becomes 4 f / h. ``scores_stored=False`` drops the s^2 term (flash attention).
    """
    s, b, h, a = shape.seq, micro_batch, shape.hidden, shape.heads
    per_sbh = 10 + (8 + 4 * shape.ffn / h) / tp
    if scores_stored:
        per_sbh += 5 * a * s / (h * tp)
    return s * b * h * per_sbh


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded device."""

    params: float
    grads: float
    optimizer: float
    optimizer_zero1: float
    activations: float
    activations_ckpt: float

    def total(self, zero1: bool, ckpt: bool) -> float:
        return (self.params + self.grads + (self.optimizer_zero1 if zero1 else self.optimizer)
                + (self.activations_ckpt if ckpt else self.activations))


def stage_activation_bytes(shape: ModelShape, lay: Layout, stage: int, ckpt: bool,
                           scores_stored: bool = True) -> float:
    """Activations alive on one TP rank of ``stage`` at the peak of a 1F1B schedule.

    Stage i keeps min(p - i, m) micro-batches in flight (one when p = 1: gradient accumulation runs
    micro-batches one after another and frees each before the next). Without checkpointing each
    keeps the full per-layer set for its l/p layers; with full checkpointing only the layer input
    (2 s b h per layer) plus the working set of the one layer being recomputed. Extras (Korthikanti
    sec. 4.3, no SP): embedding dropout mask s b h on stage 0; final-LN input 2 s b h, output-layer
    input 2 s b h and fp32 logits 4 s b V / t on the last stage.
    """
    s, b, h = shape.seq, lay.micro_batch, shape.hidden
    per_layer = activation_bytes_per_layer(shape, b, lay.tp, scores_stored)
    layers = shape.num_layers // lay.pp
    in_flight = min(lay.pp - stage, lay.num_micro)
    if ckpt:
        act = in_flight * layers * 2 * s * b * h + per_layer
    else:
        act = in_flight * layers * per_layer
    if stage == 0:
        act += in_flight * s * b * h
    if stage == lay.pp - 1:
        act += 4 * s * b * h + 4 * s * b * shape.vocab / lay.tp
    return act


def memory(shape: ModelShape, lay: Layout, dtype: str = "fp16", scores_stored: bool = True) -> Memory:
    """Per-device memory of the most loaded stage (max over stages of each total)."""
    wb, gb, ob = state_bytes_per_param(dtype)
    params = stage_params(shape, lay.tp, lay.pp)
    best: Memory | None = None
    for i, n in enumerate(params):
        m = Memory(params=wb * n, grads=gb * n, optimizer=ob * n, optimizer_zero1=ob * n / lay.dp,
                   activations=stage_activation_bytes(shape, lay, i, False, scores_stored),
                   activations_ckpt=stage_activation_bytes(shape, lay, i, True, scores_stored))
        if best is None or m.total(False, False) > best.total(False, False):
            best = m
    assert best is not None
    return best


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------
def layer_forward_flops(shape: ModelShape, tokens: int) -> float:
    """2 x multiply-adds of one layer's forward for ``tokens`` = B s tokens:
    QKV 6 h^2 + projection 2 h^2 + MLP 4 h f (= 24 h^2 for f = 4h) per token, plus attention
    scores and scores x V: 4 s h per token."""
    h = shape.hidden
    return tokens * (8 * h * h + 4 * h * shape.ffn + 4 * shape.seq * h)


def step_flops(shape: ModelShape, global_batch: int, ckpt: bool) -> float:
    """FLOPs of one optimizer step over the whole model and batch.

    Forward + backward = 3 x forward. With full activation checkpointing every layer's forward runs
    twice (4 x), the logit layer (2 B s h V forward) is not recomputed. For GPT-2 with checkpointing this
    is exactly Narayanan et al. 2021 eq. (3):  96 B s l h^2 (1 + s/(6h) + V/(16 l h));  without it the
    transformer part is 3/4 of that. BERT's LM head (dense 2 h^2 + vocabulary 2 h V per position) runs
    only at its ``shape.masked`` positions per sequence (all ``s`` when None), plus the pooler and
    sentence-order head (2 h^2 + 4 h per sequence), as ``training.metrics.bert_flops_per_iteration``.
    """
    tokens = global_batch * shape.seq
    layers = shape.num_layers * layer_forward_flops(shape, tokens)
    if shape.arch == "bert":
        predicted = global_batch * (shape.masked if shape.masked is not None else shape.seq)
        head = 2 * predicted * shape.hidden * (shape.hidden + shape.vocab)
        if shape.binary_head:
            head += global_batch * (2 * shape.hidden * shape.hidden + 4 * shape.hidden)
    else:
        head = 2 * tokens * shape.hidden * shape.vocab
    return (4 if ckpt else 3) * layers + 3 * head


# --------------------------------------------------------------------------------------------------
# Communication volume
# --------------------------------------------------------------------------------------------------
def ring_allreduce_wire(n_bytes: float, group: int) -> float:
    """Bytes each rank sends in a ring all-reduce: reduce-scatter + all-gather = 2 (g - 1) / g x n."""
    return 2 * (group - 1) / group * n_bytes if group > 1 else 0.0


@dataclass(frozen=True)
class Comm:
    """Per device per optimizer step (most loaded stage). ``*_payload`` = size of the tensors
    reduced/sent; ``*_wire`` = bytes that rank actually sends; ``*_ops`` = number of collectives."""

    tp_ops: int
    tp_payload: float
    tp_wire: float
    pp_ops: int
    pp_payload: float
    dp_payload: float
    dp_wire: float


def tp_allreduces_per_micro(shape: ModelShape, lay: Layout, ckpt: bool) -> int:
    """All-reduces of b s h elements on one stage per micro-batch: per layer 2 in forward (g after the
    attention and MLP row-parallel projections) + 2 in backward (f before QKV and h->4h), + 2 more with
    checkpointing (the recomputed forward); + 1 for the vocab-parallel embedding (stage 0) and + 1 for
    the f in front of the tied output layer (backward, last stage). The vocab-parallel cross-entropy's
    three b s-sized all-reduces are counted separately (they are tiny)."""
    if lay.tp == 1:
        return 0
    per_layer = 4 + (2 if ckpt else 0)
    ends = 2 if lay.pp == 1 else 1
    return (shape.num_layers // lay.pp) * per_layer + ends


def comm(shape: ModelShape, lay: Layout, ckpt: bool, dtype: str = "fp16") -> Comm:
    act_bytes = 2 if dtype in ("fp16", "bf16") else 4
    sbh = shape.seq * lay.micro_batch * shape.hidden * act_bytes
    m = lay.num_micro
    n_ar = tp_allreduces_per_micro(shape, lay, ckpt)
    ce = 3 * shape.seq * lay.micro_batch * 4 if lay.tp > 1 else 0  # max, target logit, sum-exp (fp32)
    tp_payload = m * (n_ar * sbh + ce)
    pp_ops = 2 * m if lay.pp > 1 else 0  # activations forward + their gradients backward, each way
    local = max(stage_params(shape, lay.tp, lay.pp))
    grad_bytes = state_bytes_per_param(dtype)[1]
    return Comm(tp_ops=m * (n_ar + (3 if lay.tp > 1 else 0)), tp_payload=tp_payload,
                tp_wire=ring_allreduce_wire(tp_payload, lay.tp),
                pp_ops=pp_ops, pp_payload=pp_ops * sbh,
                dp_payload=local * grad_bytes if lay.dp > 1 else 0.0,
                dp_wire=ring_allreduce_wire(local * grad_bytes, lay.dp))


# --------------------------------------------------------------------------------------------------
# Step time: alpha-beta model
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeModel:
    """Constants of the step-time model (docs/plan.md explains each and how sensitive the result is).

    step = compute + replicated + TP + PP p2p + bubble + (1 - dp_overlap) x DP
    """

    compute_fraction: float | None = None
    """Achieved fraction of the 16-bit peak on dense work; None = calibrate (V100: from the paper's
    39 TFLOP/s 1.2B baseline) or the hardware table's value."""
    alpha_intra_s: float = 5e-6
    """Latency per ring step inside a node (NCCL over NVLink/NVSwitch: a few microseconds)."""
    alpha_inter_s: float = 10e-6
    """Latency per ring step across nodes (InfiniBand + NCCL proxy)."""
    link_efficiency: float = 1.0
    """Achieved fraction of the link bandwidth; 1.0 = data-sheet per-direction rate."""
    replicated_bytes_per_sbh: float = 38.0
    """HBM traffic (bytes per s b h element) of the forward element-wise work that tensor parallelism
    does NOT split, per layer: LN1 4, attention bias-add 4, dropout 5, residual add 6, LN2 4, MLP
    bias-add 4, dropout 5, residual add 6 (un-fused PyTorch ops, 2-byte activations, 1-byte masks).
    Backward moves about as much again, the checkpointed re-forward as much again."""
    memory_efficiency: float = 0.8
    """Achieved fraction of the HBM bandwidth for those element-wise kernels."""
    dp_overlap: float = 0.0
    """Fraction of the DP all-reduce hidden behind backward compute (0: Megatron's 2019 'local' DDP
    reduces after backward; torch DDP / DeepSpeed buckets overlap part of it)."""


@dataclass(frozen=True)
class StepTime:
    compute: float
    replicated: float
    tp: float
    pp: float
    bubble: float
    dp: float
    dp_exposed: float
    flops_per_device: float

    @property
    def total(self) -> float:
        return self.compute + self.replicated + self.tp + self.pp + self.bubble + self.dp_exposed

    @property
    def tflops_per_device(self) -> float:
        return self.flops_per_device / self.total / 1e12


def _allreduce_time(n_bytes: float, group: int, alpha: float, bw: float) -> float:
    if group <= 1 or math.isinf(bw):  # inf = no link data (cpu entry): not modelled
        return 0.0
    return 2 * (group - 1) * alpha + ring_allreduce_wire(n_bytes, group) / bw


def _bw(gbs: float | None, eff: float) -> float:
    return math.inf if gbs is None else gbs * 1e9 * eff


def step_time(shape: ModelShape, lay: Layout, hw: Hardware, tm: TimeModel, ckpt: bool = True,
              dtype: str = "fp16", compute_fraction: float | None = None) -> StepTime:
    """Predicted seconds per optimizer step on one device (every device waits for the slowest).

    * compute = hardware FLOPs per device / (peak x fraction). FLOPs per device = step_flops / (t p d).
    * replicated = (1 - 1/t) x (element-wise bytes of l/p layers x m micro-batches) / (HBM x eff):
      the fraction calibrates this work at t = 1 as part of "compute"; with TP every rank repeats it
      instead of doing 1/t of it.
    * TP: each all-reduce of n bytes over t ranks costs 2 (t-1) alpha + 2 (t-1)/t n / beta; on the
      critical path (no overlap in Megatron TP). Intra-node link if t <= gpus_per_node.
    * PP: 2 m point-to-point sends of b s h per stage (alpha + n / beta), plus the 1F1B bubble
      (p - 1)/m x (compute + replicated + TP).
    * DP: ring all-reduce of the local gradients. If the DP group (t d consecutive-stride ranks) fits in
      one node it uses NVLink; otherwise every node's NICs carry one ring crossing per DP group with
      members on that node: (gpus_per_node / k) rings, k = max(1, gpus_per_node // t) members per node.
    """
    f = compute_fraction if compute_fraction is not None else (tm.compute_fraction or hw.achievable_fraction)
    peak = hw.peak_tflops.get(dtype)
    if peak is None:
        raise ConfigError(f"{hw.name} has no {dtype} peak in training/runtime/hardware.py: choose another --dtype")
    t, p, d, m, G = lay.tp, lay.pp, lay.dp, lay.num_micro, lay.gpus_per_node
    act_bytes = 2 if dtype in ("fp16", "bf16") else 4
    flops_dev = step_flops(shape, lay.global_batch, ckpt) / (t * p * d)
    compute = flops_dev / (peak * 1e12 * f)

    sbh = shape.seq * lay.micro_batch * shape.hidden
    passes = 3 if ckpt else 2
    repl_bytes = tm.replicated_bytes_per_sbh * passes * sbh * (act_bytes / 2) * (shape.num_layers // p) * m
    replicated = (1 - 1 / t) * repl_bytes / _bw(hw.hbm_gbs, tm.memory_efficiency)

    if t <= G:
        tp_bw, tp_alpha = _bw(hw.intra_node_gbs, tm.link_efficiency), tm.alpha_intra_s
    else:  # TP across nodes: each GPU gets its share of the node's NICs
        tp_bw, tp_alpha = _bw(hw.inter_node_gbs, tm.link_efficiency) / G, tm.alpha_inter_s
    n_ar = tp_allreduces_per_micro(shape, lay, ckpt)
    tp = m * (n_ar * _allreduce_time(sbh * act_bytes, t, tp_alpha, tp_bw)
              + (3 * _allreduce_time(shape.seq * lay.micro_batch * 4, t, tp_alpha, tp_bw) if t > 1 else 0.0))

    pp = 0.0
    if p > 1:
        if t * d * p <= G:
            pp_bw, pp_alpha = _bw(hw.intra_node_gbs, tm.link_efficiency), tm.alpha_intra_s
        else:
            pp_bw, pp_alpha = _bw(hw.inter_node_gbs, tm.link_efficiency) / G, tm.alpha_inter_s
        pp = 0.0 if math.isinf(pp_bw) else 2 * m * (pp_alpha + sbh * act_bytes / pp_bw)
    bubble = (p - 1) / m * (compute + replicated + tp)

    grad_bytes = max(stage_params(shape, t, p)) * state_bytes_per_param(dtype)[1]
    if t * d <= G:
        dp = _allreduce_time(grad_bytes, d, tm.alpha_intra_s, _bw(hw.intra_node_gbs, tm.link_efficiency))
    else:
        k = max(1, G // t)
        rings_per_node = G / k
        dp = _allreduce_time(grad_bytes, d, tm.alpha_inter_s,
                             _bw(hw.inter_node_gbs, tm.link_efficiency) / rings_per_node)
    return StepTime(compute=compute, replicated=replicated, tp=tp, pp=pp, bubble=bubble, dp=dp,
                    dp_exposed=(1 - tm.dp_overlap) * dp, flops_per_device=flops_dev)


def preset_shape(name: str, tp: int = 1) -> ModelShape:
    if name not in PRESETS:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelShape.from_config(ModelConfig(**PRESETS[name]), tp)


def calibrate_compute_fraction(hw: Hardware, tm: TimeModel, target_tflops: float = PAPER_BASELINE_TFLOPS,
                               preset: str = "gpt2-1.2b", micro_batch: int = 8, ckpt: bool = True,
                               dtype: str = "fp16") -> float:
    """Solve for the fraction f at which the model predicts ``target_tflops`` per device for
    ``preset`` on one device (t = p = d = 1). There the step is FLOPs / (peak f) plus terms that do not
    depend on f (all zero on one device), so f = FLOPs / (peak (FLOPs / target - other))."""
    shape = preset_shape(preset)
    lay = Layout(micro_batch=micro_batch, global_batch=micro_batch, gpus_per_node=hw.gpus_per_node)
    st = step_time(shape, lay, hw, tm, ckpt, dtype, compute_fraction=1.0)
    other = st.total - st.compute
    wanted_total = st.flops_per_device / (target_tflops * 1e12)
    return st.compute / (wanted_total - other)


def default_compute_fraction(hw: Hardware, tm: TimeModel, dtype: str = "fp16") -> float:
    if tm.compute_fraction is not None:
        return tm.compute_fraction
    if hw.name == "v100-32gb" and dtype == "fp16":
        return calibrate_compute_fraction(hw, tm)
    return hw.achievable_fraction


@dataclass(frozen=True)
class ScalingRow:
    preset: str
    tp: int
    dp: int
    gpus: int
    params: int
    tflops: float
    efficiency: float
    paper: float
    time: StepTime


def paper_weak_scaling(hw_kind: str = "v100-32gb", tm: TimeModel | None = None) -> list[ScalingRow]:
    """Predict the paper's weak-scaling experiment (Fig. 5): each preset at its TP degree with batch 8
    per replica, alone (d = 1) and with 64-way DP (global batch 512), fp16 with activation
    checkpointing, efficiency = predicted TFLOP/s per GPU / predicted 1.2B one-GPU TFLOP/s."""
    tm = tm or TimeModel()
    hw = get_hardware(hw_kind)
    f = default_compute_fraction(hw, tm)
    rows: list[ScalingRow] = []
    base: float | None = None
    for dp in (1, 64):
        for preset, tp, paper_tp, paper_dp in PAPER_WEAK_SCALING:
            shape = preset_shape(preset, tp)
            lay = Layout(tp=tp, dp=dp, micro_batch=8, global_batch=8 * dp, gpus_per_node=hw.gpus_per_node)
            validate(shape, lay)
            st = step_time(shape, lay, hw, tm, ckpt=True, dtype="fp16", compute_fraction=f)
            if base is None:
                base = st.tflops_per_device
            rows.append(ScalingRow(preset, tp, dp, lay.world, total_params(shape), st.tflops_per_device,
                                   st.tflops_per_device / base, paper_tp if dp == 1 else paper_dp, st))
    return rows


# --------------------------------------------------------------------------------------------------
# Config loading and CLI
# --------------------------------------------------------------------------------------------------
def load_plan_config(path: str | None, model: str | None, overrides: list[str]) -> Config:
    """Run config for planning: YAML file and/or preset, then ``a.b=value`` overrides.

    Only model/train/precision keys matter here, so the run-only checks of load_config (data source,
    pipeline not implemented yet) are not applied; key and type checks are the same.
    """
    data: dict[str, Any] = {}
    if path is not None:
        from megatron_ds_suite.configs_lookup import find_config

        p = find_config(path)  # an existing file, else a bundled config of that name
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if model is not None:
        if model not in PRESETS:
            raise ConfigError(f"unknown --model {model!r}; choose one of: {', '.join(PRESETS)}")
        data = _merge(data, {"model": PRESETS[model]})
    data = _merge(data, parse_overrides(overrides))
    return _build(Config, data, "")


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def render_plan(shape: ModelShape, lay: Layout, hw: Hardware, tm: TimeModel, dtype: str,
                scores_stored: bool = True) -> str:
    """The CLI report as text (tables)."""
    out: list[str] = []
    total = total_params(shape)
    stages = stage_params(shape, lay.tp, lay.pp)
    out.append(f"model: {shape.arch} l={shape.num_layers} h={shape.hidden} a={shape.heads} s={shape.seq} "
               f"V(padded)={shape.vocab:,} ffn={shape.ffn}")
    out.append(f"layout: TP={lay.tp} PP={lay.pp} DP={lay.dp} -> {lay.world} devices of {hw.name} "
               f"({hw.gpus_per_node}/node); micro batch {lay.micro_batch}, global batch {lay.global_batch}, "
               f"{lay.num_micro} micro-batches/step; dtype {dtype}")
    out.append("")
    out.append(f"parameters: total {total:,} ({_fmt_params(total)}), tied output embedding counted once")
    for i, n in enumerate(stages):
        out.append(f"  per device, stage {i}: {n:,} ({_fmt_params(n)})")
    out.append("")
    mem = memory(shape, lay, dtype, scores_stored)
    wb, gb, ob = state_bytes_per_param(dtype)
    out.append(f"memory per device, GiB (most loaded stage; {wb}+{gb}+{ob} bytes/param, "
               f"device has {hw.memory_gb:g}):")
    out.append(f"  {'':28s}{'no ckpt':>12s}{'act. ckpt':>12s}")
    out.append(f"  {'weights':28s}{_gib(mem.params):>12s}{_gib(mem.params):>12s}")
    out.append(f"  {'gradients':28s}{_gib(mem.grads):>12s}{_gib(mem.grads):>12s}")
    out.append(f"  {'optimizer states':28s}{_gib(mem.optimizer):>12s}{_gib(mem.optimizer):>12s}")
    out.append(f"  {f'optimizer states, ZeRO-1/{lay.dp}':28s}{_gib(mem.optimizer_zero1):>12s}"
               f"{_gib(mem.optimizer_zero1):>12s}")
    out.append(f"  {'activations':28s}{_gib(mem.activations):>12s}{_gib(mem.activations_ckpt):>12s}")
    over = False
    for zero1 in (False, True):
        label = "total, ZeRO-1" if zero1 else "total"
        vals = [mem.total(zero1, c) for c in (False, True)]
        fits = ["" if hw.memory_gb <= 0 else ("" if v / GIB <= hw.memory_gb else " !") for v in vals]
        over = over or any(fits)
        out.append(f"  {label:28s}{_gib(vals[0]) + fits[0]:>12s}{_gib(vals[1]) + fits[1]:>12s}")
    if over:
        out.append(f"  (! = exceeds the {hw.memory_gb:g} GiB of one {hw.name})")
    out.append("")
    f = default_compute_fraction(hw, tm, dtype)
    out.append(f"per step (compute fraction {f:.3f} of {hw.peak_tflops.get(dtype) or 0:.4g} TFLOP/s peak):")
    out.append(f"  {'':28s}{'no ckpt':>14s}{'act. ckpt':>14s}")
    fl = [step_flops(shape, lay.global_batch, c) for c in (False, True)]
    out.append(f"  {'FLOPs (all devices)':28s}{fl[0]:>14.4g}{fl[1]:>14.4g}")
    cms = [comm(shape, lay, c, dtype) for c in (False, True)]
    rows = [("TP collectives", lambda c: f"{c.tp_ops:,}"),
            ("TP payload all-reduced", lambda c: _fmt_bytes(c.tp_payload)),
            ("TP bytes sent per device", lambda c: _fmt_bytes(c.tp_wire)),
            ("PP sends (b s h each)", lambda c: f"{c.pp_ops:,}"),
            ("PP bytes sent per device", lambda c: _fmt_bytes(c.pp_payload)),
            ("DP payload (local grads)", lambda c: _fmt_bytes(c.dp_payload)),
            ("DP bytes sent per device", lambda c: _fmt_bytes(c.dp_wire))]
    for label, fn in rows:
        out.append(f"  {label:28s}{fn(cms[0]):>14s}{fn(cms[1]):>14s}")
    can_time = hw.peak_tflops.get(dtype) is not None
    if can_time:
        sts = [step_time(shape, lay, hw, tm, c, dtype, compute_fraction=f) for c in (False, True)]
        out.append(f"  predicted step time, s       {'no ckpt':>14s}{'act. ckpt':>14s}")
        for name in ("compute", "replicated", "tp", "pp", "bubble", "dp", "dp_exposed"):
            out.append(f"    {name:26s}{getattr(sts[0], name):>14.4f}{getattr(sts[1], name):>14.4f}")
        out.append(f"    {'total':26s}{sts[0].total:>14.4f}{sts[1].total:>14.4f}")
        out.append(f"    {'hw TFLOP/s per device':26s}{sts[0].tflops_per_device:>14.2f}"
                   f"{sts[1].tflops_per_device:>14.2f}")
        out.append(f"    {'tokens/s (all devices)':26s}{lay.global_batch * shape.seq / sts[0].total:>14,.0f}"
                   f"{lay.global_batch * shape.seq / sts[1].total:>14,.0f}")
    else:
        out.append(f"  (no {dtype} peak for {hw.name}: no step time)")
    if hw.intra_node_gbs is None:
        out.append("  (no link bandwidths for this device: communication time counted as 0)")
    return "\n".join(out)


def render_paper_comparison(hw_kind: str = "v100-32gb", tm: TimeModel | None = None) -> str:
    """Table of paper_weak_scaling; the last columns repeat the prediction with the DP all-reduce fully
    hidden behind backward (dp_overlap = 1), the other end of the overlap range."""
    tm = tm or TimeModel()
    rows = paper_weak_scaling(hw_kind, tm)
    hidden = paper_weak_scaling(hw_kind, dataclasses.replace(tm, dp_overlap=1.0))
    hw = get_hardware(hw_kind)
    f = default_compute_fraction(hw, tm)
    out = [f"weak scaling on {hw.name}: fp16, activation checkpointing, batch 8 per replica, compute fraction "
           f"{f:.4f} (calibrated: 1.2B on 1 GPU = {PAPER_BASELINE_TFLOPS:g} TFLOP/s), DP overlap {tm.dp_overlap:g}",
           f"{'model':7s}{'params':>7s}{'TP':>4s}{'DP':>4s}{'GPUs':>6s}{'step s':>8s}{'compute':>9s}"
           f"{'repl.':>7s}{'TP comm':>9s}{'DP comm':>9s}{'TFLOP/s':>9s}{'pred.':>7s}{'paper':>7s}{'diff':>6s}"
           f"{'pred. DP hidden':>17s}"]
    for r, rh in zip(rows, hidden):
        st = r.time
        extra = f"{rh.efficiency:>10.1%} {(rh.efficiency - rh.paper) * 100:>+5.1f}" if r.dp > 1 else ""
        out.append(f"{r.preset[5:]:7s}{_fmt_params(r.params):>7s}{r.tp:>4d}{r.dp:>4d}{r.gpus:>6d}"
                   f"{st.total:>8.3f}{st.compute:>9.3f}{st.replicated:>7.3f}{st.tp:>9.3f}{st.dp_exposed:>9.3f}"
                   f"{r.tflops:>9.2f}{r.efficiency:>7.1%}{r.paper:>7.0%}{(r.efficiency - r.paper) * 100:>+6.1f}"
                   f"{extra:>17s}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="run config YAML (model/train/precision sections are used)")
    ap.add_argument("--model", help=f"preset instead of / on top of --config: {', '.join(PRESETS)}")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: parallel.tensor)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (default: parallel.pipeline)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    ap.add_argument("--gpu", default="v100", help="device kind from training/runtime/hardware.py (v100, a100, h100, h200, cpu)")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="override the table's GPUs per node")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                    help="training dtype (default: precision.dtype, 'auto' = fp16)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: train.micro_batch_size")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="default: train.global_batch_size, raised to micro x DP when smaller")
    ap.add_argument("--flash-attention", action="store_true",
                    help="do not count the s^2 attention-score activations (fused attention kernels)")
    ap.add_argument("--dp-overlap", type=float, default=TimeModel.dp_overlap,
                    help="fraction of the DP all-reduce hidden behind backward (0..1)")
    ap.add_argument("--compute-fraction", type=float, default=None,
                    help="achieved fraction of peak (default: calibrated/table value)")
    ap.add_argument("--paper-comparison", action="store_true",
                    help="print the Megatron-LM weak-scaling prediction vs the paper and exit")
    ap.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if not 0.0 <= args.dp_overlap <= 1.0:
            raise ConfigError(f"--dp-overlap must be in [0, 1], got {args.dp_overlap}")
        if args.compute_fraction is not None and not 0.0 < args.compute_fraction <= 1.0:
            raise ConfigError(f"--compute-fraction must be in (0, 1], got {args.compute_fraction}")
        tm = TimeModel(compute_fraction=args.compute_fraction, dp_overlap=args.dp_overlap)
        if args.paper_comparison:
            print(render_paper_comparison("v100-32gb", tm))
            return 0
        if args.config is None and args.model is None:
            raise ConfigError("give --config PATH and/or --model PRESET "
                              f"(presets: {', '.join(PRESETS)})")
        if canonical_kind(args.gpu) is None:
            raise ConfigError(f"unknown --gpu {args.gpu!r}; see training/runtime/hardware.py (v100, a100, h100, h200, cpu)")
        hw = get_hardware(args.gpu)
        cfg = load_plan_config(args.config, args.model, args.overrides)
        tp = args.tp if args.tp is not None else cfg.parallel.tensor
        pp = args.pp if args.pp is not None else cfg.parallel.pipeline
        micro = args.micro_batch if args.micro_batch is not None else cfg.train.micro_batch_size
        glob = args.global_batch if args.global_batch is not None else max(cfg.train.global_batch_size,
                                                                               micro * args.dp)
        dtype = args.dtype or ("fp16" if cfg.precision.dtype == "auto" else cfg.precision.dtype)
        lay = Layout(tp=tp, pp=pp, dp=args.dp, micro_batch=micro, global_batch=glob,
                     gpus_per_node=args.gpus_per_node or hw.gpus_per_node)
        if lay.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {lay.tp}")
        shape = ModelShape.from_config(cfg.model, tp, cfg.bert)
        validate(shape, lay)
        if hw.name != "cpu" and hw.peak_tflops.get(dtype) is None:
            raise ConfigError(f"{hw.name} has no {dtype} peak in training/runtime/hardware.py: choose another --dtype")
        if hw.name == "cpu":
            from training.runtime.hardware import peak_tflops
            measured = peak_tflops("cpu", dtype)
            hw = dataclasses.replace(hw, peak_tflops={dtype: measured})
        print(render_plan(shape, lay, hw, tm, dtype, scores_stored=not args.flash_attention))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
