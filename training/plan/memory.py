"""Memory per device: weights, gradients and Adam states per parameter, and activations.

Weights/gradients/optimizer: fp16/bf16 mixed precision 2 + 2 + 12 bytes per parameter (fp32 master, m,
v), fp32 training 4 + 4 + 8; ZeRO-1 divides the optimizer part by DP, where DeepSpeed's ZeRO optimizer
keeps an fp32 copy of the weights in fp32 training too (12 bytes per parameter in every dtype). ZeRO-2 divides
the gradients as well and ZeRO-3 the weights (:func:`zero_state_bytes`, the ZeRO paper's table: with Psi one TP
rank's parameters and Nd the DP degree, 2 Psi + 2 Psi + K Psi / Nd at stage 1, 2 Psi + (2 + K) Psi / Nd at stage 2,
(2 + 2 + K) Psi / Nd at stage 3); ZeRO-Offload moves the optimizer part to host memory.
Activations per Korthikanti et al. 2022 without recomputation, with selective recomputation (the attention
core) and with full activation checkpointing, with and without sequence
parallelism, at the peak of a 1F1B schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from training.layout import Layout
from training.models.config import stage_layers
from training.plan.accounting import ModelShape, stage_params

GIB = 1024**3
ZERO_OPTIMIZER_BYTES_PER_PARAM = 12
"""Bytes per parameter of DeepSpeed's ZeRO-1 optimizer part, before dividing by DP, in every dtype: its
``DeepSpeedZeroOptimizer`` keeps an fp32 copy of its partition of the weights even in fp32 training
(``single_partition_of_fp32_groups``) next to Adam's m and v, so 4 + 4 + 4 (measured in
``tests/parallel/test_plan_measured.py``; DeepSpeed's alignment padding of the partitions is not counted)."""


