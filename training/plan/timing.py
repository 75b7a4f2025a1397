"""Communication volume per step for TP, PP and DP, and the predicted step time (an alpha-beta model).

``TimeModel`` holds every constant of the step-time model (docs/plan.md explains each); ``step_time``
adds compute, the element-wise work TP does not split, the TP all-reduces, PP sends and bubble, and the
exposed part of the DP all-reduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds_suite.core.errors import ConfigError
from training.layout import Layout
from training.models.config import stage_layers
from training.plan.accounting import ModelShape, stage_params, step_flops
from training.plan.context_comm import context_comm, context_time
from training.plan.memory import state_bytes_per_param
from training.runtime.hardware import Hardware


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
    pp_send_bytes: float = 0.0
    """Bytes of one stage-to-stage message (activation or its gradient) per TP rank: :func:`pipe_send_bytes`."""
    pp_gather_ops: int = 0
    """All-gathers over the TP group that put scattered messages back together (:func:`pipe_gathers_per_micro`)."""
    pp_gather_wire: float = 0.0
    """Bytes this rank sends in those all-gathers (ring: (t - 1)/t of each whole tensor)."""


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
    return max(stage_layers(shape.num_layers, lay.pp)) * per_layer + ends


def chunks_per_rank(lay: Layout) -> int:
    """Stage-to-stage sends per micro-batch and direction on one rank: v under the interleaved schedule, 2 under
    DualPipeV (each rank's two stages send both ways), 1 under 1F1B."""
    return 2 if lay.dualpipev and lay.pp > 1 else lay.virtual_pipeline


def pipe_scatters(lay: Layout) -> bool:
    """Whether stage-to-stage tensors travel as 1/t pieces all-gathered on receipt (Megatron's scatter/gather): at
    TP > 1 without sequence parallelism, under 1F1B (DeepSpeed's ``pipeline.pipe_partitioned`` and
    ``grad_partitioned``, on by default; ``training.ds_json`` turns them off with sequence parallelism) and under
    the interleaved schedule (:mod:`training.parallel.pipe_scatter`); DualPipeV sends whole tensors."""
    return lay.pp > 1 and lay.tp > 1 and not lay.sequence_parallel and not lay.dualpipev


def pipe_send_bytes(sbh_bytes: float, lay: Layout) -> float:
    """Bytes of one stage-to-stage message per TP rank, for an activation of ``sbh_bytes`` (this rank's b s h
    tokens): 1/t of it where :func:`pipe_scatters`, and 1/t with sequence parallelism too (each TP rank's tensor
    between the layers is its s/t chunk of the sequence, sent whole); the whole of it otherwise."""
    return sbh_bytes / lay.tp if pipe_scatters(lay) or lay.sequence_parallel else sbh_bytes


def pipe_gathers_per_micro(lay: Layout) -> int:
    """All-gathers of a whole b s h tensor over the TP group per micro-batch on one (interior) rank that the
    scatter/gather adds: under the interleaved schedule one per received message, the activation and the gradient
    of each of the v chunks (2 v); under DeepSpeed's 1F1B three: the received activation, the received gradient, and
    the stage's own output once more in backward (its engine frees the sent output and gathers it back from the
    TP ranks' pieces to run backward through it, ``PipelineEngine._exec_backward_pass``). None without scattering."""
    if not pipe_scatters(lay):
        return 0
    return 2 * lay.virtual_pipeline if lay.virtual_pipeline > 1 else 3


def bubble_fraction(lay: Layout) -> float:
    """The pipeline bubble over the ideal step (work of m micro-batches): (p-1)/m under 1F1B, (p-1)/(v m) under the
    interleaved schedule, (5p - 6)/(6m) under DeepSpeed's DualPipeV. The last is what its ``DualPipeVSchedule``
    leaves idle with a backward twice the forward (weight gradients not deferred, forward and backward not
    overlapped, as DeepSpeed runs them): (p-1)(F/2 + B) - F/2 per step for a rank's forward F and backward B of one
    micro-batch, against 1F1B's (p-1)(F + B); tests/unit/test_pipeline_schedule.py simulates the schedule."""
    p, m = lay.pp, lay.num_micro
    if lay.dualpipev and p > 1:
        return (5 * p - 6) / (6 * m)
    return (p - 1) / (m * lay.virtual_pipeline)


def comm(shape: ModelShape, lay: Layout, ckpt: bool, dtype: str = "fp16") -> Comm:
    act_bytes = 2 if dtype in ("fp16", "bf16") else 4
    sbh = shape.seq // lay.context * lay.micro_batch * shape.hidden * act_bytes  # this rank's tokens
    m = lay.num_micro
    n_ar = tp_allreduces_per_micro(shape, lay, ckpt)
    ce = 3 * shape.seq // lay.context * lay.micro_batch * 4 if lay.tp > 1 else 0  # max, target logit, sum-exp (fp32)
    tp_payload = m * (n_ar * sbh + ce)
    # activations forward + their gradients backward, each way; per chunk under the interleaved schedule
    pp_ops = 2 * m * chunks_per_rank(lay) if lay.pp > 1 else 0
    send = pipe_send_bytes(sbh, lay)
    gathers = m * pipe_gathers_per_micro(lay)
    local = max(stage_params(shape, lay.tp, lay.pp, lay.dualpipev))
    grad_bytes = state_bytes_per_param(dtype)[1]
    return Comm(tp_ops=m * (n_ar + (3 if lay.tp > 1 else 0)), tp_payload=tp_payload,
                tp_wire=ring_allreduce_wire(tp_payload, lay.tp),
                pp_ops=pp_ops, pp_payload=pp_ops * send, pp_send_bytes=send, pp_gather_ops=gathers,
                pp_gather_wire=gathers * (lay.tp - 1) / lay.tp * sbh,
                dp_payload=local * grad_bytes if lay.dp * lay.context > 1 else 0.0,
                dp_wire=ring_allreduce_wire(local * grad_bytes, lay.dp * lay.context))


@dataclass(frozen=True)
class TimeModel:
    """Constants of the step-time model (docs/plan.md explains each and how sensitive the result is).

    step = overhead + compute + replicated + TP + PP p2p + bubble + (1 - dp_overlap) x DP
    """

    compute_fraction: float | None = None
    """Achieved fraction of the 16-bit peak on dense work; None = calibrate (V100: from the paper's
    39 TFLOP/s 1.2B baseline) or the hardware table's value."""
    alpha_intra_s: float = 5e-6
    """Latency per ring step inside a node (NCCL over NVLink/NVSwitch: a few microseconds). On CPU
    benchmarks/bench_plan_fidelity.py measures it as it occurs inside a training step (gloo: ~1 ms)."""
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
    overhead_step_s: float = 0.0
    """Fixed seconds per optimizer step that do not scale with FLOPs (the framework's step: Python, the
    optimizer's loop over parameter tensors, the engine's bookkeeping). 0 on GPUs, where kernels queue
    ahead of the host; measured on CPU (benchmarks/bench_plan_fidelity.py)."""
    overhead_layer_s: float = 0.0
    """Fixed seconds per layer per micro-batch (forward + backward op dispatch), not split by TP: every
    TP rank dispatches every op of its layers, so the TP = 1 figure holds at every degree. 0 on GPUs;
    measured on CPU (a model too small to compute, at 1 and 3 layers)."""


@dataclass(frozen=True)
class StepTime:
    overhead: float
    compute: float
    replicated: float
    tp: float
    pp: float
    bubble: float
    dp: float
    dp_exposed: float
    flops_per_device: float
    cp: float = 0.0
    """Context parallelism's all-to-alls (Ulysses) or K/V shifts (ring), not overlapped."""

    @property
    def total(self) -> float:
        return (self.overhead + self.compute + self.replicated + self.tp + self.cp + self.pp + self.bubble
                + self.dp_exposed)

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

    * overhead = overhead_step_s + overhead_layer_s x (l/p layers) x m: host time that does not scale with
      FLOPs (0 on GPUs; it dominates small models on CPU).
    * compute = hardware FLOPs per device / (peak x fraction). FLOPs per device = step_flops / (t p d).
    * replicated = (1 - 1/t) x (element-wise bytes of l/p layers x m micro-batches) / (HBM x eff):
      the fraction calibrates this work at t = 1 as part of "compute"; with TP every rank repeats it
      instead of doing 1/t of it.
    * TP: each all-reduce of n bytes over t ranks costs 2 (t-1) alpha + 2 (t-1)/t n / beta; on the
      critical path (no overlap in Megatron TP). Intra-node link if t <= gpus_per_node.
    * PP: 2 m v point-to-point sends per stage (alpha + n / beta) of n = :func:`pipe_send_bytes` (b s h, or 1/t of it
      under the scatter/gather or sequence parallelism), the scatter/gather's all-gathers of b s h over the TP
      group (:func:`pipe_gathers_per_micro`, (t-1) alpha + (t-1)/t b s h / beta on the TP link), plus the bubble
      (p - 1)/(v m) x (per-layer overhead + compute + replicated + TP); v = 1 under 1F1B, the chunks per rank
      under the interleaved schedule, 2 under DualPipeV, whose bubble is :func:`bubble_fraction`'s.
    * CP (c > 1): every term above runs on the rank's s/c tokens; the context-parallel traffic is
      :mod:`training.plan.context_comm`'s (intra-node link if t c <= gpus_per_node), in the bubble too.
    * DP: ring all-reduce of the local gradients over the d c ranks that share them. If the DP group (t d consecutive-stride ranks) fits in
      one node it uses NVLink; otherwise every node's NICs carry one ring crossing per DP group with
      members on that node: (gpus_per_node / k) rings, k = max(1, gpus_per_node // t) members per node.
    """
    f = compute_fraction if compute_fraction is not None else (tm.compute_fraction or hw.achievable_fraction)
    peak = hw.peak_tflops.get(dtype)
    if peak is None:
        raise ConfigError(f"{hw.name} has no {dtype} peak in training/runtime/hardware.py: choose another --dtype")
    t, p, d, m, G, c = lay.tp, lay.pp, lay.dp, lay.num_micro, lay.gpus_per_node, lay.context
    act_bytes = 2 if dtype in ("fp16", "bf16") else 4
    flops_dev = step_flops(shape, lay.global_batch, ckpt) / (t * p * d * c)
    compute = flops_dev / (peak * 1e12 * f)

    sbh = shape.seq // c * lay.micro_batch * shape.hidden
    passes = 3 if ckpt else 2
    repl_bytes = tm.replicated_bytes_per_sbh * passes * sbh * (act_bytes / 2) * max(stage_layers(shape.num_layers, p)) * m
    replicated = (1 - 1 / t) * repl_bytes / _bw(hw.hbm_gbs, tm.memory_efficiency)

    if t <= G:
        tp_bw, tp_alpha = _bw(hw.intra_node_gbs, tm.link_efficiency), tm.alpha_intra_s
    else:  # TP across nodes: each GPU gets its share of the node's NICs
        tp_bw, tp_alpha = _bw(hw.inter_node_gbs, tm.link_efficiency) / G, tm.alpha_inter_s
    n_ar = tp_allreduces_per_micro(shape, lay, ckpt)
    tp = m * (n_ar * _allreduce_time(sbh * act_bytes, t, tp_alpha, tp_bw)
              + (3 * _allreduce_time(shape.seq // c * lay.micro_batch * 4, t, tp_alpha, tp_bw) if t > 1 else 0.0))
    cp = 0.0
    if c > 1:
        cp_intra = t * c <= G
        cp_bw = _bw(hw.intra_node_gbs if cp_intra else hw.inter_node_gbs, tm.link_efficiency) / (1 if cp_intra else G)
        cc = context_comm(shape, lay, max(stage_layers(shape.num_layers, p)), ckpt, act_bytes)
        cp = 0.0 if math.isinf(cp_bw) else context_time(cc, tm.alpha_intra_s if cp_intra else tm.alpha_inter_s, cp_bw)

    pp = 0.0
    if p > 1:
        if t * d * p <= G:
            pp_bw, pp_alpha = _bw(hw.intra_node_gbs, tm.link_efficiency), tm.alpha_intra_s
        else:
            pp_bw, pp_alpha = _bw(hw.inter_node_gbs, tm.link_efficiency) / G, tm.alpha_inter_s
        v = chunks_per_rank(lay)  # interleaving: v times the sends, 1/v of the bubble
        pp = 0.0 if math.isinf(pp_bw) else 2 * m * v * (pp_alpha + pipe_send_bytes(sbh * act_bytes, lay) / pp_bw)
        if not math.isinf(tp_bw):  # the receivers' all-gathers of the scattered pieces, on the TP link
            pp += m * pipe_gathers_per_micro(lay) * ((t - 1) * tp_alpha + (t - 1) / t * sbh * act_bytes / tp_bw)
    layer_overhead = tm.overhead_layer_s * max(stage_layers(shape.num_layers, p)) * m
    bubble = bubble_fraction(lay) * (layer_overhead + compute + replicated + tp + cp)

    grad_bytes = max(stage_params(shape, t, p, lay.dualpipev)) * state_bytes_per_param(dtype)[1]
    if t * d * c <= G:
        dp = _allreduce_time(grad_bytes, d * c, tm.alpha_intra_s, _bw(hw.intra_node_gbs, tm.link_efficiency))
    else:
        k = max(1, G // t)
        rings_per_node = G / k
        dp = _allreduce_time(grad_bytes, d * c, tm.alpha_inter_s,
                             _bw(hw.inter_node_gbs, tm.link_efficiency) / rings_per_node)
    return StepTime(overhead=tm.overhead_step_s + layer_overhead, compute=compute, replicated=replicated, tp=tp,
                    pp=pp, bubble=bubble, dp=dp, dp_exposed=(1 - tm.dp_overlap) * dp, flops_per_device=flops_dev,
                    cp=cp)
