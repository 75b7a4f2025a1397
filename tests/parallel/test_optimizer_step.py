"""The GPU step's host work, proved on CPU (issue 27): the O(1) fp16/bf16 optimizer step
(training.optim.mixed_precision) against DeepSpeed's own step, FusedAdam's wrapper starting Adam at step 0,
the fp32 clip on the device, and no host syncs in the trainer's step outside the one that decides an fp16 skip.

Counts are made with benchmarks.host_work (a TorchDispatchMode): on CUDA every kernel operator is a launch and
every read a stall, so a count on CPU is the count on a GPU.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides


# --------------------------------------------------------------------------------------------------
# DeepSpeed's two ZeRO-0 wrappers built directly (no engine), ours vs theirs on the same gradients
def _wrapper(kind: str, seed: int = 0, clip: float = 1.0, window: int = 2):
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).half()
    # "device": torch's fused AdamW, whose found_inf lets the step decide on the device (no host read)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=kind == "device")
    args = {"init_scale": 2.0**8, "scale_window": window, "delayed_shift": 1, "consecutive_hysteresis": False,
            "min_scale": 1}
    cls = FP16_Optimizer if kind == "fused" else FP16_UnfusedOptimizer
    opt = cls(inner, dynamic_loss_scale=True, dynamic_loss_args=args, clip_grad=clip, verbose=False)
    return model, opt


def _masters(kind, opt) -> list[torch.Tensor]:
    return [m.detach().clone() for m in (opt.fp32_groups_flat if kind == "fused" else
                                         [m for g in opt.fp32_groups for m in g])]


def _ab_worker(rank, world, kind):
    from training.optim.engine import undo_initial_zero_step
    from training.optim.mixed_precision import MixedPrecisionStep
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    (ma, oa), (mb, ob) = _wrapper(kind), _wrapper(kind)
    for o in (oa, ob):
        undo_initial_zero_step(o)
    ours = MixedPrecisionStep.create(oa)
    assert ours is not None and ours.flat_masters == (kind == "fused") and ours.reads_on_host == (kind != "device")
    g = torch.Generator().manual_seed(1)
    rows = []
    for it in range(8):
        grads = [torch.randn(p.shape, generator=g) * (200.0 if it == 3 else 1.0) for p in ma.parameters()]
        true_norm = float(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads]).half().float()))
        row = {}
        for name, model, opt in (("ours", ma, oa), ("ds", mb, ob)):
            scale = opt.loss_scale_config.cur_scale
            for p, x in zip(model.parameters(), grads):
                p.grad = (x * scale).half()
                if it == 5 and p.dim() == 1:
                    p.grad[0] = float("inf")  # an overflow in a LayerNorm/bias gradient
            if name == "ours":
                outcome = ours.step()
                opt.zero_grad()  # as the engine does after a step
                overflow = not bool(outcome.applied)
                norm = None if overflow else float(outcome.grad_norm)
                if kind == "device":
                    ours.sync_host_state()  # the device loss scale into DeepSpeed's state, compared below
            else:
                opt.step()
                overflow, norm = bool(opt.overflow), float(opt._global_grad_norm)
            row[name] = {"overflow": overflow, "scale": opt.loss_scale_config.cur_scale,
                         "norm": norm, "weights": [p.detach().clone() for p in model.parameters()],
                         "masters": _masters(kind, opt)}
        row["true_norm"] = true_norm
        rows.append(row)
    return rows


def _each(rank, world, worker, variants):
    """One-rank worker: ``worker(rank, world, v)`` for each ``v`` of ``variants``, one after the other."""
    return {v: worker(rank, world, v) for v in variants}


KINDS = ("fused", "unfused", "device")


@pytest.fixture(scope="module")
def ab_rows():
    """{kind: ``_ab_worker``'s rows}: every kind in one launch."""
    return run_distributed(_each, 1, _ab_worker, KINDS, timeout=300 * len(KINDS))[0]


@pytest.mark.parametrize("kind", KINDS)
def test_o1_step_equals_deepspeeds_step(ab_rows, kind):
    """Eight steps of DeepSpeed's FP16_Optimizer (flat masters; the class it uses for FusedAdam, here around
    torch's AdamW, which it does not care about) and FP16_UnfusedOptimizer, ours vs DeepSpeed's step on the same
    scaled gradients: the same overflows (fp16 overflow of the scaled gradients at step 3, an inf at step 5),
    the same loss-scale sequence, bitwise the same fp16 weights (fp32 masters to 1e-6); the reported norm is the unscaled gradients' norm,
    also on step 2, where the scale grows (DeepSpeed divides by the grown scale there and reports half)."""
    rows = ab_rows[kind]
    assert [r["ours"]["overflow"] for r in rows] == [r["ds"]["overflow"] for r in rows] == \
        [False, False, False, True, False, True, False, False]
    assert [r["ours"]["scale"] for r in rows] == [r["ds"]["scale"] for r in rows] == \
        [256, 256, 512, 256, 256, 128, 128, 128]
    for r in rows:
        for a, b in zip(r["ours"]["weights"], r["ds"]["weights"]):
            assert torch.equal(a, b)
        # fp32 masters: the clip factor comes from a norm summed in another order (last-bit differences)
        for a, b in zip(r["ours"]["masters"], r["ds"]["masters"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if not r["ours"]["overflow"]:
            assert r["ours"]["norm"] == pytest.approx(r["true_norm"], rel=1e-5)
        else:
            assert r["ours"]["norm"] is None


def _first_update_worker(rank, world, undo):
    from training.optim.engine import undo_initial_zero_step
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    model, opt = _wrapper("fused", clip=0.0)
    if undo:
        assert undo_initial_zero_step(opt)
    before = [p.detach().float().clone() for p in model.parameters()]
    masters_before = opt.fp32_groups_flat[0].detach().clone()
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=g).half() for p in model.parameters()]
    scale = opt.loss_scale_config.cur_scale
    for p, x in zip(model.parameters(), grads):
        p.grad = x * scale
    opt.step()
    return before, masters_before, [x.float() for x in grads], opt.fp32_groups_flat[0].detach().clone()


@pytest.fixture(scope="module")
def first_updates():
    """{undo: ``_first_update_worker``'s tensors}: both in one launch."""
    return run_distributed(_each, 1, _first_update_worker, (True, False), timeout=600)[0]


@pytest.mark.parametrize("undo", [True, False])
def test_fused_wrapper_first_update_is_megatrons(first_updates, undo):
    """FusedAdam's wrapper (FP16_Optimizer) steps its optimizer once with zero gradients at construction, so
    Adam's first real update was bias-corrected as step 2 (0.744 lr) and one weight decay had already been
    applied. After training.optim.engine.undo_initial_zero_step the masters equal the fp16 weights and the first update is
    Megatron's: p (1 - lr wd) - lr g / (|g| + eps)."""
    before, masters_before, grads, after = first_updates[undo]
    flat_before = torch.cat([b.reshape(-1) for b in before])
    g = torch.cat([x.reshape(-1) for x in grads])
    lr, wd, eps = 1e-2, 0.1, 1e-8
    expected = flat_before * (1 - lr * wd) - lr * g / (g.abs() + eps)
    if undo:
        assert torch.equal(masters_before, flat_before)
        torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-6)
    else:  # what DeepSpeed alone does: the first update is not Megatron's
        assert not torch.allclose(after, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# the trainer's own step: operators and host syncs at 2 and 8 layers, ours and DeepSpeed's
def _trainer(spec, run_dir, layers: int, dtype: str, **extra):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "model.num_layers": layers, "precision.dtype": dtype,
                                      "precision.allow_fp16_on_cpu": "true", "train.global_batch_size": 2,
                                      "precision.initial_scale_power": 8, **extra})
    return Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))