@dataclass(frozen=True)
class ZeroState:
    """Bytes of one rank's model state under a ZeRO stage: on the device (weights, gradients, optimizer states)
    and in host memory (the optimizer states ZeRO-Offload moves there)."""

    stage: int
    params: float
    grads: float
    optimizer: float
    host_optimizer: float = 0.0

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_state_bytes(n: float, dtype: str, dp: int, stage: int, offload: bool = False) -> ZeroState:
    """The ZeRO paper's per-rank model state (Rajbhandari et al. 2020, Table 1) for ``n`` parameters on this rank
    (one TP rank's share, of the most loaded stage under PP) over ``dp`` data-parallel ranks:

    ======  ==========================================  ==========================
    stage   weights + gradients + optimizer states      divided by Nd
    ======  ==========================================  ==========================
    0       w n + g n + o n                             nothing
    1       w n + g n + 12 n / Nd                       optimizer states
    2       w n + (g + 12) n / Nd                       and gradients
    3       (w + g + 12) n / Nd                         and weights
    ======  ==========================================  ==========================

    (w, g, o) = :func:`state_bytes_per_param` (2, 2, 12 mixed precision; 4, 4, 8 fp32); ZeRO's optimizer keeps an
    fp32 partition of the weights in every dtype, so 12 bytes (:data:`ZERO_OPTIMIZER_BYTES_PER_PARAM`) from stage
    1 on (ZeRO-3 too, measured in fp32 on CPU in ``tests/parallel/test_plan_zero.py``: its fp32 partitions are a
    copy beside the weight partitions). ``offload`` (stages 2-3): the optimizer part in host memory instead. Not counted: DeepSpeed's reduce and
    all-gather buckets (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``), ZeRO-3's gathered layer during
    its forward and backward, the partitions' alignment padding, and ZeRO-3's persistent small parameters
    (``stage3_param_persistence_threshold``: kept whole on every rank)."""
    wb, gb, ob = state_bytes_per_param(dtype)
    opt = float(ob * n) if stage == 0 else ZERO_OPTIMIZER_BYTES_PER_PARAM * n / dp
    grads = gb * n / (dp if stage >= 2 else 1)
    params = wb * n / (dp if stage >= 3 else 1)
    if offload:
        return ZeroState(stage, params, grads, 0.0, opt)
    return ZeroState(stage, params, grads, opt)


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per parameter for Adam.

    fp16/bf16 mixed precision: 2 (half weights) + 2 (half grads) + 12 (fp32 master, m, v).
    fp32: 4 + 4 + 8 (m, v; the weights are the master).
    """
    return (2, 2, 12) if dtype in ("fp16", "bf16") else (4, 4, 8)


def activation_element_bytes(dtype: str, cpu: bool = False) -> tuple[int, int]:
    """(bytes per stored activation element, bytes per dropout-mask element) as our models store them.

    fp16/bf16: 2 and 1 (``F.dropout`` keeps a bool mask), Korthikanti's assumption. fp32: 4, and 1 on GPUs
    (``F.dropout``) but 4 on CPU, where ``training.models.ops`` keeps the scaled fp32 mask {0, 1/(1-p)} of
    its faster dropout (measured in ``tests/parallel/test_plan_activations.py``).
    """
    if dtype in ("fp16", "bf16"):
        return 2, 1
    return 4, (4 if cpu else 1)


def activation_bytes_per_layer(shape: ModelShape, micro_batch: int, tp: int, scores_stored: bool = True,
                               act_bytes: int = 2, mask_bytes: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022, eq. (1)/(2)/(4); with the defaults 16-bit activations and 1-byte masks:

        s b h (34 + 5 a s / h)                       t = 1
        s b h (10 + 24/t + 5 a s / (h t))            tensor parallel
        s b h / t (34 + 5 a s / h)                   tensor + sequence parallel (``sequence_parallel``)

    Terms: 10 sbh replicated on every TP rank (two LN inputs 4, QKV and h->4h inputs 4, two dropout
    masks 2); 24/t split (Q, K, V 6, projection input 2, GeLU input and output 2 x 8); 5 a s^2 b / t
    for the attention scores (softmax output 2, dropout mask 1, dropout output 2). For an MLP width f
    the 16 becomes 4 f / h. ``scores_stored=False`` drops the s^2 term: flash attention, and selective
    recomputation (the paper's ``s b h (10 + 24/t)``, Table 2), which recomputes exactly that term.

    In elements: e = ``act_bytes`` per activation, k = ``mask_bytes`` per mask element,

        s b h (e (4 + (4 + 2 f/h) / t) + 2 k) + a s^2 b (2 e + k) / t

    (e = 4, k = 4 for fp32 on CPU: :func:`activation_element_bytes`). Not counted: the LayerNorms' mean
    and 1/std (2 x 2 s b fp32 values, < 0.5 % at h >= 64).

    Sequence parallelism divides the replicated ``e 4 + 2 k`` by t: the two norms' inputs, the two dropout masks
    and the inputs of QKV and the MLP's first linear, which our sequence-parallel column linear keeps as the
    chunk [b, s/t, h] and all-gathers again in backward (``training.parallel.layers``).
    """
    s, b, h, a = shape.seq, micro_batch, shape.hidden, shape.heads
    e, k = act_bytes, mask_bytes
    replicated = e * 4 + 2 * k
    per_sbh = replicated / (tp if sequence_parallel else 1) + e * (4 + 2 * shape.ffn / h) / tp
    if scores_stored:
        per_sbh += (2 * e + k) * a * s / (h * tp)
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
    activations_selective: float
    """Activations with selective recomputation (``model.recompute: selective``; = ``activations`` when the
    attention core keeps no scores)."""
    zero: ZeroState | None = None
    """The model state at the run's ZeRO stage and offload (:func:`zero_state_bytes`; None: stage 0 or 1 as
    ``total``'s ``zero1`` says)."""

    def total_at_stage(self, recompute: str) -> float:
        """Device bytes at the run's ZeRO stage (``zero``) with ``recompute`` 'none', 'selective' or 'full'."""
        if self.zero is None:
            return self.total_for(False, recompute)
        act = {"none": self.activations, "selective": self.activations_selective, "full": self.activations_ckpt}
        return self.zero.device + act[recompute]

    def total(self, zero1: bool, ckpt: bool) -> float:
        return self.total_for(zero1, "full" if ckpt else "none")

    def total_for(self, zero1: bool, recompute: str) -> float:
        """Total bytes with ``recompute`` 'none', 'selective' or 'full'."""
        act = {"none": self.activations, "selective": self.activations_selective, "full": self.activations_ckpt}
        return self.params + self.grads + (self.optimizer_zero1 if zero1 else self.optimizer) + act[recompute]


def micro_batches_in_flight(lay: Layout, stage: int) -> float:
    """Whole-stage activations alive at the peak on ``stage``: min(p - i, m) micro-batches under 1F1B. Under the
    interleaved schedule (v chunks of l/(p v) layers) the first backward follows (p - i - 1) 2 + (v - 1) p + 1
    chunk forwards (all v m when m = p, Megatron's order), i.e. that many / v stages' worth. Under DualPipeV (two
    stages of l/(2p) layers per rank, DeepSpeed's ``DualPipeVSchedule``) every rank peaks at 2p + 1 stage forwards
    (its warm-up holds 2p, the main step runs a forward before each backward), p + 1/2 stages' worth."""
    p, m, v = lay.pp, lay.num_micro, lay.virtual_pipeline
    if lay.dualpipev and p > 1:
        return (2 * p + 1) / 2
    if v == 1:
        return min(p - stage, m)
    chunks = v * m if m == p else min(v * m, (p - stage - 1) * 2 + (v - 1) * p + 1)
    return chunks / v


