"""The ``fused_adam_step1`` check's measurement (``--first-update``): DeepSpeed's FusedAdam under the trainer's
fp16 wrapper against Megatron's step-1 update.
"""
from __future__ import annotations

FIRST_UPDATE_TOL = 1e-5  # fp32 masters, |update| ~ lr = 1e-2: Adam's sqrt and division round at ~1e-7 relative


def first_update(device: str = "cuda", adam: str = "fused") -> dict:
    """The first update of the trainer's fp16 optimizer against Megatron's step 1, with and without
    ``training.optim.engine.undo_initial_zero_step``: DeepSpeed's ``FP16_Optimizer`` (the wrapper it gives FusedAdam) around
    ``adam`` ('fused': DeepSpeed's FusedAdam, CUDA; 'torch': torch's AdamW, for a CPU test of this function), the
    O(1) step installed, lr 1e-2, weight decay 0.1, one step of random gradients (scaled by the loss scale, as
    backward leaves them). Megatron's step 1: bias corrections 1 - beta^1 give m = g, v = g^2, so the update is
    ``p (1 - lr wd) - lr g / (|g| + eps)``. FusedAdam seeds each new state's step from its group's ``step``:
    the undo must set it to 0, or the first real step is Adam's step 2 (the bug of issue 27)."""
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from training.optim.engine import undo_initial_zero_step
    from training.optim.mixed_precision import MixedPrecisionStep

    lr, wd, eps = 1e-2, 0.1, 1e-8
    res: dict = {"optimizer": "DeepSpeed FusedAdam" if adam == "fused" else "torch AdamW", "device": device}
    for undo in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128),
                                    torch.nn.Linear(128, 32)).to(device).half()
        if adam == "fused":
            from deepspeed.ops.adam import FusedAdam

            from training.runtime.gpu_settings import deepspeed_buildable_arch_list

            with deepspeed_buildable_arch_list():
                inner = FusedAdam(model.parameters(), lr=lr, weight_decay=wd, eps=eps, adam_w_mode=True)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, eps=eps)
        opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False, clip_grad=0.0,
                             dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 1000, "delayed_shift": 1,
                                                "consecutive_hysteresis": False, "min_scale": 1})
        if undo:
            undo_initial_zero_step(opt)
        step = MixedPrecisionStep.create(opt)
        before = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        gen = torch.Generator().manual_seed(3)
        grads = [torch.randn(p.shape, generator=gen).half().to(device) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g * opt.loss_scale_config.cur_scale
        outcome = step.step()
        g = torch.cat([x.float().reshape(-1) for x in grads])
        expected = before * (1 - lr * wd) - lr * g / (g.abs() + eps)
        after = opt.fp32_groups_flat[0].detach().float()
        state = next(iter(inner.state.values()), {})
        step = state.get("step", inner.param_groups[0].get("step"))
        res["undo" if undo else "no_undo"] = {"max_abs_diff": (after - expected).abs().max().item(),
                                              "adam_step": int(step) if step is not None else None,
                                              "o1_step": step is not None, "overflow": not outcome.applied}
        res["params"] = before.numel()
    return res
