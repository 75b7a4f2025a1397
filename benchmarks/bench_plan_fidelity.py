"""The planner's step-time model against measured CPU training steps (issue 15 item 5, last part).

A sweep of small GPT-2s (hidden x layers x seq x TP) is trained as training runs it: ``GPTModel`` under
``deepspeed.initialize`` with the project's AdamW and schedule, fp32, dropout 0.1, forward to the mean
token loss, ``engine.backward``, ``engine.step``, in gloo process groups of exactly TP ranks (DP = 1,
PP = 1, no activation checkpointing), spawned by ``training.runtime.spawn.run_distributed``. Every rank
runs one intra-op thread: a "device" is one core, so TP = 2 uses both cores of the machine. Each launch
times ``--steps`` steps after ``--warmup``; every configuration is launched ``--reps`` times in rotating
order and the figure is the best launch's median step (the slowest rank's), next to
the CPU seconds the busiest rank's process used per step (below the wall time when it waited: for the other
rank at a collective, or for a core that another job holds).

The planner (``training.plan.timing.step_time``, ``Hardware`` "cpu" with this process's measured one-thread
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
``overhead_layer_s``), measured by timing the same training step of a model too small to compute anything at 1
and 3 layers at TP = 1 (op dispatch: every TP rank dispatches every op of its layers, so these hold at every
degree), and replaces the back-to-back latency by the all-reduce's latency inside a step: the same tiny model at
TP = t spends more per layer than at TP = 1 only in the layer's 4 all-reduces, so that difference / (4 x 2 (t-1))
is ``alpha_intra_s`` at TP = t (the ranks meet at each all-reduce after their own compute, which costs more than
an all-reduce loop). The planner then charges it to every all-reduce it counts, the embedding's and the
vocab-parallel cross-entropy's included.

``--json OUT`` saves every measurement (constants and each launch) and ``--replay OUT`` re-evaluates the
models on a saved run without measuring, printing the same report.

On one GPU (``--device cuda``: TP = 1 only, since NCCL allows one rank per GPU) each configuration runs in
its own process (an NCCL world of one), in ``--dtype`` (fp16 by default: DeepSpeed's FusedAdam + fp16
optimizer, as the trainer picks it), timed with ``torch.cuda.synchronize`` around each step; fp16 steps
skipped for overflow are neither warm-up nor timed. The planner uses the data-sheet entry of ``--gpu``
(default: the visible GPU's kind) and the fixed costs measured the same way as on CPU: on a GPU they are the
host's time to dispatch a layer's kernels, which the planner's GPU default (0) leaves out.

    .venv/bin/python -m benchmarks.bench_plan_fidelity --steps 5
    .venv/bin/python -m benchmarks.bench_plan_fidelity --replay benchmarks/results/plan_fidelity_cpu_6.json
    python -m benchmarks.bench_plan_fidelity --device cuda --tp 1 --hidden 768 1536 --layers 12 24 --seq 512 1024 \
        --heads 16 --batch 8 --vocab 50257 --reps 1
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import math
import multiprocessing
import os
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks import common
from megatron_ds_suite.core import atomic
from training.runtime.hardware import detect_device_kind, get_hardware, measure_cpu_peak_tflops

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
    p.add_argument("--replay", default=None, metavar="JSON",
                   help="measure nothing: re-evaluate the model on a run saved with --json (its sweep, constants and "
                        "launches) and print the same report; with --calibrate, calibrated on that configuration")
    args = p.parse_args(argv)
    if args.replay:
        if not Path(args.replay).is_file():
            p.error(f"--replay {args.replay}: no such file (write one with --json)")
        return args
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
        before = engine.settle_pending_skips()  # skips decided on the device are read (fp16: one read a step)
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return engine.settle_pending_skips() == before

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
    at 1 and 3 layers, slowest rank; per layer = half the difference, per step = the rest. At TP > 1 the per
    layer figure also holds the latency of the layer's 4 all-reduces as they occur inside a step (their
    payload here is a few hundred bytes): ``in_step_alpha`` takes it from there."""
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
    from training.layout import Layout
    from training.plan.accounting import ModelShape
    from training.plan.timing import TimeModel, step_time

    shape = ModelShape(arch="gpt2", num_layers=layers, hidden=hidden, heads=a["heads"], seq=seq, vocab=a["padded"],
                       positions=seq, ffn=4 * hidden)
    lay = Layout(tp=tp, pp=1, dp=1, micro_batch=a["batch"], global_batch=a["batch"])
    return step_time(shape, lay, hw, tm or TimeModel(), ckpt=False, dtype=dtype, compute_fraction=fraction).total


