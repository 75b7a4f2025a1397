"""The device learning-rate schedule (training/optim/lr_schedule.py) against the host formula and a host loop."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from training.config import OptimizerConfig
from training.optim.lr_schedule import DeviceLRSchedule, lr_at

CFGS = [
    OptimizerConfig(lr=1.5e-4, min_lr=1e-5, warmup_iters=4, decay_iters=20, decay_style="cosine"),
    OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_iters=None, decay_style="linear"),
    OptimizerConfig(lr=2e-3, min_lr=0.0, warmup_iters=0, decay_iters=None, decay_style="constant"),
]


def _fused_adamw(n: int = 64, lr=1e-3):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(n))
    return p, torch.optim.AdamW([{"params": [p], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}], lr=lr,
                                fused=True)


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c.decay_style}-w{c.warmup_iters}")
def test_applied_flags_advance_the_rate_and_skips_hold_it(cfg):
    """Steps with device flags 1, 0, 1, 1, 0, ...: the rate after k applied updates is ``lr_at(k)`` bitwise, in
    every group, and stays there past the end of the decay."""
    iters = 24
    _, opt = _fused_adamw()
    sched = DeviceLRSchedule(opt, cfg, iters)
    flags = [1, 0, 1, 1, 0, 0, 1] + [1] * 30
    applied = 0
    for f in flags:
        assert [float(g["lr"]) for g in opt.param_groups] == [lr_at(applied, cfg, iters)] * 2
        sched.step(applied=torch.tensor(float(f)))
        applied += f
    assert applied > iters and float(sched.rate()) == lr_at(applied, cfg, iters)
    sched.step()  # a step the host knows was applied
    assert float(sched.rate()) == lr_at(applied + 1, cfg, iters)


def test_updates_are_bitwise_those_of_python_float_rates():
    """torch's fused AdamW reading the device rate makes the same updates as with the rate as a Python float
    (float64 on the CPU: the CPU kernel computes its step size in double)."""
    cfg = CFGS[0]
    p1, o1 = _fused_adamw(4096)
    p2, o2 = _fused_adamw(4096)
    sched = DeviceLRSchedule(o2, cfg, 24)
    torch.manual_seed(1)
    for k in range(12):
        g = torch.randn(4096)
        p1.grad, p2.grad = g.clone(), g.clone()
        for group in o1.param_groups:
            group["lr"] = lr_at(k, cfg, 24)
        o1.step()
        o2.step()
        sched.step()
        assert torch.equal(p1, p2), k


def test_state_round_trip_and_a_lambda_lr_checkpoint():
    """The count survives ``state_dict``/``load_state_dict``, a ``LambdaLR`` state (its ``last_epoch``) loads as
    the same count, the rate is re-installed in groups an optimizer load replaced, and a state without a count
    is refused in one line."""
    cfg, iters = CFGS[1], 30
    _, opt = _fused_adamw()
    sched = DeviceLRSchedule(opt, cfg, iters)
    for _ in range(7):
        sched.step()
    state, opt_state = sched.state_dict(), opt.state_dict()
    assert state == {"last_epoch": 7}

    _, opt2 = _fused_adamw()
    fresh = DeviceLRSchedule(opt2, cfg, iters)
    opt2.load_state_dict(opt_state)  # puts the saved rate tensor in its groups
    fresh.load_state_dict(state)
    assert all(g["lr"] is fresh.lr for g in opt2.param_groups)
    assert float(fresh.rate()) == lr_at(7, cfg, iters)

    _, host_opt = _fused_adamw()
    lam = torch.optim.lr_scheduler.LambdaLR(host_opt, lambda it: lr_at(it, cfg, iters) / cfg.lr)
    for _ in range(5):
        host_opt.step()
        lam.step()
    fresh.load_state_dict(lam.state_dict())
    assert float(fresh.rate()) == pytest.approx(lam.get_last_lr()[0], rel=1e-15)

    with pytest.raises(ValueError, match="count of applied updates"):
        fresh.load_state_dict({"base_lrs": [1e-3]})


def test_the_rate_follows_the_optimizers_parameters():
    """ZeRO-Offload hands the optimizer host partitions after the schedule was built: :meth:`install` moves the
    table, the count and the rate to the parameters' device (here the same device: nothing is moved, the groups
    point at the same rate) and keeps the count."""
    cfg = CFGS[0]
    _, opt = _fused_adamw()
    sched = DeviceLRSchedule(opt, cfg, 24)
    for _ in range(3):
        sched.step()
    rate = sched.lr
    sched.install()
    assert sched.lr is rate and all(g["lr"] is rate for g in opt.param_groups)
    moved = nn.Parameter(torch.randn(8, dtype=torch.float64))
    opt.param_groups[0]["params"] = [moved]  # what an offloading ZeRO optimizer does to the groups
    sched.install()
    assert float(sched.rate()) == lr_at(3, cfg, 24) and sched.table.dtype == torch.float64