def _counts_worker(rank, world, spec, tmp, dtype):
    """Operators and host reads of the trainer's step (and of its optimizer step alone) at 2 and 8 layers, with
    the O(1) step and with DeepSpeed's, on a step that does not read its metrics and on one that does."""
    from benchmarks.host_work import HostWork
    from training.optim.mixed_precision import MixedPrecisionStep

    out = {}
    for layers in (2, 8):
        for mode in ("o1", "deepspeed"):
            t = _trainer(spec, f"{tmp}/{dtype}-{mode}-{layers}", layers, dtype)
            if mode == "deepspeed":
                t.engine.owned_step = None  # DeepSpeed's own step (its wrapper's step)
            for _ in range(3):  # past construction-time effects
                t.train_step()
            opt_counts = []
            stepper = t.engine.owned_step if t.engine.owned_step is not None else t.engine.optimizer
            inner = stepper.step

            def counted_step(*a, _inner=inner, **k):
                with HostWork() as w:
                    r = _inner(*a, **k)
                opt_counts.append((w.kernels, w.syncs))
                return r

            stepper.step = counted_step
            with HostWork() as lazy:
                m = t.train_step(read=False)
            with HostWork() as read:
                t.train_step(read=True)
            out[(layers, mode)] = {"step_kernels": lazy.kernels, "step_syncs": lazy.syncs, "read_syncs": read.syncs,
                                   "opt": opt_counts[0] if opt_counts else None,
                                   "o1": isinstance(t.engine.owned_step, MixedPrecisionStep),
                                   "loss_on_device": isinstance(m["loss"], torch.Tensor)}
    return out


