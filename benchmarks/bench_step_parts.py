"""Parts of a CPU training step timed alone, for the model of ``bench_train_step.py`` (same defaults).

    .venv/bin/python -m benchmarks.bench_step_parts gemm-bound --reps 5 --steps 3
    .venv/bin/python -m benchmarks.bench_step_parts attention --reps 15 --steps 5
    .venv/bin/python -m benchmarks.bench_step_parts dropout --reps 10 --steps 5

* ``gemm-bound``: every matrix product of one forward + backward (each linear's forward, input-gradient
  and weight-gradient GEMM in the layouts autograd uses, the tied logits, and the attention bmm's, whose two
  gradient bmm's are timed with the forward's shapes: same FLOPs, other transposes), each shape on its own. Their FLOPs add up to the MFU count (``training.metrics``), so their summed time is the
  fastest step these shapes allow on this BLAS, and step FLOPs / that time / the measured square-matmul
  peak is the MFU bound the shapes impose.
* ``attention``: the attention block, forward + backward with dropout on: CPU SDPA (its math fallback,
  the only CPU path with dropout) against ``training.models.ops.causal_attention_with_dropout``.
* ``dropout``: dropout forward + backward: ``F.dropout`` + residual add against
  ``training.models.ops.dropout_add`` on ``[b, s, h]``, ``F.dropout`` against ``ops.dropout`` on the
  attention probabilities ``[b n, s, s]``.

Candidates are interleaved (``benchmarks/common.py``); each prints a Markdown block for RESULTS.md.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from benchmarks import common
from training.models.ops import causal_attention_with_dropout, dropout, dropout_add
from training.runtime.hardware import measure_cpu_peak_tflops


def warm_then_interleave(cands: dict, reps: int) -> tuple[dict, dict]:
    """Call each candidate once (allocations, kernel choice), take the machine facts, then time them
    interleaved; returns (facts before the timed run, ``common.interleaved`` results)."""
    for c in cands.values():
        c()
    info = common.machine_info()
    return info, common.interleaved(cands, reps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["gemm-bound", "attention", "dropout"])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257, help="unpadded vocabulary (padded to a multiple of 128)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="calls per candidate per repetition")
    args = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "threads", "reps", "steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def bench_attention(args) -> None:
    """Attention block alone, [b, n, s, hn] from a fused QKV activation, forward + backward."""
    b, n, s, hn = args.batch, args.heads, args.seq, args.hidden // args.heads
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, 3 * n * hn, generator=gen, requires_grad=True)
    gy = torch.randn(b, n, s, hn, generator=gen)
    p = args.dropout

    def split():
        return qkv.view(b, s, 3, n, hn).permute(2, 0, 3, 1, 4).unbind(0)

    fns = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True),
           "ours": lambda q, k, v: causal_attention_with_dropout(q, k, v, p)}
    # the two draw different dropout masks (different samplers): compare the numbers without dropout
    diff = (F.scaled_dot_product_attention(*split(), is_causal=True)
            - causal_attention_with_dropout(*split(), 0.0)).abs().max().item()

    def run(f):
        def once() -> None:
            f(*split()).backward(gy)
            qkv.grad = None
        return lambda: common.timed(once, args.steps)

    cands = {k: run(f) for k, f in fns.items()}
    info, res = warm_then_interleave(cands, args.reps)
    print(common.markdown_header(info, common.load_average()))
    print(f"- attention b={b} n={n} s={s} hn={hn}, dropout {p}, fp32, forward + backward, {args.reps} interleaved "
          f"repetitions x {args.steps} calls; max |sdpa - ours| without dropout: {diff:.2e} "
          f"(scale 1/sqrt(hn) = {1 / math.sqrt(hn):.4f})\n")
    print(common.markdown_table(["attention", "ms median [min-max]"], [[k, v.fmt(".1f", 1000)] for k, v in res.items()]))
    print(f"\nSpeed-up ours/sdpa: {common.ratio_samples(res['sdpa'], res['ours']).fmt('.3f')}")


def step_gemms(b: int, s: int, h: int, n: int, layers: int, vocab: int) -> list[tuple[str, int, tuple, tuple]]:
    """(name, count per step, A shape, B shape) of every matmul in a forward + backward of GPT-2.

    A linear y = x W^T with x [b s, k], W [j, k] costs three GEMMs: forward x @ W^T, input gradient
    dy @ W ([b s, j] x [j, k]) and weight gradient dy^T @ x ([j, b s] x [b s, k]). Attention per
    (batch, head): scores Q K^T [s, hn] x [hn, s] and probs V [s, s] x [s, hn], each with two gradient
    bmm's of the same size. Layouts are the ones autograd uses (transposed views, not copies).
    """
    t, hn, bn = b * s, h // n, b * n
    out = []
    for name, k, j in (("qkv", h, 3 * h), ("attn proj", h, h), ("fc", h, 4 * h), ("fc proj", 4 * h, h),
                       ("logits (tied)", h, vocab)):
        cnt = 1 if name.startswith("logits") else layers
        out += [(f"{name} fwd", cnt, (t, k), ("T", k, j)), (f"{name} dgrad", cnt, (t, j), (j, k)),
                (f"{name} wgrad", cnt, ("T", j, t), (t, k))]
    out += [("attn scores fwd+2 grads", 3 * layers, (bn, s, hn), (bn, hn, s)),
            ("attn probs@V fwd+2 grads", 3 * layers, (bn, s, s), (bn, s, hn))]
    return out


def bench_gemm_bound(args) -> None:
    """Seconds per step spent in GEMMs alone, shape by shape; MFU bound = step FLOPs / that / peak."""
    from training.models.config import padded_vocab_size
    from training.plan.accounting import model_flops_per_iteration

    padded = padded_vocab_size(args.vocab, 128, 1)
    gen = torch.Generator().manual_seed(0)

    def make(shape):
        if shape[0] == "T":  # ("T", r, c): an [r, c] transposed view of a [c, r] tensor, as autograd passes it
            return torch.randn(*reversed(shape[1:]), generator=gen).transpose(-1, -2)
        return torch.randn(*shape, generator=gen)

    gemms = step_gemms(args.batch, args.seq, args.hidden, args.heads, args.layers, padded)
    cands, flops_of = {}, {}
    for name, cnt, sa, sb in gemms:
        a, bm = make(sa), make(sb)
        fn = torch.bmm if a.dim() == 3 else torch.mm
        flops_of[name] = cnt * 2 * a.shape[-2] * a.shape[-1] * bm.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        cands[name] = (lambda fn=fn, a=a, bm=bm, cnt=cnt: cnt * common.timed(lambda: fn(a, bm), args.steps))
    peak_fn = getattr(measure_cpu_peak_tflops, "__wrapped__", measure_cpu_peak_tflops)
    cands["peak"] = lambda: peak_fn("fp32")
    info, res = warm_then_interleave(cands, args.reps)
    peak = res.pop("peak")
    total = common.Samples([sum(v) for v in zip(*(r.values for r in res.values()))])
    step_flops = model_flops_per_iteration(args.batch, args.seq, args.layers, args.hidden, padded)
    counted = sum(flops_of.values())
    rows = [[k, f"{flops_of[k] / 1e9:.2f}", v.fmt(".1f", 1000), f"{flops_of[k] / v.median / 1e9:.1f}"]
            for k, v in res.items()]
    print(common.markdown_header(info, common.load_average()))
    print(f"- GPT-2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, vocab {padded}; fp32, {args.threads} threads; {args.reps} interleaved repetitions x "
          f"{args.steps} calls per shape\n- GEMM FLOPs counted {counted / 1e9:.1f} G = model FLOPs per step "
          f"{step_flops / 1e9:.1f} G (training.metrics)\n")
    print(common.markdown_table(["GEMM (per step)", "GFLOP", "ms per step median [min-max]", "GFLOP/s"], rows))
    mfu = common.Samples([step_flops / t / 1e12 / p for t, p in zip(total.values, peak.values)])
    print(f"\nGEMMs alone: {total.fmt('.3f')} s per step = {step_flops / total.median / 1e9:.1f} GFLOP/s; "
          f"square n=1024 matmul peak {peak.fmt('.1f', 1000)} GFLOP/s; MFU bound of these shapes "
          f"(per repetition): {mfu.fmt('.1f', 100)} %")


def bench_dropout_ops(args) -> None:
    """Dropout forward + backward: torch's ``F.dropout`` (+ residual add) against ``training.models.ops``."""
    b, n, s, h, p = args.batch, args.heads, args.seq, args.hidden, args.dropout
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, h, generator=gen, requires_grad=True)
    r = torch.randn(b, s, h, generator=gen, requires_grad=True)
    probs = torch.rand(b * n, s, s, generator=gen, requires_grad=True)

    def fb(fn, *inputs):
        def once() -> None:
            y = fn()
            y.backward(torch.ones_like(y))
            for t in inputs:
                t.grad = None
        return lambda: common.timed(once, args.steps)

    cands = {
        "hidden: F.dropout + add": fb(lambda: r + F.dropout(x, p, True), x, r),
        "hidden: ops.dropout_add": fb(lambda: dropout_add(x, r, p, True), x, r),
        "attention probs: F.dropout": fb(lambda: F.dropout(probs, p, True), probs),
        "attention probs: ops.dropout": fb(lambda: dropout(probs, p, True), probs),
    }
    info, res = warm_then_interleave(cands, args.reps)
    print(common.markdown_header(info, common.load_average()))
    print(f"- dropout p={p}, fp32, forward + backward; hidden [b={b}, s={s}, h={h}], attention probabilities "
          f"[b n={b * n}, s, s]; {args.reps} interleaved repetitions x {args.steps} calls\n")
    print(common.markdown_table(["op", "ms median [min-max]"], [[k, v.fmt(".2f", 1000)] for k, v in res.items()]))
    for what in ("hidden", "attention probs"):
        torch_k, ours_k = [k for k in res if k.startswith(what + ":")]
        print(f"\nSpeed-up {what} ours/torch: {common.ratio_samples(res[torch_k], res[ours_k]).fmt('.2f')}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    {"gemm-bound": bench_gemm_bound, "attention": bench_attention, "dropout": bench_dropout_ops}[args.part](args)


if __name__ == "__main__":
    main()
