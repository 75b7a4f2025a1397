"""The static gradient buffer and the overlapped data-parallel reduction (training/optim/grad_buffer.py, issue 40
item 3): gradient addresses fixed across steps (fp32, fp16, bf16); two gloo ranks with gradient accumulation,
bitwise the same losses and weights as DeepSpeed's own reduction; buckets launched while backward still runs; the
fused fp16 wrapper's step keeping the buffer's views; the bucket rule.

One two-rank run (a module fixture) serves the first three tests: a tiny GPT-2, 2 micro-batches per step, 5 steps,
each rank its own batches, every dtype with the buffer (buckets of 2,000 elements: several per dtype) and without.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

STEPS, GAS, MICRO, BUCKET = 5, 2, 2, 2000


def _engine(dtype: str, dp: int, buffer: bool, ps):
    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random

    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=128,
                            hidden_dropout=0.0, attention_dropout=0.0)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = MICRO, MICRO * GAS * dp
    cfg.train.iters = STEPS
    cfg.optimizer.lr, cfg.optimizer.warmup_iters, cfg.optimizer.clip_grad = 1e-2, 0, 1.0
    cfg.precision.initial_scale_power = 12
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1)
    model = GPTModel(cfg.model, 128, ps.tp_group, seed=1).train()
    opt, sched = build_optimizer(model, cfg.optimizer, cfg.train.iters)
    return build_engine(model, opt, sched, deepspeed_config(cfg, dp, dtype), ps, grad_buffer=buffer,
                        bucket_size=BUCKET)


def _batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own data
    seq = torch.randint(0, 128, (STEPS * GAS, MICRO, 17), generator=g)
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seq]


def _train(engine, batches, log=None):
    """STEPS optimizer steps of GAS micro-batches; the losses, and the gradients' addresses after each step's last
    backward."""
    losses, ptrs = [], []
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for k, (tokens, labels) in enumerate(batches):
        if log is not None:
            log.append(("micro-batch", k))
        loss = engine(tokens, labels).float().mean()
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            ptrs.append([p.grad.data_ptr() for p in params])
        engine.step()
        losses.append(loss.item())
    return losses, ptrs


def _worker(rank, world):
    import torch.distributed as dist

    from benchmarks.host_work import HostWork
    from training.optim.mixed_precision import MixedPrecisionStep
    from training.parallel.state import ParallelState
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    ps = ParallelState(tp=1)
    out = {}
    for dtype in ("fp32", "fp16", "bf16"):
        for buffer in (True, False):
            engine = _engine(dtype, world, buffer, ps)
            buf = engine.grad_buffer
            assert (buf is not None) == buffer
            log = []
            if buffer:  # the order of gradients ready and all-reduces launched, on the last micro-batch
                for name, p in engine.module.named_parameters():
                    p.register_post_accumulate_grad_hook(lambda p, name=name: log.append(("grad", name)))
            inner = dist.all_reduce

            def logged(*a, _inner=inner, **k):
                log.append(("all_reduce", (a[0] if a else k["tensor"]).numel()))
                return _inner(*a, **k)

            dist.all_reduce = logged
            try:
                losses, ptrs = _train(engine, _batches(rank), log)
            finally:
                dist.all_reduce = inner
            with HostWork() as w:  # one more step, counted
                for tokens, labels in _batches(rank)[:GAS]:
                    engine.backward(engine(tokens, labels).float().mean())
                    engine.step()
            step = engine.owned_step
            out[(dtype, buffer)] = {
                "losses": losses, "ptrs": ptrs,
                "weights": [p.detach().clone() for p in engine.module.parameters()],
                "buffer_ptrs": {str(dt): (b.data_ptr(), b.numel() * b.element_size())
                                for dt, b in (buf.buffers.items() if buf else ())},
                "buckets": len(buf.buckets) if buf else 0,
                "log": log if buffer else [e for e in log if e[0] == "all_reduce"],
                "one_cast": (isinstance(step, MixedPrecisionStep)
                             and len(step.layout.spans) == len(step.wrapper.fp16_groups)),
                "kernels": w.kernels, "top": w.top(8),
            }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_gradient_addresses_are_fixed(runs, dtype):
    """Every step's gradients sit at the same addresses, inside the buffer, on every rank."""
    for r in runs:
        run = r[(dtype, True)]
        assert len(run["ptrs"]) == STEPS and all(p == run["ptrs"][0] for p in run["ptrs"])
        spans = list(run["buffer_ptrs"].values())
        assert all(any(lo <= ptr < lo + n for lo, n in spans) for ptr in run["ptrs"][0])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_overlapped_reduction_is_bitwise_deepspeeds(runs, dtype):
    """Two data-parallel ranks, 2 micro-batches per step, 5 steps: the same losses and weights, to the bit, as the
    same run reduced by DeepSpeed (one flat all-reduce per dtype after backward); the ranks agree. fp16/bf16: the
    step read each group's gradients as one cast of the buffer's slice."""
    for r in runs:
        ours, theirs = r[(dtype, True)], r[(dtype, False)]
        assert ours["losses"] == theirs["losses"]
        assert all(torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"]))
        assert ours["one_cast"] == (dtype != "fp32")
    assert all(torch.equal(a, b) for a, b in zip(runs[0][(dtype, True)]["weights"], runs[1][(dtype, True)]["weights"]))
    assert runs[0][(dtype, True)]["losses"] != runs[1][(dtype, True)]["losses"]  # the ranks saw different data


def test_buckets_are_launched_during_backward(runs):
    """On each step's last micro-batch every bucket is all-reduced once, the first of them while gradients are
    still being accumulated; the other micro-batch reduces nothing. DeepSpeed: one all-reduce per step, after
    backward."""
    for dtype in ("fp32", "fp16", "bf16"):
        run = runs[0][(dtype, True)]
        assert run["buckets"] >= 3
        micro = [[]]
        for e in run["log"]:
            if e[0] == "micro-batch":
                micro.append([])
            else:
                micro[-1].append(e)
        micro = micro[1:]
        assert len(micro) == STEPS * GAS
        for k, events in enumerate(micro):
            reduces = [i for i, e in enumerate(events) if e[0] == "all_reduce"]
            grads = [i for i, e in enumerate(events) if e[0] == "grad"]
            if k % GAS != GAS - 1:
                assert not reduces
                continue
            assert len(reduces) == run["buckets"] and reduces[0] < grads[-1], events
        assert sum(e[0] == "all_reduce" for e in runs[0][(dtype, False)]["log"]) == STEPS


def test_kernels_per_step(runs, capsys):
    """Printed, not asserted: the kernels of one two-rank step with the buffer and with DeepSpeed's reduction."""
    with capsys.disabled():
        for dtype in ("fp32", "fp16", "bf16"):
            print(f"\nDP=2 {dtype}: kernels per step (2 micro-batches) buffer {runs[0][(dtype, True)]['kernels']}, "
                  f"DeepSpeed {runs[0][(dtype, False)]['kernels']}")


# --------------------------------------------------------------------------------------------------
def _fused_worker(rank, world):
    """FP16_Optimizer (the fused wrapper, built directly: FusedAdam needs CUDA) with the gradients in a buffer:
    the step reads them as one cast per group, keeps the views, and updates the weights as without a buffer."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from training.optim.engine import undo_initial_zero_step
    from training.optim.grad_buffer import GradBuffer
    from training.optim.mixed_precision import MixedPrecisionStep
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    out = []
    for buffered in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).half()
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() == 1],
                                                                      "weight_decay": 0.0}]
        opt = FP16_Optimizer(torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1), dynamic_loss_scale=True,
                             clip_grad=1.0, verbose=False)
        undo_initial_zero_step(opt)
        step = MixedPrecisionStep.create(opt)
        buf = GradBuffer(params, opt.fp16_groups, None) if buffered else None
        if buf is not None:
            step.layout.use_buffer(opt.fp16_groups, buf.span_of)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            if buf is not None:
                buf.begin(reduce=False)
            x = torch.randn(4, 8, generator=g).half()
            (model(x).float().square().mean() * opt.loss_scale_config.cur_scale).backward()
            step.step()
            if buf is not None:
                assert all(p.grad is v for p, v in zip(buf.params, buf.views))
                buf.zero()
            else:
                opt.zero_grad()
        out.append(([p.detach().clone() for p in params], buf is not None and len(step.layout.spans) == 2))
    return out


def test_fused_fp16_wrapper_keeps_the_buffer():
    (ours, one_cast), (theirs, _) = run_distributed(_fused_worker, 1)[0]
    assert one_cast
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# --------------------------------------------------------------------------------------------------
def test_bucket_assignment():
    """Each (dtype, group) run cut from its end once a bucket reaches the size, a larger parameter alone, no bucket
    across runs; launch order: the lowest registration index in the bucket, highest first."""
    from training.optim.grad_buffer import assign_buckets

    runs = [[(0, 10), (2, 5), (4, 10), (6, 5)],  # e.g. the decayed weights, registration indices 0, 2, 4, 6
            [(1, 2), (3, 2), (5, 2), (7, 2)],  # the biases and norms
            [(8, 40)]]
    assert assign_buckets(runs, 12) == [[8], [4, 6], [1, 3, 5, 7], [0, 2]]
    assert assign_buckets(runs, 4) == [[8], [6], [5, 7], [4], [2], [1, 3], [0]]
    assert assign_buckets(runs, 1000) == [[8], [1, 3, 5, 7], [0, 2, 4, 6]]


def test_buffer_layout_and_spans():
    """Memory order: per dtype, the groups one after another, each in its order; parameters in no group after
    them; a group's gradients are one slice, a mixed selection is not."""
    from training.optim.grad_buffer import GradBuffer

    a, b, c, d = (torch.nn.Parameter(torch.randn(n)) for n in (3, 4, 5, 6))
    e = torch.nn.Parameter(torch.randn(2).half())
    frozen = torch.nn.Parameter(torch.randn(7), requires_grad=False)
    buf = GradBuffer([a, b, c, frozen, d, e], [[c, a], [e, d]], None)
    assert buf.offsets == [5, 14, 0, 8, 0] and buf.buffers[torch.float32].numel() == 18
    assert frozen.grad is None and all(p.grad is v for p, v in zip(buf.params, buf.views))
    span = buf.span_of([c, a])
    assert span is not None and span.data_ptr() == c.grad.data_ptr() and span.numel() == 8
    assert buf.span_of([a, c]) is None and buf.span_of([d, e]) is None
    a.grad = None
    c.grad = torch.ones(5)
    buf.begin(reduce=False)  # re-pointed: None is zero, a replaced gradient is copied in
    assert a.grad is buf.views[0] and not a.grad.any() and torch.equal(c.grad, torch.ones(5))
