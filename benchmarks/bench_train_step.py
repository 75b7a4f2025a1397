"""Training-step benchmark on CPU: our GPT-2 (TP=1) against Hugging Face ``GPT2LMHeadModel``.

Both models have the same dimensions, dtype (fp32), batch, sequence, dropout and activation (exact
erf GELU), and the same padded vocabulary (HF's ``vocab_size`` is set to our padded size so both do
the same FLOPs); both are wrapped by ``deepspeed.initialize`` with the project's DeepSpeed config
(``training.config.deepspeed_config``) and the project's AdamW (``training.optim.build_optimizer``).
One step = forward (mean token loss), ``engine.backward``, ``engine.step``. HF runs with
``attn_implementation="sdpa"`` and computes its own shifted loss from ``labels=tokens``.

Repetitions are interleaved (ours, HF, matmul peak; rotated each repetition); each repetition
times ``--steps`` steps after ``--warmup`` untimed ones. MFU = model FLOPs per step
(``training.metrics.model_flops_per_iteration``) / step time / the dense matmul FLOP/s measured in
the same repetition (``training.hardware.measure_cpu_peak_tflops``, uncached).

    .venv/bin/python benchmarks/bench_train_step.py --reps 5 --steps 2
    .venv/bin/python benchmarks/bench_train_step.py --profile 3   # torch.profiler tables instead
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

log = logging.getLogger("bench_train_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro = global batch (one micro-batch per step)")
    p.add_argument("--vocab", type=int, default=50257, help="unpadded vocabulary (padded to a multiple of 128)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden, attention and embedding dropout, both models")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", action="store_true",
                   help="also clip the gradient norm as training/trainer.py does in fp32 (DeepSpeed clip_grad_norm_)")
    p.add_argument("--only", choices=["ours", "hf"], default=None, help="time one model only")
    p.add_argument("--engine-tweaks", action="store_true",
                   help="add a third candidate 'ours+tweaks': our model with AdamW(fused=True) and the engine's "
                        "gradient all-reduce switched off (DP=1), to measure what the trainer could save")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="instead of timing, profile STEPS steps of each model and print the top operators")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--attention", action="store_true",
                   help="instead: time the attention block alone (forward + backward, dropout on): CPU SDPA "
                        "(math fallback) against training.models.gpt2.causal_attention_with_dropout")
    args = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "threads", "reps", "steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return args


def init_single_process() -> None:
    """World of one gloo process: DeepSpeed's engine and our ParallelState need torch.distributed."""
    import deepspeed

    from tests.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    from training.distributed import init_distributed

    init_distributed("gloo")


def project_config(args):
    from training.config import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=args.dropout,
                            attention_dropout=args.dropout)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = args.batch
    cfg.train.iters = 10**6
    return cfg


class Runner:
    """One model under its own DeepSpeed engine; ``step()`` = forward, backward, optimizer step."""

    def __init__(self, name: str, engine, model, loss_fn, tokens, labels, clip: float, mpu=None):
        self.name, self.engine, self.model, self.loss_fn = name, engine, model, loss_fn
        self.tokens, self.labels, self.clip, self.mpu = tokens, labels, clip, mpu

    def step(self) -> float:
        from deepspeed.runtime.utils import clip_grad_norm_

        loss = self.loss_fn(self.engine, self.tokens, self.labels)
        self.engine.backward(loss)
        if self.clip:
            clip_grad_norm_(self.model.parameters(), self.clip, mpu=self.mpu)
        self.engine.step()
        return loss.item()


def tied_safe_optimizer(model, ocfg, iters: int, fused: bool = False):
    """``training.optim.build_optimizer``'s AdamW and schedule, with each parameter listed once.

    ``training.optim.param_groups`` walks modules, so a weight tied across two modules (HF's
    ``lm_head.weight is transformer.wte.weight``) would be listed twice and DeepSpeed rejects that.
    """
    from training.optim import lr_at, param_groups

    seen: set[int] = set()
    groups = []
    for g in param_groups(model, ocfg.weight_decay):
        params = [p for p in g["params"] if id(p) not in seen and not seen.add(id(p))]
        groups.append({**g, "params": params})
    opt = torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_at(it, ocfg, iters) / ocfg.lr)
    return opt, sched


