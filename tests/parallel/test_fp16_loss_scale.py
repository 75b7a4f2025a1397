"""fp16 at ZeRO-0 under the installed DeepSpeed: the loss is scaled in backward and unscaled in step.

Against an fp32 engine on the same weights and batch: gradients after ``engine.backward`` are the fp32
gradients times the loss scale, and one optimizer step moves the (fp32 master) weights as far as the fp32
step. The engine is ``training.optim.engine.build_engine``'s with DeepSpeed's own optimizer step
(``own_step=False``): without ``Engine.backward``'s repair DeepSpeed 0.19 leaves the gradients unscaled (and
``step()`` divides them by the scale): the gradient check fails by a factor 4096.
"""
from __future__ import annotations

import math

from tests.helpers.distributed import run_distributed

POWER = 12  # loss scale 4096: no fp16 overflow for this tiny model's gradients


def _worker(rank, world):
    import torch

    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=128,
                            hidden_dropout=0.0, attention_dropout=0.0)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
    cfg.train.iters = 10
    cfg.optimizer.lr, cfg.optimizer.warmup_iters, cfg.optimizer.clip_grad = 1e-3, 0, 0.0
    cfg.precision.initial_scale_power = POWER
    ps = ParallelState(tp=1)
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1)
    seq = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    out = {}
    for dtype in ("fp32", "fp16"):
        model = GPTModel(cfg.model, 128, ps.tp_group, seed=1).train()
        opt, sched = build_optimizer(model, cfg.optimizer, cfg.train.iters)
        engine = build_engine(model, opt, sched, deepspeed_config(cfg, 1, dtype), ps, own_step=False)
        # the weights the optimizer updates: fp16 keeps fp32 master copies (an fp16 LayerNorm weight
        # of 1.0 cannot even hold a step of lr = 1e-3: its spacing there is 2^-10)
        masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
        assert all(p.dtype == torch.float32 for p in masters)
        before = [p.detach().clone() for p in masters]
        loss = engine(tokens, labels).float().mean()
        engine.backward(loss)
        grads = {n: p.grad.detach().float().clone() for n, p in engine.module.named_parameters()}
        scale = engine.optimizer.loss_scale_config.cur_scale if dtype == "fp16" else 1.0
        engine.step()
        delta = {i: p.detach() - b for i, (p, b) in enumerate(zip(masters, before))}
        out[dtype] = {"loss": loss.item(), "grads": grads, "delta": delta, "scale": scale,
                      "skipped": engine.skipped_steps}
    return out


def _norm(tensors: dict) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def test_fp16_zero0_scales_loss_and_steps_like_fp32():
    res = run_distributed(_worker, 1)[0]
    f32, f16 = res["fp32"], res["fp16"]
    assert f16["scale"] == 2.0**POWER and f16["skipped"] == 0
    assert abs(f16["loss"] - f32["loss"]) < 1e-2
    # gradients after engine.backward = fp32 gradients x loss scale (fp16 rounding aside)
    diff = {n: f16["grads"][n] / f16["scale"] - g for n, g in f32["grads"].items()}
    assert _norm(diff) / _norm(f32["grads"]) < 2e-2
    # The step moves the weights as far as fp32 does. (FP16_UnfusedOptimizer's zero-gradient Adam step at
    # construction, undone by build_engine, would make it Adam's 2nd step with a zero 1st gradient:
    # lr (1-b1)/(1-b1^2) / sqrt((1-b2)/(1-b2^2)) = 0.744 lr; tests/parallel/test_fp16_training.py checks the undo.)
    ratio = _norm(f16["delta"]) / _norm(f32["delta"])
    assert abs(ratio - 1) < 0.02, ratio