DTYPES = ("fp16", "bf16", "fp32")


def _each_dtype(rank, world, worker, spec, tmp, dtypes):
    """One-rank worker: ``worker(rank, world, spec, tmp, dtype)`` for each of ``dtypes``, one after the other."""
    return {dtype: worker(rank, world, spec, tmp, dtype) for dtype in dtypes}


@pytest.fixture(scope="module")
def counts(spm_model, tmp_path_factory):
    """{dtype: ``_counts_worker``'s counts}: every dtype in one launch."""
    return run_distributed(_each_dtype, 1, _counts_worker, spm_model, str(tmp_path_factory.mktemp("counts")), DTYPES,
                           timeout=300 * len(DTYPES))[0]


@needs_corpus
@pytest.mark.parametrize("dtype", DTYPES)
def test_step_host_work_is_constant_in_layers(counts, dtype):
    """fp16/bf16: the optimizer step costs the same kernels at 2 and 8 layers (DeepSpeed's: a chain of kernels
    and a read per tensor). Host reads per step: 0 in every dtype on a step whose metrics are not read (fp16 and
    bf16: the skip, the clip and fp16's loss scale decided on the device), exactly 1 on a step that reads them."""
    c = counts[dtype]
    ours2, ours8, ds2, ds8 = c[(2, "o1")], c[(8, "o1")], c[(2, "deepspeed")], c[(8, "deepspeed")]
    assert ours2["loss_on_device"] and ours8["loss_on_device"]
    lazy_reads = 0  # fp16 too: the skip and the loss scale decided on the device (issue 40)
    assert ours2["step_syncs"] == ours8["step_syncs"] == lazy_reads
    assert ours2["read_syncs"] == ours8["read_syncs"] == 1
    if dtype == "fp32":
        assert not ours2["o1"]  # fp32: no wrapper, the engine steps torch's fused AdamW itself
        return
    assert ours2["o1"] and not ds2["o1"]
    assert ours2["opt"] == ours8["opt"] and ours2["opt"][1] == lazy_reads  # O(1) kernels
    # DeepSpeed's own step: per tensor (12 more per layer) at least one read and several kernels
    assert ds8["opt"][1] - ds2["opt"][1] >= 6 * 12
    assert ds8["opt"][0] - ds2["opt"][0] >= 6 * 12 * 10
    # the whole step's kernels per layer: forward + backward only with ours
    per_layer_ours = (ours8["step_kernels"] - ours2["step_kernels"]) / 6
    per_layer_ds = (ds8["step_kernels"] - ds2["step_kernels"]) / 6
    assert per_layer_ds - per_layer_ours >= 12 * 10


def _loop_worker(rank, world, spec, tmp, dtype):
    from benchmarks.host_work import HostWork

    extra = {"train.iters": 7, "train.log_interval": 3, "train.eval_interval": 0, "train.save_interval": 0,
             "optimizer.warmup_iters": 0, "parallel.pipeline": world}
    t = _trainer(spec, f"{tmp}/{dtype}-loop", 2, dtype, **extra)
    reads = []
    inner = t.train_step

    def counted(read=True):
        with HostWork() as w:
            m = inner(read=read)
        reads.append((read, w.syncs))
        return m

    t.train_step = counted
    t.train()
    lines = (Path(tmp) / f"{dtype}-loop" / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "event" not in r]
    ref = _trainer(spec, f"{tmp}/{dtype}-ref", 2, dtype, **extra)  # the same run, read every step
    every = [ref.train_step(read=True) for _ in range(7)]
    return (reads, [(r["iteration"], r["loss"], r["grad_norm"]) for r in rows],
            [(m["iteration"], m["loss"], m["grad_norm"]) for m in every], [r.get("pipeline_bubble_stages") for r in rows])


