"""Optimizer parameter groups and the learning-rate schedule.

AdamW (decoupled weight decay) with biases and LayerNorm/RMSNorm parameters exempt, as Megatron's
``get_params_for_weight_decay_optimization``; embeddings are decayed.

The learning-rate schedule is :mod:`training.optim.lr_schedule`'s.
"""
from __future__ import annotations

import torch
from torch import nn

from training.config import OptimizerConfig
from training.optim.lr_schedule import DeviceLRSchedule


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    from training.models.blocks import NORMS

    decay, no_decay = [], []
    for module in model.modules():
        is_norm = isinstance(module, NORMS)  # LayerNorm and RMSNorm
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if is_norm or name == "bias" else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, train_iters: int):
    """AdamW + schedule: torch's fused AdamW on every device and dtype (``training.runtime.gpu_settings`` says
    why: its ``found_inf`` lets the fp16/bf16 step decide a skip on the device), its rate a device tensor
    advanced by the step's own applied flag (:class:`~training.optim.lr_schedule.DeviceLRSchedule`)."""
    groups = param_groups(model, cfg.weight_decay)
    # fused=True: one multi-tensor kernel instead of a Python loop over parameters (CPU and CUDA)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    return opt, DeviceLRSchedule(opt, cfg, train_iters)