def in_step_alpha(overheads: dict[int, tuple[float, float]], tp: int) -> float:
    """Latency per ring step of one TP all-reduce as it occurs inside a training step, from the fixed costs
    measured at TP = ``tp`` and TP = 1: the tiny model's extra time per layer at TP = ``tp`` is its layer's 4
    all-reduces (2 forward, 2 backward), each 2 (t - 1) ring steps; the op dispatch is the same at both
    degrees. 0 at TP = 1 (no TP all-reduce)."""
    if tp == 1:
        return 0.0
    extra = overheads[tp][1] - overheads[1][1]
    return max(extra, 0.0) / (4 * 2 * (tp - 1))


def time_models(d: dict) -> dict[str, tuple]:
    """The compared models, each (hardware, TimeModel or {tp: TimeModel} or None), from the measurements
    ``d`` (the --json document)."""
    from training.plan.timing import TimeModel
    overheads = {int(tp): tuple(ov) for tp, ov in d["overheads"].items()}
    tps = sorted({int(r["tp"]) for r in d["launches"]})
    if d["args"]["device"] == "cuda":  # the data-sheet entry; no links at TP = 1 (and no replicated work)
        hw = get_hardware(d["hardware"])
        hw = dataclasses.replace(hw, peak_tflops={**hw.peak_tflops, d["args"]["dtype"]: d["peak_tflops"]})
        ov = overheads[1]
        return {"compute only": (hw, None),
                "+ overhead": (hw, TimeModel(overhead_step_s=ov[0], overhead_layer_s=ov[1]))}
    hw = dataclasses.replace(get_hardware("cpu"), peak_tflops={"fp32": d["peak_tflops"]})
    hw_links = dataclasses.replace(hw, intra_node_gbs=d["beta_bytes_s"] / 1e9, hbm_gbs=d["elementwise_bytes_s"] / 1e9,
                                   gpus_per_node=max(tps))
    tm_links = TimeModel(alpha_intra_s=d["alpha_s"], memory_efficiency=1.0)
    # the fixed costs (op dispatch, the framework's step) are TP = 1's at every degree: each rank dispatches
    # every op of its layers; the all-reduces get the in-step latency measured at their degree (more than back
    # to back: the ranks meet at each one after their own compute) and the links' bandwidth
    step_s, layer_s = overheads[1]
    tm_full = {tp: dataclasses.replace(tm_links, overhead_step_s=step_s, overhead_layer_s=layer_s,
                                       alpha_intra_s=in_step_alpha(overheads, tp) if tp > 1 else d["alpha_s"])
               for tp in tps}
    return {"compute only": (hw, None), "+ links": (hw_links, tm_links), "+ links + overhead": (hw_links, tm_full)}