@pytest.fixture(scope="module")
def loops(spm_model, tmp_path_factory):
    """{dtype: ``_loop_worker``'s reads and losses}: every dtype in one launch."""
    return run_distributed(_each_dtype, 1, _loop_worker, spm_model, str(tmp_path_factory.mktemp("loops")), DTYPES,
                           timeout=300 * len(DTYPES))[0]


@needs_corpus
@pytest.mark.parametrize("dtype, pp", [("fp16", 1), ("bf16", 1), ("fp32", 1), ("fp16", 2)])
def test_train_reads_the_host_on_log_steps_only(loops, spm_model, tmp_path, dtype, pp):
    """Trainer.train() with log_interval=3 over 7 steps: steps 3, 6 (log) and 7 (the last) read their metrics in
    one host read; the others read nothing. The logged loss and gradient norm are
    exactly those of the same run read on every step. PP=2 (fp16, the pipeline engine's train_batch): the same one
    read, every stage's pipeline bubble gathered on the device and read with the metrics (it was a second read).
    The PP=1 cases share one launch (``loops``)."""
    reads, logged, every, bubbles = (loops[dtype] if pp == 1 else
                                     run_distributed(_loop_worker, pp, spm_model, str(tmp_path), dtype)[0])
    lazy = 0
    assert reads == [(False, lazy), (False, lazy), (True, 1), (False, lazy), (False, lazy), (True, 1), (True, 1)]
    assert logged == [every[i] for i in (2, 5, 6)]
    assert all(math.isfinite(loss) for _, loss, _ in logged)
    if pp > 1:  # the bubble still logged, each stage's
        assert all(len(b) == pp and all(0.0 < f < 1.0 for f in b) for b in bubbles), bubbles
    else:
        assert bubbles == [None] * 3


def _trajectory_worker(rank, world, spec, tmp, dtype, overflow_at, steps, extra):
    from deepspeed.runtime.fp16.loss_scaler import DELAYED_SHIFT

    out = {}
    for mode in ("o1", "deepspeed"):
        t = _trainer(spec, f"{tmp}/{dtype}-{mode}", 2, dtype, **{"optimizer.warmup_iters": 0,
                                                                  "precision.max_consecutive_skipped": 0,
                                                                  "train.iters": steps, **extra})
        if mode == "deepspeed":
            t.engine.owned_step = None  # DeepSpeed's own step
        param = t.model.layers[0].mlp.fc.weight
        state = {"on": False}
        param.register_hook(lambda g: g * float("inf") if state["on"] else g)
        rows = []
        for it in range(steps):
            state["on"] = it in overflow_at
            m = t.train_step()
            rows.append((m["loss"], m["step_applied"], m["loss_scale"], m["grad_norm"]))
        out[mode] = rows
        out["delayed_shift"] = (t.engine.dynamic_loss_scale_args() or {}).get(DELAYED_SHIFT)
    return out


def _zero0_scales(scale: float, window: int, overflow_at: list[int], steps: int) -> list[float]:
    """The scale after each step under DeepSpeed's ZeRO-0 rule (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``
    ``_update_scale``), written out here: every overflow halves the scale, ``window`` clean steps counted from
    the last overflow double it. No hysteresis: those wrappers never read ``delayed_shift`` (DeepSpeed #697)."""
    out, last = [], -1
    for it in range(steps):
        if it in overflow_at:
            scale, last = scale / 2, it
        elif (it - last - 1) > 0 and (it - last - 1) % window == 0:
            scale *= 2
        out.append(scale)
    return out


STEPS = 50
TRAJECTORIES = {  # dtype, steps whose gradients are made inf, extra overrides
    "fp16": ("fp16", [3, 4], {}),
    # hysteresis 2 (DeepSpeed's fp16.hysteresis, passed on as delayed_shift), overflows at consecutive (3, 4)
    # and non-consecutive (11, 19, 30) steps, a window of 4 so the scale grows (and would refill the hysteresis)
    "fp16-hysteresis": ("fp16", [3, 4, 11, 19, 30], {"precision.hysteresis": 2, "precision.loss_scale_window": 4}),
    "bf16": ("bf16", [5, 30], {}),
}


