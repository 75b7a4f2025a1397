"""The parallel section of the run config (``parallel:``) and its rules: ZeRO and offload against the parallel
degrees, and the pipeline schedule's rules (docs/pipeline.md, docs/zero.md), each refusal one line before any
work. :func:`training.config.validate_static` runs the first two; :func:`check_micro_batches` runs where the
micro-batches per step are known (the layout, the DeepSpeed JSON, the reshard tool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ds_suite.core.config import Freezable
from megatron_ds_suite.core.errors import ConfigError
from training.models.config import ModelConfig


@dataclass
class ParallelConfig(Freezable):
    tensor: int = 1
    """Tensor-parallel degree (ranks that split every layer)."""
    pipeline: int = 1
    """Pipeline-parallel degree (DeepSpeed PipelineModule: ``training.models.gpt2_pipe``, ``training.models.bert_pipe``)."""
    pipeline_schedule: Literal["1f1b", "interleaved", "dualpipev"] = "1f1b"
    """Pipeline schedule (docs/pipeline.md): '1f1b' DeepSpeed's PipeDream-Flush, 'interleaved' Megatron's
    interleaved 1F1B over parallel.virtual_pipeline chunks per rank (bubble (p-1)/(v m)), 'dualpipev' DeepSpeed's
    DualPipeV (two stages per rank, at least 2 x pipeline micro-batches)."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank (Megatron's virtual pipeline size v, 'interleaved' only): the layers cut into
    pipeline x v equal groups, rank r holding groups r, r+p, ..., r+(v-1)p."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 = off, 1 = optimizer states sharded across DP ranks, 2 = gradients too (with TP,
    sequence parallelism and DP; not with pipeline parallelism, whose DeepSpeed engine runs stages 0-1 only),
    3 = parameters too (with TP, sequence parallelism and DP: each TP shard partitioned over the DP ranks and
    gathered per layer in forward and backward; not with pipeline parallelism). Stages 1-3 run
    DeepSpeed's own ZeRO optimizer step (docs/zero.md: what each stage costs and saves)."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-Offload (ZeRO-2/3 only, no pipeline parallelism): 'cpu' keeps the fp32 optimizer states (master
    weights, Adam moments) in host memory and runs the Adam step on the CPU (the client torch AdamW over the host
    partitions; DeepSpeed's JIT-compiled DeepSpeedCPUAdam is not swapped in: training.ds_json.offload_keys)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al. 2022), TP > 1 only: norms, dropout and residuals run
    on a 1/tensor chunk of the sequence, the TP all-reduces become all-gather / reduce-scatter pairs; same
    weights and numerics, activations per layer sbh/t (34 + 5as/h) instead of sbh (10 + 24/t + 5as/(ht)) (docs/
    llama.md). model.seq_length must be a multiple of parallel.tensor."""
    context: int = 1
    """Context-parallel degree c (docs/context_parallel.md): every sample's tokens split over c ranks that hold the
    same weights (gradients reduced over data x context parallel ranks); the attention exchanges what it needs."""
    context_impl: Literal["ulysses", "ring"] = "ulysses"
    """'ulysses': DeepSpeed's DistributedAttention (all-to-all from sequence-split to head-split around the core;
    heads after TP divisible by c); 'ring': ring attention over Megatron's load-balanced causal chunks (2c chunks,
    rank i holding i and 2c-1-i; the sequence divisible by 2c)."""

def validate_zero(p: ParallelConfig) -> None:
    """The ZeRO stage and offload against the other parallel degrees, each refusal one line."""
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: 0, 1, 2 or 3")
    if p.zero_stage >= 2 and p.pipeline > 1:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} with parallel.pipeline={p.pipeline}: DeepSpeed's pipeline "
                          f"engine runs ZeRO stage 0 or 1 only; set parallel.zero_stage=1 or parallel.pipeline=1")
    if p.offload_optimizer != "none" and (p.zero_stage < 2 or p.pipeline > 1):
        raise ConfigError(f"parallel.offload_optimizer={p.offload_optimizer} with parallel.zero_stage={p.zero_stage} "
                          f"and parallel.pipeline={p.pipeline}: DeepSpeed offloads optimizer states at ZeRO stage 2 or "
                          f"3 only, without pipeline parallelism; set parallel.offload_optimizer=none or "
                          f"parallel.zero_stage=2 (or 3) with parallel.pipeline=1")


def validate_universal_load(source: str | None, init_from: str | None, p: ParallelConfig) -> None:
    """``train.load_universal`` against the layout, each refusal one line: DeepSpeed's universal load fills the
    partitions of its ZeRO optimizers (stages 1-2 here, not the project's own ZeRO-0 step) and of no pipeline model here
    (its checkpoints carry no universal info: training.checkpoint). ZeRO-3 loads one from a ZeRO-3 run
    (training.universal.check_source), each parameter group's hyperparameters kept (training.optim.engine)."""
    if source is None:
        return
    if init_from is not None:
        raise ConfigError(f"train.load_universal={source} with train.init_from={init_from}: a run starts from one "
                          f"source; unset one of them")
    if p.pipeline > 1:
        raise ConfigError(f"train.load_universal with parallel.pipeline={p.pipeline}: universal checkpoints load "
                          f"here with parallel.pipeline=1 only; change the PP layout with python -m "
                          f"training.tools.reshard")
    if p.zero_stage == 0:
        raise ConfigError("train.load_universal with parallel.zero_stage=0: DeepSpeed's universal load fills its "
                          "ZeRO optimizers' partitions, not the project's own ZeRO-0 step; set parallel.zero_stage=1, "
                          "2 or 3")


def validate_pipeline_schedule(p: ParallelConfig, m: ModelConfig) -> None:
    """The schedule's own rules (docs/pipeline.md), each refusal one line: interleaving needs PP >= 2, v >= 2
    dividing each rank's layers and micro-batches (gradient accumulation steps) in multiples of PP (Megatron-LM
    2021); DualPipeV two stages per rank and at least 2 x PP micro-batches (ZeRO-0 and 1 run under every schedule:
    :func:`validate_zero`)."""
    sched, v, pp = p.pipeline_schedule, p.virtual_pipeline, p.pipeline
    if v < 1:
        raise ConfigError(f"parallel.virtual_pipeline must be >= 1, got {v}")
    if sched != "interleaved" and v != 1:
        raise ConfigError(f"parallel.virtual_pipeline={v} needs parallel.pipeline_schedule=interleaved (got "
                          f"{sched}): set the schedule, or parallel.virtual_pipeline=1")
    if sched == "1f1b":
        return
    if pp < 2:
        raise ConfigError(f"parallel.pipeline_schedule={sched} needs parallel.pipeline >= 2 (got {pp}): set "
                          f"parallel.pipeline, or parallel.pipeline_schedule=1f1b")
    if sched == "interleaved" and v < 2:
        raise ConfigError("parallel.pipeline_schedule=interleaved needs parallel.virtual_pipeline >= 2 (one chunk "
                          "per rank is 1f1b): set parallel.virtual_pipeline=2 or parallel.pipeline_schedule=1f1b")
    stages = pp * (2 if sched == "dualpipev" else v)
    if m.num_layers % stages:
        raise ConfigError(f"model.num_layers={m.num_layers} does not split into {stages} equal groups (parallel."
                          f"pipeline={pp} x {'2 stages per rank' if sched == 'dualpipev' else f'virtual_pipeline={v}'}"
                          f"): choose a layer count that is a multiple of {stages}")


def validate_context(p: ParallelConfig, m: ModelConfig) -> None:
    """Context parallelism's rules (docs/context_parallel.md), each refusal one line: the sequence divides into c
    (Ulysses) or 2c (ring) chunks, the heads after TP into c (Ulysses); not with what it cannot run yet."""
    c, impl = p.context, p.context_impl
    if c < 1:
        raise ConfigError(f"parallel.context must be >= 1, got {c}")
    if c == 1:
        return
    chunks = c if impl == "ulysses" else 2 * c
    if m.seq_length % chunks:
        raise ConfigError(f"model.seq_length={m.seq_length} is not divisible by {chunks} (parallel.context={c}, "
                          f"{impl}{' splits into 2c load-balanced chunks' if impl == 'ring' else ''}): choose a "
                          f"sequence length that is a multiple of {chunks}")
    if p.sequence_parallel and (m.seq_length // c) % p.tensor:
        raise ConfigError(f"model.seq_length={m.seq_length} / parallel.context={c} is not a multiple of parallel.tensor="
                          f"{p.tensor} (sequence parallelism splits each CP rank's tokens over TP): choose a sequence "
                          f"length that is a multiple of {c * p.tensor}")
    if impl == "ulysses" and (m.num_attention_heads // p.tensor) % c:
        raise ConfigError(f"parallel.context={c} (ulysses) does not divide the {m.num_attention_heads // p.tensor} "
                          f"attention heads per TP rank: choose c dividing model.num_attention_heads / parallel.tensor, "
                          f"or parallel.context_impl=ring")
    refusals = [
        (p.pipeline > 1, f"parallel.pipeline={p.pipeline}", "set parallel.pipeline=1"),
        (m.arch == "bert", "model.arch=bert", "context parallelism is for causal GPT models"),
        (m.compile or m.cuda_graph, "model.compile", "set model.compile=false"),
        (m.sliding_window is not None, f"model.sliding_window={m.sliding_window}", "remove model.sliding_window"),
        (impl == "ring" and m.attention_dropout > 0.0, f"model.attention_dropout={m.attention_dropout} (ring)",
         "set model.attention_dropout=0 or parallel.context_impl=ulysses"),
        (impl == "ring" and (m.apply_query_key_layer_scaling or m.attention_softmax_in_fp32),
         "Megatron's fp16 softmax options (ring)", "turn them off or set parallel.context_impl=ulysses"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"parallel.context={c} with {what}: not supported with context parallelism yet; {fix}")


def check_micro_batches(p: ParallelConfig, micro_batches: int) -> None:
    """The schedule's rule on the micro-batches per step (gradient accumulation steps, known once DP is):
    interleaved needs a multiple of parallel.pipeline (Megatron-LM 2021), DualPipeV at least 2 x pipeline."""
    sched, pp = p.pipeline_schedule, p.pipeline
    if sched == "interleaved" and micro_batches % pp:
        raise ConfigError(f"parallel.pipeline_schedule=interleaved needs micro-batches per step (train."
                          f"global_batch_size / (micro_batch_size x DP) = {micro_batches}) to be a multiple of "
                          f"parallel.pipeline={pp}: change train.global_batch_size")
    if sched == "dualpipev" and micro_batches < 2 * pp:
        raise ConfigError(f"parallel.pipeline_schedule=dualpipev needs at least 2 x parallel.pipeline = {2 * pp} "
                          f"micro-batches per step (train.global_batch_size / (micro_batch_size x DP) = "
                          f"{micro_batches}): raise train.global_batch_size")