def evaluate(d: dict) -> dict:
    """Calibrate every model on ``d['calibrate']`` and predict each configuration of the sweep ``d``: rows of
    the table, the |errors| per model, the fractions. Pure: the same document gives the same table."""
    a = d["args"]
    base = {"heads": a["heads"], "batch": a["batch"], "padded": d["padded_vocab"]}
    walls = {(r["hidden"], r["layers"], r["seq"], r["tp"]): r["wall_cpu_s"] for r in d["launches"]}
    configs = list(walls)
    calib = tuple(d["calibrate"])
    # the fastest launch: the one least slowed by the other jobs of this shared machine
    measured = {c: min(w for w, _ in walls[c]) for c in configs}
    cpu_s = {c: min(walls[c])[1] for c in configs}
    spread = {c: max(w for w, _ in walls[c]) / measured[c] - 1 for c in configs}
    models = time_models(d)

    def tm_at(tm, tp: int):  # a TimeModel, or one per TP degree
        return tm[tp] if isinstance(tm, dict) else tm

    def calibrated(hw_m, tm) -> float:
        # step_time is (terms that do not scale with FLOPs) + compute / fraction: exact on the one configuration
        with_overhead = predict(*calib, base, hw_m, 1.0, tm_at(tm, calib[3]), a["dtype"])
        overhead = predict(*calib, base, hw_m, math.inf, tm_at(tm, calib[3]), a["dtype"])
        if measured[calib] <= overhead:  # too small a configuration to calibrate on: that model is left out
            log.warning("calibration configuration %s took %.4f s, not more than the fixed overhead %.4f s: "
                        "choose a larger one with --calibrate", calib, measured[calib], overhead)
            return math.nan
        return (with_overhead - overhead) / (measured[calib] - overhead)

    fractions = {name: calibrated(hw_m, tm) for name, (hw_m, tm) in models.items()}
    rows, errors = [], {name: [] for name in models}
    for c in configs:
        row = [str(c[0]), str(c[1]), str(c[2]), str(c[3]), f"{measured[c]:.4f}", f"+{spread[c] * 100:.0f} %",
               f"{cpu_s[c]:.4f}"]
        for name, (hw_m, tm) in models.items():
            if math.isnan(fractions[name]):
                row += ["n/a", "n/a"]
                continue
            pred = predict(*c, base, hw_m, fractions[name], tm_at(tm, c[3]), a["dtype"])
            err = (pred - measured[c]) / measured[c] * 100
            if c != calib:
                errors[name].append(abs(err))
            row += [f"{pred:.4f}", "calibration" if c == calib else f"{err:+.1f}"]
        rows.append(row)
    return {"models": list(models), "fractions": fractions, "rows": rows, "errors": errors}


