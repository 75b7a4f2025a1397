"""Tensor-parallel overhead on CPU: step time and bytes communicated per step at TP = 1, 2, 4.

The same GPT-2 (same seed, same padded vocabulary: padded for the largest TP so every degree holds
the same weights) is trained under the project's DeepSpeed engine (``deepspeed.initialize`` with
our ``mpu``, the project's AdamW, fp32) in gloo process groups of exactly TP ranks (DP = 1), spawned
like ``tests/helpers/distributed.py``. Every launch is one degree; repetitions rotate the order of the
degrees (1 2 4, 2 4 1, 4 1 2, ...) and each times ``--steps`` steps after ``--warmup``. The machine's
cores are shared equally: each rank gets ``max(1, cores // TP)`` intra-op threads (so TP=4 on 2 cores
oversubscribes 2x: that cost is part of what is measured).

Bytes per step are counted two ways on rank 0:

* ``training.parallel.mappings.COLLECTIVE_BYTES``: payload of our TP collectives (f, g, the
  vocab-parallel embedding's g and the cross-entropy's three all-reduces);
* a counting wrapper around ``torch.distributed`` collectives (calls the real ones) over groups of
  more than one rank: everything, including DeepSpeed's (gradient-norm all-reduce over the TP group).

Design prediction per step, per rank (payload; fp32 = 4 bytes): forward 2 all-reduces of b*s*h per
layer plus one for the embedding, backward 2 per layer plus one for the tied output layer's f, loss
3 all-reduces of b*s  ->  ((4 L + 2) b s h + 3 b s) * 4 bytes. A ring all-reduce sends
2 (p-1)/p of its payload per rank.

    .venv/bin/python -m benchmarks.bench_tp_overhead --reps 3 --steps 2
"""
from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
import time
import warnings
from collections import Counter

from benchmarks import common

os.environ.setdefault("DS_ACCELERATOR", "cpu")

log = logging.getLogger("bench_tp_overhead")
DEGREES = (1, 2, 4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--tp", type=int, nargs="+", default=list(DEGREES), help="TP degrees to compare")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads shared by the ranks of a launch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "cores", "reps", "steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    for tp in args.tp:
        if tp < 1 or args.heads % tp or (4 * args.hidden) % tp:
            p.error(f"TP={tp} must divide --heads {args.heads} and the MLP width {4 * args.hidden}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return args


def predicted_bytes(layers: int, b: int, s: int, h: int, tp: int, elem: int = 4) -> int:
    """Payload bytes of our TP collectives per step per rank (0 at TP=1: no collective is issued)."""
    if tp == 1:
        return 0
    return ((4 * layers + 2) * b * s * h + 3 * b * s) * elem


class CountingCollectives:
    """Wraps torch.distributed.{all_reduce, all_gather, reduce_scatter_tensor, broadcast} to count calls
    and payload bytes over groups of more than one rank; the real collective still runs."""

    #: collective -> name of the argument holding this rank's payload
    NAMES = {"all_reduce": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
             "reduce_scatter_tensor": "input", "broadcast": "tensor"}

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        for name, arg in self.NAMES.items():
            real = getattr(dist, name)
            sig = inspect.signature(real)

            @functools.wraps(real)
            def wrapper(*a, _real=real, _name=name, _arg=arg, _sig=sig, **kw):
                bound = _sig.bind(*a, **kw).arguments
                t = bound.get(_arg)
                if dist.get_world_size(bound.get("group")) > 1 and isinstance(t, torch.Tensor):
                    self.calls[_name] += 1
                    self.bytes[_name] += t.numel() * t.element_size()
                return _real(*a, **kw)

            setattr(dist, name, wrapper)

    def clear(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def _worker(rank: int, world: int, a: dict) -> dict:
    import deepspeed  # noqa: F401  (imported before the collectives are wrapped)
    import torch
    import torch.distributed as dist

    from training.parallel import mappings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(max(1, a["cores"] // world))
    counting = CountingCollectives()
    counting.install()
    engine, tokens, labels = common.tp_gpt2_engine(a, world)

    def step() -> float:
        loss = engine(tokens, labels).mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    for _ in range(a["warmup"]):
        step()
    mappings.COLLECTIVE_CALLS.clear()
    mappings.COLLECTIVE_BYTES.clear()
    counting.clear()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    losses = [step() for _ in range(a["steps"])]
    dist.barrier()
    secs = (time.perf_counter() - t0) / a["steps"]
    n = a["steps"]
    return {"secs": secs, "cpu": (time.process_time() - c0) / n, "loss": losses[-1],
            "tp_calls": {k: v / n for k, v in mappings.COLLECTIVE_CALLS.items()},
            "tp_bytes": {k: v / n for k, v in mappings.COLLECTIVE_BYTES.items()},
            "all_calls": {k: v / n for k, v in counting.calls.items()},
            "all_bytes": {k: v / n for k, v in counting.bytes.items()}}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from training.models.config import padded_vocab_size
    from training.runtime.spawn import run_distributed

    info = common.machine_info()
    padded = padded_vocab_size(args.vocab, 128, max(args.tp))
    a = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dropout", "cores",
                                        "steps", "warmup")}
    a["padded"] = padded
    last: dict[int, dict] = {}
    cpu: dict[int, common.Samples] = {tp: common.Samples() for tp in args.tp}

    def launch(tp: int) -> float:
        res = run_distributed(_worker, tp, a, timeout=1800.0)
        last[tp] = res[0]
        cpu[tp].values.append(sum(r["cpu"] for r in res))  # CPU seconds of all ranks together
        return max(r["secs"] for r in res)  # the step ends when the slowest rank ends

    samples = common.interleaved({f"tp{tp}": functools.partial(launch, tp) for tp in args.tp}, args.reps)
    b, s, h = args.batch, args.seq, args.hidden
    base = samples.get("tp1")
    rows = []
    for tp in args.tp:
        t = samples[f"tp{tp}"]
        r = last[tp]
        ours = sum(r["tp_bytes"].values())
        everything = sum(r["all_bytes"].values())
        pred = predicted_bytes(args.layers, b, s, h, tp)
        ring = 2 * (tp - 1) / tp * ours if tp > 1 else 0.0
        rel = common.ratio_samples(t, base).fmt(".2f") if base else "-"
        calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r["tp_calls"].items())) or "none"
        rows.append([str(tp), str(max(1, args.cores // tp)), t.fmt(".3f"), rel, cpu[tp].fmt(".2f"),
                     f"{b * s / t.median:,.0f}",
                     f"{pred / 2**20:.2f}", f"{ours / 2**20:.2f} ({'=' if ours == pred else '!='} design)", calls, f"{everything / 2**20:.2f}",
                     f"{ring / 2**20:.2f}", f"{r['loss']:.6f}"])
    print()
    print(common.markdown_header(info, common.load_average()))
    print(f"- model: {args.layers} layers, hidden {h}, {args.heads} heads, seq {s}, batch {b}, vocab {args.vocab} "
          f"padded to {padded} at every TP, dropout {args.dropout}, fp32, DeepSpeed engine, DP=1; "
          f"{args.reps} interleaved repetitions x {args.steps} steps after {args.warmup} warm-up")
    print()
    print(common.markdown_table(
        ["TP", "threads/rank", "s/step median [min-max]", "x TP=1 (per rep)", "CPU s/step (all ranks)", "tokens/s", "predicted MiB/step",
         "TP collectives MiB/step", "TP calls/step", "all collectives MiB/step", "ring-sent MiB/step (TP)",
         "last loss"], rows))


if __name__ == "__main__":
    main()