def _each_trajectory(rank, world, spec, tmp):
    """One-rank worker: ``_trajectory_worker`` for each case of TRAJECTORIES (in its own folder), one after the other."""
    out = {}
    for case, (dtype, overflow_at, extra) in TRAJECTORIES.items():
        (Path(tmp) / case).mkdir()
        out[case] = _trajectory_worker(rank, world, spec, f"{tmp}/{case}", dtype, overflow_at, STEPS, extra)
    return out


@pytest.fixture(scope="module")
def trajectories(spm_model, tmp_path_factory):
    """{case: ``_trajectory_worker``'s rows}: every case in one launch."""
    return run_distributed(_each_trajectory, 1, spm_model, str(tmp_path_factory.mktemp("trajectories")),
                           timeout=300 * len(TRAJECTORIES))[0]


@needs_corpus
@pytest.mark.parametrize("case", list(TRAJECTORIES))
def test_trainer_trajectory_equals_deepspeeds_step(trajectories, case):
    """Fifty trainer steps with the O(1) step and with DeepSpeed's: the same applied/skipped steps under
    injected overflows (fp16: the same loss scales; bf16 skips a non-finite step too), losses and gradient norms
    equal to their precision. With ``precision.hysteresis: 2`` both halve the scale on *every* overflow, the
    first of a run included: DeepSpeed's ZeRO-0 wrappers ignore hysteresis (#697; ZeRO-1's scaler honours it,
    tests/parallel/test_fp16_training.py), and ours keeps DeepSpeed's behaviour (its rule, training/optim/loss_scale.py)."""
    dtype, overflow_at, extra = TRAJECTORIES[case]
    r = trajectories[case]
    ours, ds = r["o1"], r["deepspeed"]
    assert [x[1] for x in ours] == [x[1] for x in ds] == [k not in overflow_at for k in range(STEPS)]
    assert [x[2] for x in ours] == [x[2] for x in ds]
    if dtype == "fp16":
        window = int(extra.get("precision.loss_scale_window", 1000))
        assert r["delayed_shift"] == 2  # the hysteresis reached DeepSpeed's config (config default 2)
        assert [x[2] for x in ours] == _zero0_scales(2.0**8, window, overflow_at, STEPS)
    if case == "fp16-hysteresis":  # the sequence exercises growth between overflows, and halving at each one
        scales = [x[2] for x in ours]
        assert scales[:13] == [256, 256, 256, 128, 64, 64, 64, 64, 64, 128, 128, 64, 64]
        assert max(scales) == 2048 and scales[-1] == 2048
    # Where the scale grows (the hysteresis case only: window 4, not 1000) the updates differ on purpose
    # (training/optim/mixed_precision.py): DeepSpeed doubles the scale before unscaling, so Adam gets half the
    # gradient (norm 0.64 at step 9, under the clip) where ours unscales by the scale the gradients carry and
    # clips (norm 1.29 -> 1), Megatron's rule. Up to the first growth step the two runs are the same training.
    grown = [k for k in range(STEPS) if ds[k][2] > (ds[k - 1][2] if k else 2.0**8)]
    same = grown[0] + 1 if grown else STEPS  # the loss of a growth step comes before its update
    assert (case == "fp16-hysteresis") == bool(grown)
    torch.testing.assert_close(torch.tensor([x[0] for x in ours[:same]]), torch.tensor([x[0] for x in ds[:same]]),
                               rtol=2e-3, atol=2e-3)
    if grown:  # afterwards the same descent, apart by at most (measured) 0.013
        assert same == 10 and max(abs(a[0] - b[0]) for a, b in zip(ours, ds)) < 0.03
    # DeepSpeed's unfused wrapper reports the norm of the scaled gradients; ours, the unscaled one (bf16: scale 1)
    scale_used = [2.0**8 if dtype == "fp16" else 1.0] + [x[2] for x in ds[:-1]]
    applied = [k for k in range(same) if k not in overflow_at]
    torch.testing.assert_close(torch.tensor([ours[k][3] for k in applied]),
                               torch.tensor([ds[k][3] / scale_used[k] for k in applied]), rtol=1e-3, atol=1e-4)
    assert ours[-1][0] < ours[0][0] - 0.3  # it learns