def build_runners(args, cfg, padded: int, tokens, labels) -> dict[str, Runner]:
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    from training.config import deepspeed_config
    from training.models.gpt2 import GPT2Model
    from training.optim import build_optimizer
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ds = deepspeed_config(cfg, 1, "fp32")
    clip = cfg.optimizer.clip_grad if args.clip else 0.0
    runners: dict[str, Runner] = {}
    ps = ParallelState(tp=1)
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(cfg.train.seed)
    if args.only in (None, "ours"):
        ours = GPT2Model(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        opt, sched = build_optimizer(ours, cfg.optimizer, cfg.train.iters)
        eng, *_ = deepspeed.initialize(model=ours, optimizer=opt, lr_scheduler=sched, mpu=ps, config=dict(ds),
                                       dist_init_required=False)
        runners["ours"] = Runner("ours", eng, ours, lambda e, t, l: e(t, l).mean(), tokens, labels, clip, ps)
    if args.engine_tweaks:
        tweaked = GPT2Model(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        opt, sched = tied_safe_optimizer(tweaked, cfg.optimizer, cfg.train.iters, fused=True)
        eng, *_ = deepspeed.initialize(model=tweaked, optimizer=opt, lr_scheduler=sched, mpu=ps, config=dict(ds),
                                       dist_init_required=False)
        eng.enable_backward_allreduce = False  # DP=1: the bucketed all-reduce only flattens and copies back
        runners["ours+tweaks"] = Runner("ours+tweaks", eng, tweaked, lambda e, t, l: e(t, l).mean(), tokens, labels,
                                        clip, ps)
    if args.only in (None, "hf"):
        hcfg = GPT2Config(vocab_size=padded, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                          n_head=args.heads, activation_function="gelu", resid_pdrop=args.dropout,
                          embd_pdrop=args.dropout, attn_pdrop=args.dropout, layer_norm_epsilon=1e-5,
                          initializer_range=0.02)
        torch.manual_seed(cfg.train.seed)
        hf = GPT2LMHeadModel._from_config(hcfg, attn_implementation="sdpa").train()
        opt, sched = tied_safe_optimizer(hf, cfg.optimizer, cfg.train.iters)
        eng, *_ = deepspeed.initialize(model=hf, optimizer=opt, lr_scheduler=sched, config=dict(ds),
                                       dist_init_required=False)
        # HF shifts internally: labels = the input ids (loss over s-1 positions, logits over all s)
        assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
        runners["hf"] = Runner("hf", eng, hf, lambda e, t, l: e(input_ids=t, labels=t).loss, tokens, labels, clip)
    return runners


def profile(runners: dict[str, Runner], steps: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile, record_function

    for name, r in runners.items():
        r.step()
        with tprofile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for _ in range(steps):
                with record_function(f"{name}.forward"):
                    loss = r.loss_fn(r.engine, r.tokens, r.labels)
                with record_function(f"{name}.backward"):
                    r.engine.backward(loss)
                if r.clip:
                    from deepspeed.runtime.utils import clip_grad_norm_

                    with record_function(f"{name}.clip_grad_norm"):
                        clip_grad_norm_(r.model.parameters(), r.clip, mpu=r.mpu)
                with record_function(f"{name}.optimizer_step"):
                    r.engine.step()
        print(f"\n=== {name}: {steps} steps, operators by self CPU time ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        print(f"=== {name}: phases (total CPU time) ===")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))


def bench_attention(args) -> None:
    """Attention block alone, [b, n, s, hn] from a fused QKV activation, forward + backward."""
    import math

    import torch.nn.functional as F

    from training.models.gpt2 import causal_attention_with_dropout

    b, n, s, hn = args.batch, args.heads, args.seq, args.hidden // args.heads
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, 3 * n * hn, generator=gen, requires_grad=True)
    gy = torch.randn(b, n, s, hn, generator=gen)
    p = args.dropout

    def split():
        return qkv.view(b, s, 3, n, hn).permute(2, 0, 3, 1, 4).unbind(0)

    fns = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True),
           "ours": lambda q, k, v: causal_attention_with_dropout(q, k, v, p)}
    torch.manual_seed(1)
    ref = fns["sdpa"](*split())
    torch.manual_seed(1)
    diff = (ref - fns["ours"](*split())).abs().max().item()

    def run(f):
        def once() -> None:
            f(*split()).backward(gy)
            qkv.grad = None
        return lambda: common.timed(once, args.steps)

    cands = {k: run(f) for k, f in fns.items()}
    for c in cands.values():
        c()
    res = common.interleaved(cands, args.reps)
    info = common.machine_info()
    print(common.markdown_header(info, common.load_average()))
    print(f"- attention b={b} n={n} s={s} hn={hn}, dropout {p}, fp32, forward + backward, {args.reps} interleaved "
          f"repetitions x {args.steps} calls; max |sdpa - ours| with the same dropout seed: {diff:.2e} "
          f"(scale 1/sqrt(hn) = {1 / math.sqrt(hn):.4f})\n")
    print(common.markdown_table(["attention", "ms median [min-max]"], [[k, v.fmt(".1f", 1000)] for k, v in res.items()]))
    print(f"\nSpeed-up ours/sdpa: {common.ratio_samples(res['sdpa'], res['ours']).fmt('.3f')}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.attention:
        bench_attention(args)
        return
    init_single_process()
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from training.config import padded_vocab_size
    from training.hardware import measure_cpu_peak_tflops
    from training.metrics import model_flops_per_iteration

    info = common.machine_info()
    cfg = project_config(args)
    padded = padded_vocab_size(args.vocab, cfg.model.make_vocab_size_divisible_by, 1)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    runners = build_runners(args, cfg, padded, tokens, labels)
    if args.profile:
        profile(runners, args.profile, args.profile_rows)
        return

    for r in runners.values():
        for _ in range(args.warmup):
            r.step()
    clocks = {name: common.CpuClock(lambda r=r: common.timed(r.step, args.steps), args.steps)
              for name, r in runners.items()}
    candidates: dict = dict(clocks)
    peak_fn = getattr(measure_cpu_peak_tflops, "__wrapped__", measure_cpu_peak_tflops)
    candidates["peak"] = lambda: peak_fn("fp32")  # TFLOP/s, fresh each repetition
    samples = common.interleaved(candidates, args.reps)

    flops = model_flops_per_iteration(args.batch, args.seq, args.layers, args.hidden, padded)
    ntok = args.batch * args.seq
    peak = samples["peak"]
    rows = []
    for name in runners:
        t = samples[name]
        mfu = common.Samples([flops / dt / 1e12 / pk for dt, pk in zip(t.values, peak.values)])
        rows.append([name, t.fmt(".3f"), common.Samples([ntok / x for x in t.values]).fmt(",.0f"),
                     common.Samples([flops / x / 1e9 for x in t.values]).fmt(".1f"), mfu.fmt(".1f", 100),
                     f"{100 * flops / t.lo / 1e12 / peak.hi:.1f}", clocks[name].cpu.fmt(".2f")])
    print()
    print(common.markdown_header(info, common.load_average()))
    print(f"- model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, micro=global "
          f"batch {args.batch}, vocab {args.vocab} padded to {padded} (both models), dropout {args.dropout}, fp32, "
          f"{args.threads} threads; {args.reps} interleaved repetitions x {args.steps} steps after {args.warmup} "
          f"warm-up; gradient clipping {'on' if args.clip else 'off'}")
    print(f"- model FLOPs per step: {flops / 1e9:.1f} GFLOP; measured fp32 matmul peak (n=1024): "
          f"{peak.fmt('.1f', 1000)} GFLOP/s. MFU per rep = step rate / the peak measured in the same repetition "
          f"(moments apart: on a loaded machine it can exceed 100 %); best/best = fastest step / highest peak")
    print()
    print(common.markdown_table(["model", "s/step median [min-max]", "tokens/s", "GFLOP/s",
                                                 "MFU % (per rep)", "MFU % best/best", "process CPU s/step"], rows))
    if "ours" in runners and "hf" in runners:
        speed = common.ratio_samples(samples["hf"], samples["ours"])
        print(f"\nSpeed-up ours/HF (HF step time / ours, per repetition): {speed.fmt('.3f')}; "
              f"by process CPU time: {common.ratio_samples(clocks['hf'].cpu, clocks['ours'].cpu).fmt('.3f')}")
        if "ours+tweaks" in runners:
            tw = common.ratio_samples(samples["hf"], samples["ours+tweaks"])
            print(f"Speed-up ours+tweaks/HF: {tw.fmt('.3f')}; ours+tweaks/ours: "
                  f"{common.ratio_samples(samples['ours'], samples['ours+tweaks']).fmt('.3f')}")


if __name__ == "__main__":
    main()
