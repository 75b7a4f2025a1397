"""The planner's step-time model against measured CPU training steps (issue 15 item 5, last part).

A sweep of small GPT-2s (hidden x layers x seq x TP) is trained as training runs it: ``GPT2Model`` under
``deepspeed.initialize`` with the project's AdamW and schedule, fp32, dropout 0.1, forward to the mean
token loss, ``engine.backward``, ``engine.step``, in gloo process groups of exactly TP ranks (DP = 1,
PP = 1, no activation checkpointing), spawned by ``megatron_ds_suite.testing.run_distributed``. Every rank
runs one intra-op thread: a "device" is one core, so TP = 2 uses both cores of the machine. Each launch
times ``--steps`` steps after ``--warmup``; every configuration is launched ``--reps`` times in rotating
order and the figure is the best launch's median step (the slowest rank's), next to
the CPU seconds the busiest rank's process used per step (below the wall time when it waited: for the other
rank at a collective, or for a core that another job holds).

The planner (``training.plan.step_time``, ``Hardware`` "cpu" with this process's measured one-thread
fp32 matmul peak) is calibrated on ONE configuration (``--calibrate``, default the single-rank one of median
FLOPs, a representative run): its ``compute_fraction`` is set so that the prediction equals that
measurement. It then predicts the others;
the table gives the error. The planner's CPU entry has no link or memory-bandwidth data, so it models no
communication and no replicated element-wise work: "compute only" predicts TP = 2 as half the TP = 1
compute. The "+ links" column fills those constants from separate measurements made before the sweep (not
fitted to any step): the gloo all-reduce between two one-thread ranks, timed at five sizes and fitted to
``2 (t-1) alpha + 2 (t-1)/t n / beta`` (``alpha_intra_s``, ``intra_node_gbs``), and the one-thread
bandwidth of an element-wise add (``hbm_gbs``, ``memory_efficiency`` 1) for the replicated term. The
"+ links + overhead" column adds the time that does not scale with FLOPs (``TimeModel.overhead_step_s`` and
``overhead_layer_s``), measured at each TP degree by timing the same training step of a model too small to
compute anything at 1 and 3 layers; at TP > 1 that includes the all-reduces' latency as it occurs inside a
step, so that column takes only the bandwidth term from the link measurement.

On one GPU (``--device cuda``: TP = 1 only, since NCCL allows one rank per GPU) each configuration runs in
its own process (an NCCL world of one), in ``--dtype`` (fp16 by default: DeepSpeed's FusedAdam + fp16
optimizer, as the trainer picks it), timed with ``torch.cuda.synchronize`` around each step; fp16 steps
skipped for overflow are neither warm-up nor timed. The planner uses the data-sheet entry of ``--gpu``
(default: the visible GPU's kind) and the fixed costs measured the same way as on CPU: on a GPU they are the
host's time to dispatch a layer's kernels, which the planner's GPU default (0) leaves out.

    .venv/bin/python -m benchmarks.bench_plan_fidelity --steps 5
    python -m benchmarks.bench_plan_fidelity --device cuda --tp 1 --hidden 768 1536 --layers 12 24 --seq 512 1024 \
        --heads 16 --batch 8 --vocab 50257 --reps 1
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import math
import os
import statistics
import time
import warnings

from benchmarks import common


log = logging.getLogger("bench_plan_fidelity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 256])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="launches per configuration, in rotating order")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo ranks of one thread each; cuda: one GPU, TP = 1, one process per configuration")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="default fp32 on cpu, fp16 on cuda (the paper's)")
    p.add_argument("--gpu", default=None, help="hardware entry for the planner on cuda (default: the visible GPU's kind)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the measurements (peak, links, overheads, every launch) to OUT as JSON, so the "
                        "model can be re-evaluated without re-measuring")
    p.add_argument("--calibrate", default=None,
                   help="config to calibrate on, 'h,l,s,tp' (default: the TP = 1 configuration of median FLOPs)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    if args.device == "cuda" and set(args.tp) != {1}:
        p.error("--device cuda runs on one GPU: --tp 1 only (NCCL allows one rank per GPU)")
    if args.device == "cpu" and args.dtype != "fp32":
        p.error("--device cpu measures fp32 (this CPU has no fast 16-bit matmul)")
    for h in args.hidden:
        if h % args.heads:
            p.error(f"--hidden {h} is not divisible by --heads {args.heads}")
    for tp in args.tp:
        if tp < 1 or args.heads % tp:
            p.error(f"TP={tp} must divide --heads {args.heads}")
    return args


def _worker(rank: int, world: int, a: dict) -> tuple[float, float]:
    """Median (wall, CPU) seconds per training step on this rank (CPU: this process, all threads)."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cuda = a.get("device") == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    engine, tokens, labels = common.tp_gpt2_engine(a, world)
    engine.enable_backward_allreduce = False  # DP = 1, as the trainer sets it
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> bool:
        """One step; False when fp16 loss scaling skipped it (no optimizer update: not a step to time)."""
        before = int(getattr(engine, "skipped_steps", 0))
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return int(getattr(engine, "skipped_steps", 0)) == before

    done = tries = 0
    while done < a["warmup"] and tries < a["warmup"] + 64:  # skipped fp16 steps do not count as warm-up
        done += step()
        tries += 1
    times, cpu = [], []
    tries = 0
    while len(times) < a["steps"] and tries < a["steps"] + 64:
        tries += 1
        dist.barrier()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        applied = step()
        sync()
        if applied:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def _gpu_entry(fn, a: dict):
    """Inside a fresh process: an NCCL world of one on GPU 0, then ``fn(0, 1, a)``."""
    warnings.filterwarnings("ignore")
    os.environ["DS_ACCELERATOR"] = "cuda"
    common.init_single_process("cuda")
    return fn(0, 1, a)