def _fp32_pin_worker(rank, world, spec, tmp, steps):
    """The trainer's fp32 step and a plain PyTorch loop from the same weights on the same batches."""
    from training.models.gpt2 import GPTModel

    t = _trainer(spec, f"{tmp}/fp32", 2, "fp32", **{"train.global_batch_size": 4, "optimizer.warmup_iters": 0,
                                                    "optimizer.decay_style": "constant", "optimizer.lr": 3e-3,
                                                    "optimizer.clip_grad": 1.0})
    oc = t.cfg.optimizer
    ref = GPTModel(t.cfg.model, t.padded_vocab, None, seed=t.cfg.train.seed).train()
    ref.load_state_dict(t.model.state_dict())
    # Megatron's groups (biases and norms undecayed) are exactly the 1-D parameters of this model
    params = list(ref.parameters())
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": oc.weight_decay},
              {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, fused=True)
    batches = [list(t.task.micro_batches(k * 4)) for k in range(steps)]  # the sampler is a function of the step
    ours, theirs = [], []
    for step in batches:
        m = t.train_step()
        ours.append((m["loss"], m["grad_norm"], m["step_applied"]))
        losses = []
        for tokens, labels in step:
            loss = ref(tokens, labels).mean()
            (loss / len(step)).backward()  # gradient accumulation: the mean over the micro-batches
            losses.append(loss.detach())
        norm = _reference_clip(params, oc.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.append((float(torch.stack(losses).mean()), norm, True))
    same_weights = all(torch.equal(a, b) for a, b in zip(t.model.state_dict().values(), ref.state_dict().values()))
    return ours, theirs, len(batches[0]), same_weights


@needs_corpus
def test_fp32_trainer_trajectory_equals_a_plain_pytorch_loop(spm_model, tmp_path):
    """The trainer's fp32 step (DeepSpeed's engine stepping torch's fused AdamW, our on-device clip, gradient
    accumulation over 2 micro-batches) pinned against a plain PyTorch loop written here: the same initial
    weights and batches, ``torch.optim.AdamW`` with the same hyper-parameters and groups, Megatron's clip
    (norm in float64, scaled only when above the limit). Twelve steps, every loss bitwise equal (the same
    operations in the same order: nothing justifies a tolerance), the grad norms to 1e-6 (the trainer sums the
    squared norms in another order), and bitwise the same weights at the end."""
    steps = 12
    ours, theirs, gas, same_weights = run_distributed(_fp32_pin_worker, 1, spm_model, str(tmp_path), steps)[0]
    assert gas == 2 and len(ours) == steps
    assert [x[0] for x in ours] == [x[0] for x in theirs]
    assert all(x[2] for x in ours)
    for (_, a, _), (_, b, _) in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-6)
    norms = [b for _, b, _ in theirs]
    assert sum(b > 1.0 for b in norms) >= 2 and sum(b < 1.0 for b in norms) >= 3, norms  # clipped and not
    assert theirs[-1][0] < theirs[0][0] - 0.5
    assert same_weights


def _bf16_skip_worker(rank, world, spec, tmp):
    from benchmarks.host_work import HostWork
    from training.trainer import TrainingAborted

    out = {}
    for mode in ("o1", "deepspeed"):
        t = _trainer(spec, f"{tmp}/{mode}", 2, "bf16", **{"optimizer.warmup_iters": 0,
                                                           "precision.max_consecutive_skipped": 2})
        if mode == "deepspeed":
            t.engine.owned_step = None  # DeepSpeed's own step
        param = t.model.layers[0].mlp.fc.weight
        state = {"on": False}
        param.register_hook(lambda g: g * float("inf") if state["on"] else g)
        rows, syncs, aborted = [], [], None
        for it in range(1, 10):
            state["on"] = it in (2, 7, 8)
            read = mode == "deepspeed" or it % 3 == 0
            try:
                with HostWork() as w:
                    m = t.train_step(read=read)
            except TrainingAborted as e:
                aborted = (it, str(e))
                break
            syncs.append(w.syncs)
            if read:
                rows.append((it, m["step_applied"], m["skipped"], m["lr"], m["loss"], m["grad_norm"]))
        out[mode] = {"rows": rows, "syncs": syncs, "aborted": aborted, "skipped_steps": t.engine.skipped_steps}
    return out