def stage_activation_bytes(shape: ModelShape, lay: Layout, stage: int, ckpt: bool,
                           scores_stored: bool = True, act_bytes: int = 2, mask_bytes: int = 1,
                           selective: bool = False) -> float:
    """Activations alive on one TP rank of ``stage`` at the peak of a 1F1B schedule.

    Stage i keeps min(p - i, m) micro-batches in flight (one when p = 1: gradient accumulation runs
    micro-batches one after another and frees each before the next). Without checkpointing each
    keeps the full per-layer set for its l/p layers; with full checkpointing only the layer input
    (2 s b h per layer) plus the working set of the one layer being recomputed. Extras (Korthikanti
    sec. 4.3): embedding dropout mask s b h on stage 0; final-LN input 2 s b h, output-layer
    input 2 s b h and fp32 logits 4 s b V / t on the last stage. 16-bit by default; ``act_bytes`` and
    ``mask_bytes`` as in :func:`activation_bytes_per_layer` (2 s b h -> e s b h, the mask k s b h).
    ``selective``: the attention core is recomputed in backward, so no layer keeps its s^2 scores (the one
    core being recomputed holds them for a moment: not counted, 1/l of what was saved).
    With sequence parallelism (``lay.sequence_parallel``) every s b h term here is the rank's chunk: / t.
    With context parallelism (``lay.context`` = c) every term is / c: the s b h terms and the logits hold the
    rank's s/c tokens, and its scores are s/c queries against all s keys (Ulysses: s^2 on a/(t c) heads; ring:
    c blocks of (s/c)^2 per head), s^2/c either way.
    """
    s, b, h = shape.seq, lay.micro_batch, shape.hidden
    e, k = act_bytes, mask_bytes
    sp = lay.sequence_parallel
    per_layer = activation_bytes_per_layer(shape, b, lay.tp, scores_stored and not selective, e, k, sequence_parallel=sp)
    sbh = s * b * h / (lay.tp if sp else 1)
    layers = stage_layers(shape.num_layers, lay.pp)[stage]  # DeepSpeed's balanced split
    in_flight = micro_batches_in_flight(lay, stage)
    if ckpt:
        act = in_flight * layers * e * sbh + per_layer
    else:
        act = in_flight * layers * per_layer
    if stage == 0:
        act += in_flight * k * sbh
    if stage == (0 if lay.dualpipev else lay.pp - 1):  # DualPipeV: rank 0 holds the last stage too
        act += 2 * e * sbh + 4 * s * b * shape.vocab / lay.tp
    return act / lay.context


def memory(shape: ModelShape, lay: Layout, dtype: str = "fp16", scores_stored: bool = True,
           cpu: bool = False, zero_stage: int = 0, offload: bool = False) -> Memory:
    """Per-device memory of the most loaded stage (max over stages of each total); activations in the
    bytes ``dtype`` stores them (``cpu``: fp32 dropout masks, :func:`activation_element_bytes`); ``zero`` the model
    state at ``zero_stage`` (with ``offload``)."""
    wb, gb, ob = state_bytes_per_param(dtype)
    e, k = activation_element_bytes(dtype, cpu)
    params = stage_params(shape, lay.tp, lay.pp, lay.dualpipev)
    best: Memory | None = None
    for i, n in enumerate(params):
        shards = lay.dp * lay.context                                   # ZeRO partitions over DP x CP
        m = Memory(params=wb * n, grads=gb * n, optimizer=ob * n, optimizer_zero1=ZERO_OPTIMIZER_BYTES_PER_PARAM * n / shards,
                   activations=stage_activation_bytes(shape, lay, i, False, scores_stored, e, k),
                   activations_ckpt=stage_activation_bytes(shape, lay, i, True, scores_stored, e, k),
                   activations_selective=stage_activation_bytes(shape, lay, i, False, scores_stored, e, k,
                                                                selective=True),
                   zero=zero_state_bytes(n, dtype, shards, zero_stage, offload))
        if best is None or m.total(False, False) > best.total(False, False):
            best = m
    assert best is not None
    return best