def measure(args: argparse.Namespace) -> dict:
    """Run the sweep: the constants (peak, links, fixed costs) first, then every configuration ``--reps``
    times in rotating order. Returns the --json document (everything ``evaluate`` needs)."""
    import torch

    from training.models.config import padded_vocab_size
    from training.runtime.spawn import run_distributed
    cuda = args.device == "cuda"
    run = run_on_gpu if cuda else run_distributed
    extra = {"device": args.device, "dtype": args.dtype}
    d = {"args": vars(args), "cpu_count": os.cpu_count()}
    if cuda:
        d["hardware"] = args.gpu or detect_device_kind()
        d["peak_tflops"] = get_hardware(d["hardware"]).peak_tflops[args.dtype]
    else:
        torch.set_num_threads(1)
        d["peak_tflops"] = measure_cpu_peak_tflops("fp32", budget_s=2.0)
        d["alpha_s"], d["beta_bytes_s"] = measure_links(run_distributed)
        d["elementwise_bytes_s"] = measure_elementwise_bandwidth()
    # TP = 1 always: its fixed costs hold at every degree, and a degree's in-step latency is the difference
    tps = sorted({1, *args.tp})
    d["overheads"] = {str(tp): list(measure_overheads(run, args.heads, max(args.steps, 5), args.warmup, tp, extra))
                      for tp in tps}
    d["padded_vocab"] = padded = padded_vocab_size(args.vocab, 128, max(args.tp))
    configs = list(itertools.product(args.hidden, args.layers, args.seq, args.tp))
    base = {"heads": args.heads, "batch": args.batch, "padded": padded}
    if args.calibrate:
        calib = tuple(int(v) for v in args.calibrate.split(","))
    else:  # a representative run: the single-rank configuration of median FLOPs
        hw = get_hardware("cpu") if not cuda else get_hardware(d["hardware"])
        hw = dataclasses.replace(hw, peak_tflops={args.dtype: d["peak_tflops"]})
        single = sorted((c for c in configs if c[3] == 1) or configs,
                        key=lambda c: predict(*c, base, hw, 1.0, dtype=args.dtype))
        calib = single[(len(single) - 1) // 2]
    if calib not in configs:
        raise SystemExit(f"--calibrate {calib} is not in the sweep")
    d["calibrate"] = list(calib)
    walls: dict[tuple, list[list[float]]] = {c: [] for c in configs}

    def launch(c: tuple) -> float:
        h, l, s, tp = c
        a = {"hidden": h, "layers": l, "seq": s, "heads": args.heads, "batch": args.batch, "vocab": args.vocab,
             "padded": padded, "steps": args.steps, "warmup": args.warmup, **extra}
        ranks = run(_worker, tp, a, timeout=1800.0)
        wall = max(r[0] for r in ranks)  # the step ends when the slowest rank ends
        walls[c].append([wall, max(r[1] for r in ranks)])
        log.info("h %d l %d s %d tp %d: %.4f s/step (CPU %.4f s)", h, l, s, tp, wall, walls[c][-1][1])
        return wall

    common.interleaved({c: functools.partial(launch, c) for c in configs}, args.reps)
    d["launches"] = [{"hidden": c[0], "layers": c[1], "seq": c[2], "tp": c[3], "wall_cpu_s": walls[c]}
                     for c in configs]
    return d


def report(d: dict, header: str) -> None:
    """Print the markdown block of docs/plan.md: machine, constants, error summary, table."""
    a, ev = d["args"], evaluate(d)
    cuda = a["device"] == "cuda"
    overheads = {int(tp): ov for tp, ov in d["overheads"].items()}
    print()
    print(header)
    where = (f"{a['dtype']} on one GPU ({d['hardware']}), DeepSpeed engine + the trainer's optimizer" if cuda else
             "fp32, DeepSpeed engine + AdamW, 1 thread per rank")
    print(f"- GPT-2 {where}, dropout 0.1, {a['heads']} heads, batch {a['batch']}, vocab {a['vocab']} padded to "
          f"{d['padded_vocab']}, DP = 1, no checkpointing; median of {a['steps']} applied steps after {a['warmup']} "
          f"warm-up, slowest rank; best of {a['reps']} launches (rotating order)")
    peak = d["peak_tflops"]
    peak_what = (f"data-sheet dense {a['dtype']} peak {peak:.0f} TFLOP/s" if cuda
                 else f"one-thread fp32 matmul peak {peak * 1e3:.1f} GFLOP/s")
    calib = d["calibrate"]
    print(f"- {peak_what}; calibrated on h {calib[0]}, l {calib[1]}, s {calib[2]}, TP {calib[3]}: compute fraction "
          + ", ".join(f"{v:.3f} ({k})" for k, v in ev["fractions"].items()))
    links = ("" if cuda else f"gloo all-reduce alpha {d['alpha_s'] * 1e6:.1f} us per ring step (back to back), beta "
                             f"{d['beta_bytes_s'] / 1e9:.2f} GB/s; one-thread element-wise "
                             f"{d['elementwise_bytes_s'] / 1e9:.2f} GB/s; ")
    in_step = ("" if cuda else "; in-step all-reduce alpha " + ", ".join(
        f"TP {tp}: {in_step_alpha(overheads, tp) * 1e6:.0f} us per ring step" for tp in overheads if tp > 1))
    print(f"- measured before the sweep: {links}fixed overhead " +
          "; ".join(f"TP {tp}: {ov[0] * 1e3:.2f} ms per step + {ov[1] * 1e3:.2f} ms per layer per micro-batch"
                    for tp, ov in overheads.items()) + in_step)
    for name, errs in ev["errors"].items():
        if not errs:
            continue
        print(f"- |error| {name}, over the {len(errs)} predicted: median {statistics.median(errs):.1f} %, "
              f"max {max(errs):.1f} %, {sum(e <= 20 for e in errs)} of {len(errs)} within 20 %")
    print()
    print(common.markdown_table(["hidden", "layers", "seq", "TP", "measured s/step (best launch)",
                                 "slowest launch", "CPU s/step (max rank)"]
                                + [h for name in ev["models"] for h in (f"predicted, {name}", "error %")], ev["rows"]))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.replay:
        d = json.loads(Path(args.replay).read_text())
        if args.calibrate:  # the same measurements, calibrated on another configuration of the sweep
            calib = [int(v) for v in args.calibrate.split(",")]
            if not any([r["hidden"], r["layers"], r["seq"], r["tp"]] == calib for r in d["launches"]):
                raise SystemExit(f"--calibrate {args.calibrate} is not in the sweep of {args.replay}")
            d["calibrate"] = calib
        machine = d.get("machine") or {"date": "not recorded"}
        report(d, common.markdown_header(machine, d.get("load_after")) + f"\n- replayed from {args.replay}")
        return
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # before deepspeed is imported (spawned ranks inherit it)
    info = common.machine_info(gpu=args.device == "cuda")
    d = measure(args)
    d["machine"], d["load_after"] = info, common.load_average()
    if args.json:
        atomic.write_json(args.json, d)
    report(d, common.markdown_header(info, d["load_after"]))


if __name__ == "__main__":
    main()