def run_on_gpu(fn, world: int, a: dict, timeout: float = 1800.0) -> list:
    """``run_distributed``'s contract for one GPU: ``fn`` in its own process (fresh GPU memory), one rank."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    assert world == 1, "one GPU: TP = 1"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return [ex.submit(_gpu_entry, fn, a).result(timeout=timeout)]


def _link_worker(rank: int, world: int, sizes: list[int]) -> list[float]:
    """Seconds per gloo all-reduce of ``n`` fp32 elements between one-thread ranks, for each n in ``sizes``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = []
    for n in sizes:
        x = torch.ones(n)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        out.append((time.perf_counter() - t0) / reps)
    return out


def measure_links(run_distributed) -> tuple[float, float]:
    """(alpha s per ring step, beta bytes/s) of a 2-rank gloo all-reduce: least squares of
    t(n) = 2 alpha + n bytes / beta (the ring formula at t = 2) over five sizes."""
    import numpy as np

    sizes = [1024, 16384, 65536, 262144, 1048576]
    secs = [max(v) for v in zip(*run_distributed(_link_worker, 2, sizes))]
    slope, intercept = np.polyfit([4 * n for n in sizes], secs, 1)
    return max(intercept / 2, 0.0), 1.0 / slope


def measure_elementwise_bandwidth() -> float:
    """Bytes/s of a one-thread out-of-place fp32 add of 4M elements (reads 2, writes 1)."""
    import torch

    torch.set_num_threads(1)
    a, b, c = torch.ones(1 << 22), torch.ones(1 << 22), torch.empty(1 << 22)
    best = min(common.timed(lambda: torch.add(a, b, out=c), 5) for _ in range(5))
    return 3 * 4 * (1 << 22) / best


def measure_overheads(run_distributed, heads: int, steps: int, warmup: int, tp: int = 1,
                      extra: dict | None = None) -> tuple[float, float]:
    """(seconds per step, seconds per layer per micro-batch) that do not scale with FLOPs at TP = ``tp``: the
    same training step on a model too small to compute anything (hidden 4 x heads, seq 8, batch 1, vocab 128)
    at 1 and 3 layers, slowest rank; per layer = half the difference, per step = the rest. At TP > 1 this
    includes the latency of the layer's all-reduces as they occur inside a step (their payload here is a
    few hundred bytes), so a model using it takes the links' bandwidth but not their latency."""
    secs = {}
    for layers in (1, 3):
        a = {"hidden": 4 * heads, "layers": layers, "seq": 8, "heads": heads, "batch": 1, "vocab": 128,
             "padded": 128, "steps": steps, "warmup": warmup, **(extra or {})}
        secs[layers] = min(max(r[0] for r in run_distributed(_worker, tp, a)) for _ in range(3))
    per_layer = max((secs[3] - secs[1]) / 2, 0.0)
    log.info("fixed overhead at TP %d: %.2f ms per step + %.2f ms per layer per micro-batch (1 layer %.4f s, "
             "3 layers %.4f s)", tp, max(secs[1] - per_layer, 0.0) * 1e3, per_layer * 1e3, secs[1], secs[3])
    return max(secs[1] - per_layer, 0.0), per_layer


