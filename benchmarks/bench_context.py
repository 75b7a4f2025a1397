"""Context parallelism on CPU (issue 43 item 4): the longest sequence whose training step fits a per-rank memory
budget at c = 1, 2, 4 (Ulysses and ring), and its tokens/s.

``python -m benchmarks.bench_context [--budget-mib 192 --start 512 --layers 2 --hidden 128 --heads 8]``

Each case starts c gloo ranks (TP 1, DP 1, fp32, one sample per step) with a tiny Llama-shaped model (RoPE,
RMSNorm, SwiGLU, grouped-query attention, untied) under the project's engine, and grows the sequence in the same
processes: doubling from ``--start`` while the step fits, then ``--refine`` bisection steps between the last length
that fitted and the first that did not (lengths multiples of 2c, for the ring's chunks). A step "fits" when every
rank's peak memory during it stays within ``--budget-mib``.

Peak memory, per rank and step: the growth of the process's resident set (RSS) over its value just before the
step, RSS sampled every ``--sample-ms`` by a thread reading ``/proc/self/statm``; glibc's mmap threshold is fixed
at 64 KiB (``mallopt``) and ``malloc_trim`` runs before each step, so freed tensors leave the RSS and the growth
is the step's activations, gradients and temporaries (optimizer states are created by the first, warm-up step at
the smallest length). The sampler can miss a peak shorter than its period: the figures are lower bounds.

tokens/s: the tokens of one step (one sample of the longest fitting length) over the slowest rank's mean time of
``--steps`` steps at that length.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import threading
import time
import warnings

from benchmarks import common

MIB = 2**20
CASES = ((1, "ulysses"), (2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring"))
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-mib", type=float, default=192.0, help="per-rank peak memory budget of one step")
    p.add_argument("--start", type=int, default=512, help="first sequence length tried")
    p.add_argument("--max-seq", type=int, default=1 << 17, help="stop growing here")
    p.add_argument("--refine", type=int, default=2, help="bisection steps after the doubling")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="timed steps at the longest fitting length")
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--cases", default=",".join(f"{c}:{impl}" for c, impl in CASES),
                   help="comma-separated c:impl (default: all)")
    return p.parse_args(argv)


class PeakRSS:
    """The peak RSS growth of this process while the ``with`` block runs (bytes), sampled by a thread."""

    def __init__(self, period_s: float):
        self.period_s, self.page = period_s, os.sysconf("SC_PAGE_SIZE")
        self.peak = self.base = 0
        self.stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period_s)

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = self.rss()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _build(a: dict):
    """(engine, context or None): the Llama-shaped model under the project's engine at CP ``a['cp']``."""
    import torch  # noqa: F401 - torch before DeepSpeed

    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.context import ContextParallel
    from training.parallel.state import ParallelState

    cfg = Config()
    cfg.model = ModelConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                            num_query_groups=a["groups"], seq_length=a["max_seq"], vocab_size=a["vocab"],
                            position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                            untie_embeddings_and_output_weights=True, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0)
    cfg.parallel.context, cfg.parallel.context_impl = a["cp"], a["impl"]
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 1
    ps = ParallelState(tp=1, cp=a["cp"])
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1234)
    context = ContextParallel(ps.cp_group, a["impl"]) if a["cp"] > 1 else None
    model = GPTModel(cfg.model, a["vocab"], ps.tp_group, seed=1234, context=context).train()
    opt, sched = build_optimizer(model, cfg.optimizer, 10**6)
    return build_engine(model, opt, sched, deepspeed_config(cfg, 1, "fp32"), ps), context


def _worker(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    engine, context = _build(a)

    def step(seq: int) -> tuple[int, float]:
        """One training step on one sample of ``seq`` tokens: (the largest rank's peak RSS growth, its seconds)."""
        data = torch.randint(0, a["vocab"], (1, seq + 1), generator=torch.Generator().manual_seed(seq))
        tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        libc.malloc_trim(0)
        dist.barrier()
        t0 = time.perf_counter()
        with PeakRSS(a["sample_ms"] / 1000) as peak:
            if context is None:
                loss = engine(tokens, labels).mean()
            else:
                mine, their_labels, positions = context.split(tokens, labels)
                loss = context.loss(engine(mine, their_labels, positions=positions))
            engine.backward(loss)
            engine.step()
        secs = time.perf_counter() - t0
        worst = torch.tensor([float(peak.growth), secs])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return int(worst[0]), float(worst[1])

    chunk, budget = 2 * a["cp"], a["budget_mib"] * MIB
    step(chunk * 8)                                                      # warm-up: optimizer states exist
    probes, fits, fails = [], 0, None
    seq = a["start"]
    while seq <= a["max_seq"]:
        peak, _ = step(seq)
        probes.append((seq, peak))
        if peak > budget:
            fails = seq
            break
        fits, seq = seq, seq * 2
    for _ in range(a["refine"] if fails is not None and fits else 0):
        seq = (fits + fails) // 2 // chunk * chunk
        if seq in (fits, fails):
            break
        peak, _ = step(seq)
        probes.append((seq, peak))
        fits, fails = (seq, fails) if peak <= budget else (fits, seq)
    secs = [step(fits)[1] for _ in range(a["steps"])] if fits else [float("nan")]
    peak_at = max(p for s, p in probes if s == fits) if fits else 0
    return {"seq": fits, "peak": peak_at, "secs": sum(secs) / len(secs), "probes": probes}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from training.runtime.spawn import run_distributed

    info = common.machine_info()
    load_before = common.load_average()
    rows = []
    for case in args.cases.split(","):
        cp, impl = int(case.split(":")[0]), case.split(":")[1]
        r = run_distributed(_worker, cp, {**vars(args), "cp": cp, "impl": impl}, timeout=3600.0)[0]
        logging.info("c=%d %s: probes (seq, peak MiB) %s", cp, impl,
                     [(s, round(p / MIB, 1)) for s, p in r["probes"]])
        rows.append([str(cp), impl if cp > 1 else "-", str(r["seq"]), f"{r['peak'] / MIB:.1f}",
                     f"{r['seq'] / r['secs']:.0f}", f"{r['secs']:.2f}"])
    print()
    print(common.markdown_header(info, common.load_average()))
    print(f"- load average before the run: {load_before}")
    print(f"- model: Llama shape, {args.layers} layers, hidden {args.hidden}, {args.heads} heads in {args.groups} "
          f"key/value groups, vocab {args.vocab}, fp32, one sample per step, TP 1, DP 1, c gloo ranks with one "
          f"thread each; budget {args.budget_mib:g} MiB peak RSS growth per rank and step")
    print()
    print(common.markdown_table(["c", "impl", "longest seq that fits", "peak MiB (max rank)", "tokens/s",
                                 "s/step (slowest rank)"], rows))


if __name__ == "__main__":
    main()
