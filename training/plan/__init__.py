"""Memory and speed planner for TP x PP x DP runs of our GPT-2 / BERT (``python -m training.plan``).

What it computes, per device, for one optimizer step (all formulas in docs/plan.md):

* parameters of every TP/PP shard, exactly as our models build them (pre-LN layers, 4h MLP with
  biases, learned positions, tied output embedding, padded vocabulary, final LayerNorm; BERT adds
  token types, pooler, LM-head dense+LN+bias and the binary head);
* memory: fp16/bf16 weights 2 B + grads 2 B + fp32 master/m/v 12 B per parameter (fp32 training:
  4 + 4 + 8), ZeRO-1 dividing the optimizer part by DP; activations per Korthikanti et al. 2022
  without recomputation, with selective recomputation (attention core) and with full checkpointing, with
  and without sequence parallelism;
* FLOPs per step (Narayanan et al. 2021 eq. 3), communication volume per step for TP, PP, DP;
* a predicted step time from an alpha-beta model (``TimeModel``; every constant documented there).

Notation: l layers, h hidden, a heads, s sequence, f MLP width (4h), V padded vocabulary, P positions,
b micro-batch, B global batch, t/p/d = TP/PP/DP degrees, m = B / (b d) micro-batches per step.

Modules (each one job; the public names below are re-exported here, each loaded on first use, so that
``import training.plan.accounting`` -- what the trainer's MFU metric needs -- loads no CLI, report or
time model):

* :mod:`~training.plan.accounting` parameters and FLOPs (shared with the MFU of ``training.metrics``);
* :mod:`~training.plan.layout` whether a model shape fits a layout (the layout itself is
  :class:`training.layout.Layout`, the trainer's);
* :mod:`~training.plan.memory` weights, gradients, optimizer states and activations per device;
* :mod:`~training.plan.timing` communication volume and the step-time model;
* :mod:`~training.plan.presets` and :mod:`~training.plan.paper` the paper's models and weak scaling;
* :mod:`~training.plan.report` the text tables; :mod:`~training.plan.cli` the command line.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# public name -> the submodule that defines it (loaded by __getattr__ on first use)
_EXPORTS = {
    "accounting": ("ModelShape", "attention_core_forward_flops", "bert_expected_masked_positions", "bert_flops_per_iteration", "bert_heads_forward_flops",
                   "embedding_params", "flops_per_iteration", "gpt_head_forward_flops", "head_params",
                   "layer_forward_flops", "layer_params", "model_flops_per_iteration", "recomputed_flops", "stage_params", "step_flops",
                   "total_params", "training_flops", "transformer_layer_forward_flops"),
    "cli": ("build_parser", "load_plan_config", "main"),
    "layout": ("Layout", "validate"),
    "memory": ("GIB", "ZERO_OPTIMIZER_BYTES_PER_PARAM", "Memory", "activation_bytes_per_layer",
               "activation_element_bytes", "memory", "stage_activation_bytes", "state_bytes_per_param"),
    "paper": ("PAPER_BASELINE_TFLOPS", "PAPER_WEAK_SCALING", "ScalingRow", "calibrate_compute_fraction",
              "default_compute_fraction", "paper_weak_scaling"),
    "presets": ("PRESETS", "preset_shape"),
    "report": ("render_paper_comparison", "render_plan"),
    "timing": ("Comm", "StepTime", "TimeModel", "comm", "ring_allreduce_wire", "step_time", "tp_allreduces_per_micro"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _PlanPackage(types.ModuleType):
    """``training.plan.memory`` is the function :func:`~training.plan.memory.memory`, as it was with eager
    re-exports: the import system sets a loaded submodule as an attribute of its package, and for an exported
    name that is also a submodule's name, this package keeps the exported object instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PlanPackage