def predict(hidden: int, layers: int, seq: int, tp: int, a: dict, hw, fraction: float, tm=None,
            dtype: str = "fp32") -> float:
    """The planner's seconds per step for one configuration."""
    from training.plan import Layout, ModelShape, TimeModel, step_time

    shape = ModelShape(arch="gpt2", num_layers=layers, hidden=hidden, heads=a["heads"], seq=seq, vocab=a["padded"],
                       positions=seq, ffn=4 * hidden)
    lay = Layout(tp=tp, pp=1, dp=1, micro_batch=a["batch"], global_batch=a["batch"])
    return step_time(shape, lay, hw, tm or TimeModel(), ckpt=False, dtype=dtype, compute_fraction=fraction).total


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    import torch

    from megatron_ds_suite.testing import run_distributed
    from training.config import padded_vocab_size
    from training.plan import TimeModel
    from training.runtime.hardware import get_hardware, measure_cpu_peak_tflops

    cuda = args.device == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # before deepspeed is imported (spawned ranks inherit it)
    info = common.machine_info(gpu=cuda)
    run = run_on_gpu if cuda else run_distributed
    extra = {"device": args.device, "dtype": args.dtype}
    if cuda:  # the data-sheet entry; no links at TP = 1 (and no replicated work)
        from training.runtime.hardware import detect_device_kind

        kind = args.gpu or detect_device_kind()
        hw = get_hardware(kind)
        peak = hw.peak_tflops[args.dtype]
        hw_links, tm_links, alpha, beta, membw = hw, TimeModel(), 0.0, math.inf, math.nan
    else:
        torch.set_num_threads(1)
        peak = measure_cpu_peak_tflops("fp32", budget_s=2.0)
        hw = dataclasses.replace(get_hardware("cpu"), peak_tflops={"fp32": peak})
        alpha, beta = measure_links(run_distributed)
        membw = measure_elementwise_bandwidth()
        hw_links = dataclasses.replace(hw, intra_node_gbs=beta / 1e9, hbm_gbs=membw / 1e9, gpus_per_node=max(args.tp))
        tm_links = TimeModel(alpha_intra_s=alpha, memory_efficiency=1.0)
    overheads = {tp: measure_overheads(run, args.heads, max(args.steps, 5), args.warmup, tp, extra)
                 for tp in sorted(set(args.tp))}
    # per TP degree: the fixed costs measured at that degree; at TP > 1 they hold the collectives' in-step
    # latency, so the all-reduce latency (alpha) is not added again, only the bandwidth term
    tm_full = {tp: dataclasses.replace(tm_links, overhead_step_s=ov[0], overhead_layer_s=ov[1],
                                       alpha_intra_s=0.0 if tp > 1 else alpha) for tp, ov in overheads.items()}
    padded = padded_vocab_size(args.vocab, 128, max(args.tp))
    configs = list(itertools.product(args.hidden, args.layers, args.seq, args.tp))
    base = {"heads": args.heads, "batch": args.batch, "padded": padded}
    if args.calibrate:
        calib = tuple(int(v) for v in args.calibrate.split(","))
    else:  # a representative run: the single-rank configuration of median FLOPs
        single = sorted((c for c in configs if c[3] == 1) or configs,
                        key=lambda c: predict(*c, base, hw, 1.0, dtype=args.dtype))
        calib = single[(len(single) - 1) // 2]
    if calib not in configs:
        raise SystemExit(f"--calibrate {calib} is not in the sweep")
    cpu_runs: dict[tuple, list[tuple[float, float]]] = {c: [] for c in configs}

    def launch(c: tuple) -> float:
        h, l, s, tp = c
        a = {"hidden": h, "layers": l, "seq": s, "heads": args.heads, "batch": args.batch, "vocab": args.vocab,
             "padded": padded, "steps": args.steps, "warmup": args.warmup, **extra}
        ranks = run(_worker, tp, a, timeout=1800.0)
        wall = max(r[0] for r in ranks)  # the step ends when the slowest rank ends
        cpu_runs[c].append((wall, max(r[1] for r in ranks)))
        log.info("h %d l %d s %d tp %d: %.4f s/step (CPU %.4f s)", h, l, s, tp, wall, cpu_runs[c][-1][1])
        return wall

    samples = common.interleaved({c: functools.partial(launch, c) for c in configs}, args.reps)
    # the fastest launch: the one least slowed by the other jobs of this shared machine
    measured = {c: samples[c].lo for c in configs}
    cpu_s = {c: min(cpu_runs[c])[1] for c in configs}
    spread = {c: samples[c].hi / samples[c].lo - 1 for c in configs}
    # at TP = 1 step_time is overhead + compute / fraction (no communication or replicated terms): calibrate
    # each model exactly on the one configuration
    def tm_at(tm, tp: int):  # a TimeModel, or one per TP degree
        return tm[tp] if isinstance(tm, dict) else tm

    def calibrated(tm) -> float:
        with_overhead = predict(*calib, base, hw, 1.0, tm_at(tm, calib[3]), args.dtype)
        overhead = predict(*calib, base, hw, math.inf, tm_at(tm, calib[3]), args.dtype)
        if measured[calib] <= overhead:  # too small a configuration to calibrate on: that model is left out
            log.warning("calibration configuration %s took %.4f s, not more than the fixed overhead %.4f s: "
                        "choose a larger one with --calibrate", calib, measured[calib], overhead)
            return math.nan
        return (with_overhead - overhead) / (measured[calib] - overhead)

    models = ({"compute only": (hw, None), "+ overhead": (hw, tm_full)} if cuda else
              {"compute only": (hw, None), "+ links": (hw_links, tm_links), "+ links + overhead": (hw_links, tm_full)})
    fractions = {name: calibrated(tm) for name, (_, tm) in models.items()}
    rows = []
    errors: dict[str, list[float]] = {name: [] for name in models}
    for c in configs:
        row = [str(c[0]), str(c[1]), str(c[2]), str(c[3]), f"{measured[c]:.4f}", f"+{spread[c] * 100:.0f} %",
               f"{cpu_s[c]:.4f}"]
        for name, (hw_m, tm) in models.items():
            if math.isnan(fractions[name]):
                row += ["n/a", "n/a"]
                continue
            pred = predict(*c, base, hw_m, fractions[name], tm_at(tm, c[3]), args.dtype)
            err = (pred - measured[c]) / measured[c] * 100
            if c != calib:
                errors[name].append(abs(err))
            row += [f"{pred:.4f}", "calibration" if c == calib else f"{err:+.1f}"]
        rows.append(row)
    if args.json:
        from megatron_ds_suite.core import atomic

        atomic.write_json(args.json, {
            "args": vars(args), "peak_tflops": peak, "alpha_s": alpha, "beta_bytes_s": beta, "elementwise_bytes_s": membw,
            "overheads": {str(tp): list(ov) for tp, ov in overheads.items()}, "padded_vocab": padded,
            "calibrate": list(calib), "cpu_count": os.cpu_count(),
            "launches": [{"hidden": c[0], "layers": c[1], "seq": c[2], "tp": c[3], "wall_cpu_s": cpu_runs[c]}
                         for c in configs]})
    print()
    print(common.markdown_header(info, common.load_average()))
    where = (f"{args.dtype} on one GPU ({hw.name}), DeepSpeed engine + the trainer's optimizer" if cuda else
             "fp32, DeepSpeed engine + AdamW, 1 thread per rank")
    print(f"- GPT-2 {where}, dropout 0.1, {args.heads} heads, batch {args.batch}, vocab {args.vocab} padded to {padded}, "
          f"DP = 1, no checkpointing; median of {args.steps} applied steps after {args.warmup} warm-up, slowest rank; "
          f"best of {args.reps} launches (rotating order)")
    peak_what = (f"data-sheet dense {args.dtype} peak {peak:.0f} TFLOP/s" if cuda
                 else f"one-thread fp32 matmul peak {peak * 1e3:.1f} GFLOP/s")
    print(f"- {peak_what}; calibrated on h {calib[0]}, l {calib[1]}, "
          f"s {calib[2]}, TP {calib[3]}: compute fraction " + ", ".join(f"{v:.3f} ({k})" for k, v in fractions.items()))
    links = ("" if cuda else f"gloo all-reduce alpha {alpha * 1e6:.1f} us per ring step, beta {beta / 1e9:.2f} GB/s; "
                             f"one-thread element-wise {membw / 1e9:.2f} GB/s; ")
    print(f"- measured before the sweep: {links}fixed overhead " +
          "; ".join(f"TP {tp}: {ov[0] * 1e3:.2f} ms per step + {ov[1] * 1e3:.2f} ms per layer per micro-batch"
                    for tp, ov in overheads.items()))
    for name, errs in errors.items():
        if not errs:
            continue
        print(f"- |error| {name}, over the {len(errs)} predicted: median {statistics.median(errs):.1f} %, "
              f"max {max(errs):.1f} %, {sum(e <= 20 for e in errs)} of {len(errs)} within 20 %")
    print()
    print(common.markdown_table(["hidden", "layers", "seq", "TP", "measured s/step (best launch)",
                                 "slowest launch", "CPU s/step (max rank)"]
                                + [h for name in models for h in (f"predicted, {name}", "error %")], rows))


if __name__ == "__main__":
    main()