@needs_corpus
def test_bf16_skips_on_the_device_and_settles_at_the_read(spm_model, tmp_path):
    """bf16 with an inf gradient at step 2, read only at steps 3, 6, 9 (no host read on the others, the skipped
    one included): every step runs DeepSpeed's rate (its own step, read every step), step 3 included although
    the host has not read the skip yet (the schedule counts the device's applied flag); at the read the skip is
    counted (skipped 1); losses and norms equal DeepSpeed's to bf16 precision. Infs at
    steps 7 and 8 with max_consecutive_skipped=2 abort at the next read (step 9: 2 in a row), as DeepSpeed's
    run aborts at step 8."""
    r = run_distributed(_bf16_skip_worker, 1, spm_model, str(tmp_path))[0]
    ours, ds = r["o1"], r["deepspeed"]
    assert ours["syncs"] == [0, 0, 1, 0, 0, 1, 0, 0]  # steps 1-8; step 9 aborted inside its read
    assert ours["aborted"][0] == 9 and ds["aborted"][0] == 8
    assert "2 consecutive steps skipped for bf16 overflow" in ours["aborted"][1]
    assert [row[:3] for row in ours["rows"]] == [(3, True, 1), (6, True, 1)]
    by_it = {row[0]: row for row in ds["rows"]}
    assert by_it[2][1] is False and by_it[3][2] == 1
    o3, o6 = ours["rows"]
    assert o3[3] == by_it[3][3] != by_it[4][3]  # the skip held the schedule back before any read
    assert o6[3] == by_it[6][3]
    for o in (o3, o6):
        assert o[4] == pytest.approx(by_it[o[0]][4], rel=2e-3) and o[5] == pytest.approx(by_it[o[0]][5], rel=1e-3)
    assert ours["skipped_steps"] == 3 and ds["skipped_steps"] == 3


def _tp_norm_worker(rank, world, spec, tmp):
    t = _trainer(spec, f"{tmp}/tp{world}", 2, "fp16", **{"parallel.tensor": world, "optimizer.warmup_iters": 0})
    norms = []
    for _ in range(4):
        m = t.train_step()
        norms.append(m["grad_norm"] if m["step_applied"] else None)
    return norms


@needs_corpus
def test_fp16_grad_norm_at_tp2_equals_tp1(spm_model, tmp_path):
    """Every element counted once at TP = 2: TP-partitioned gradients on both ranks, replicated ones (LayerNorm,
    biases of row-parallel layers) on TP rank 0, summed over the TP group in the one all-reduce. (DeepSpeed's
    own unfused step reads the parallel tags off gradient tensors, which carry none, and counts TP rank 0's
    gradients only.)"""
    one = run_distributed(_tp_norm_worker, 1, spm_model, str(tmp_path))[0]
    two = run_distributed(_tp_norm_worker, 2, spm_model, str(tmp_path))
    assert two[0] == two[1]
    pairs = [(a, b) for a, b in zip(one, two[0]) if a is not None and b is not None]
    assert len(pairs) >= 2
    for a, b in pairs:
        assert b == pytest.approx(a, rel=2e-3)


# --------------------------------------------------------------------------------------------------
def _reference_clip(params, max_norm):
    """The fp32 clip before issue 27: a kernel chain per tensor and a host read of the norm."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        total += p.grad.detach().double().pow(2).sum()
    norm = total.sqrt()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return float(norm)


@pytest.mark.parametrize("size", [0.01, 3.0])
def test_fp32_clip_on_device_equals_the_host_clip(size):
    """The device-side clip (no host read) gives bitwise the gradients of the host-side one, clipping or not."""
    from benchmarks.host_work import HostWork
    from training.parallel.grad_norm import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3), (1,)]
    a = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    b = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q in zip(a, b):
        p.grad = torch.randn(p.shape, generator=g) * size
        q.grad = p.grad.clone()
    ref = _reference_clip(a, 1.0)
    with HostWork() as w:
        norm = clip_grad_norm(b, 1.0, tp_rank=0)
    assert w.syncs == 0 and isinstance(norm, torch.Tensor)
    assert float(norm) == pytest.approx(ref, rel=1e-12)
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)


def test_arch_list_that_deepspeed_can_parse():
    from training.runtime.gpu_settings import plain_arch_list

    assert plain_arch_list("9.0a") == "9.0"
    assert plain_arch_list("8.0;9.0a+PTX") == "8.0;9.0+PTX"
    assert plain_arch_list("7.5 8.6 9.0a 9.0") == "7.5;8.6;9.0"
    assert plain_arch_list("10.0f;12.0a") == "10.0;12.0"
