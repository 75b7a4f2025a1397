"""Optimizer parameter groups and the learning-rate schedule.

AdamW (decoupled weight decay) with biases and LayerNorm/RMSNorm parameters exempt, as Megatron's
``get_params_for_weight_decay_optimization``; embeddings are decayed.

LR: Megatron's ``AnnealingLR`` (HEAD ``OptimizerParamScheduler``) to the number. With n = the number of
updates already applied: warmup ``lr = max_lr * n / W`` while n <= W, then the fixed decay formula
(r = (n - W) / (D - W); cosine coefficient 0.5 (cos(pi r) + 1), linear 1 - r; lr = min_lr + coeff
(max_lr - min_lr); n > D -> min_lr). Megatron steps its scheduler *after* the optimizer (and builds
it with ``step(0)``), so with warmup the first update runs at lr 0 and the rate reaches max_lr at
update W + 1. This is a ``LambdaLR`` handed to DeepSpeed, which also steps it after the optimizer and
only on applied (non-overflow) steps, as Megatron does. DeepSpeed's own ``WarmupCosineLR`` does not
fit: it rejects a warmup of 0 steps and its decay is one step ahead of Megatron's formula.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from training.config import OptimizerConfig


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


def lr_at(it: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """Learning rate of the update taken after ``it`` applied updates (Megatron's ``num_steps``)."""
    warm = cfg.warmup_iters
    decay_end = cfg.decay_iters if cfg.decay_iters is not None else train_iters
    if warm > 0 and it <= warm:
        return cfg.lr * it / warm  # update 0 runs at lr 0, as in Megatron
    if cfg.decay_style == "constant":
        return cfg.lr
    if it > decay_end or decay_end <= warm:
        return cfg.min_lr
    r = (it - warm) / (decay_end - warm)
    coeff = 0.5 * (math.cos(math.pi * r) + 1.0) if cfg.decay_style == "cosine" else 1.0 - r
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, train_iters: int):
    """AdamW + schedule: torch's fused AdamW on every device and dtype (``training.runtime.gpu_settings`` says
    why: its ``found_inf`` lets the fp16/bf16 step decide a skip on the device)."""
    groups = param_groups(model, cfg.weight_decay)
    # fused=True: one multi-tensor kernel instead of a Python loop over parameters (CPU and CUDA)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_at(it, cfg, train_iters) / cfg.lr)
    return opt, sched
