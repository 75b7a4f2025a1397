"""Memory and speed planner for TP x PP x DP runs of our GPT-2 / BERT (``python -m training.plan``).

What it computes, per device, for one optimizer step (all formulas in docs/plan.md):

* parameters of every TP/PP shard, exactly as our models build them (pre-LN layers, 4h MLP with
  biases, learned positions, tied output embedding, padded vocabulary, final LayerNorm; BERT adds
  token types, pooler, LM-head dense+LN+bias and the binary head);
* memory: fp16/bf16 weights 2 B + grads 2 B + fp32 master/m/v 12 B per parameter (fp32 training:
  4 + 4 + 8), ZeRO-1 dividing the optimizer part by DP; activations per Korthikanti et al. 2022
  with and without full activation checkpointing and sequence parallelism;
* FLOPs per step (Narayanan et al. 2021 eq. 3), communication volume per step for TP, PP, DP;
* a predicted step time from an alpha-beta model (``TimeModel``; every constant documented there).

Notation: l layers, h hidden, a heads, s sequence, f MLP width (4h), V padded vocabulary, P positions,
b micro-batch, B global batch, t/p/d = TP/PP/DP degrees, m = B / (b d) micro-batches per step.

Modules (each one job; the public names below are re-exported here):

* :mod:`~training.plan.accounting` parameters and FLOPs (shared with the MFU of ``training.metrics``);
* :mod:`~training.plan.layout` the TP x PP x DP layout and its checks;
* :mod:`~training.plan.memory` weights, gradients, optimizer states and activations per device;
* :mod:`~training.plan.timing` communication volume and the step-time model;
* :mod:`~training.plan.presets` and :mod:`~training.plan.paper` the paper's models and weak scaling;
* :mod:`~training.plan.report` the text tables; :mod:`~training.plan.cli` the command line.
"""
from __future__ import annotations

from training.plan.accounting import (ModelShape, bert_expected_masked_positions, bert_flops_per_iteration,
                                      bert_heads_forward_flops, embedding_params, flops_per_iteration,
                                      gpt_head_forward_flops, head_params, layer_forward_flops, layer_params,
                                      model_flops_per_iteration, stage_params, step_flops, total_params,
                                      training_flops, transformer_layer_forward_flops)
from training.plan.cli import build_parser, load_plan_config, main
from training.plan.layout import Layout, validate
from training.plan.memory import (GIB, ZERO_OPTIMIZER_BYTES_PER_PARAM, Memory, activation_bytes_per_layer,
                                  activation_element_bytes, memory,
                                  stage_activation_bytes, state_bytes_per_param)
from training.plan.paper import (PAPER_BASELINE_TFLOPS, PAPER_WEAK_SCALING, ScalingRow, calibrate_compute_fraction,
                                 default_compute_fraction, paper_weak_scaling)
from training.plan.presets import PRESETS, preset_shape
from training.plan.report import render_paper_comparison, render_plan
from training.plan.timing import (Comm, StepTime, TimeModel, comm, ring_allreduce_wire, step_time,
                                  tp_allreduces_per_micro)

__all__ = [
    "GIB", "PAPER_BASELINE_TFLOPS", "PAPER_WEAK_SCALING", "PRESETS", "ZERO_OPTIMIZER_BYTES_PER_PARAM", "Comm",
    "Layout", "Memory", "ModelShape",
    "ScalingRow", "StepTime", "TimeModel", "activation_bytes_per_layer", "activation_element_bytes",
    "bert_expected_masked_positions",
    "bert_flops_per_iteration", "bert_heads_forward_flops", "build_parser", "calibrate_compute_fraction", "comm",
    "default_compute_fraction", "embedding_params", "flops_per_iteration", "gpt_head_forward_flops", "head_params",
    "layer_forward_flops", "layer_params", "load_plan_config", "main", "memory", "model_flops_per_iteration",
    "paper_weak_scaling", "preset_shape", "render_paper_comparison", "render_plan", "ring_allreduce_wire",
    "stage_activation_bytes", "stage_params", "state_bytes_per_param", "step_flops", "step_time", "total_params",
    "tp_allreduces_per_micro", "training_flops", "transformer_layer_forward_flops", "validate",
]
