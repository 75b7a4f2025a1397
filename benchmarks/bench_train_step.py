"""Training-step benchmark: our GPT-2 or Llama-style model (TP=1) against Hugging Face's, on CPU or one GPU.

``--model gpt2`` (default): our GPT-2 against ``GPT2LMHeadModel``. ``--model llama``: our GPT with the Llama
options (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output, no biases; the shape of
``configs/llama_tiny.yaml``, or ``--preset llama-1b`` = ``configs/llama_1b.yaml``, tied as that config is) against
``LlamaForCausalLM`` of the same shape holding the same weights (``training.tools.hf_llama.to_hf``), so the first
step's losses must agree (checked before timing; the run stops if they differ). HF's loss is its own
``ForCausalLMLoss`` given ``shift_labels`` = our labels, i.e. over the same s positions as ours.

Both models have the same dimensions, dtype, batch, sequence, dropout and activation (exact erf
GELU), and the same padded vocabulary (HF's ``vocab_size`` is set to our padded size so both do the
same FLOPs). Both run under the project's engine (``training.optim.engine.build_engine``) with the same DeepSpeed config
(``training.ds_json.deepspeed_config``: fp32, bf16, or fp16 with dynamic loss scaling), the same
fused AdamW and schedule (``training.optim.adamw``), and the same engine setting the trainer uses at one
data-parallel replica (no gradient all-reduce of a replica with itself): only the model differs.
One step = forward (mean token loss), ``engine.backward``, ``engine.step``. HF runs with
``attn_implementation="sdpa"`` and computes its own shifted loss from ``labels=tokens``.

Repetitions are interleaved (ours, HF, matmul peak; rotated each repetition); each repetition
times ``--steps`` steps after ``--warmup`` untimed ones. MFU = model FLOPs per step
(``training.plan.accounting.flops_per_iteration``: GPT-2, or Llama with GQA and SwiGLU; no recomputation counted) / step time / peak. On
CPU the peak is the dense matmul FLOP/s measured in the same repetition
(``training.runtime.hardware.measure_cpu_peak_tflops``); on a GPU it is the data-sheet dense peak of the
dtype (``training.runtime.hardware``), and the measured large-matmul rate is reported beside it.

    .venv/bin/python -m benchmarks.bench_train_step --reps 5 --steps 2
    .venv/bin/python -m benchmarks.bench_train_step --profile 3        # torch.profiler tables instead
    .venv/bin/python -m benchmarks.bench_train_step --model llama --reps 5 --steps 2 --counts 2
    .venv/bin/python -m benchmarks.bench_train_step --dtype fp16 --dtype-ab bf16 --step-ab --only ours --counts 2
    python -m benchmarks.bench_train_step --device cuda --dtype fp16 --adam fused --adam-ab --only ours  # FusedAdam A/B
    python -m benchmarks.bench_train_step --device cuda --dtype fp16 --preset gpt2-1.2b --reps 5 --steps 5
"""
from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from typing import TYPE_CHECKING

import torch

from benchmarks import common

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from training.parallel.state import ParallelState

log = logging.getLogger("bench_train_step")

# the Megatron-LM paper's single-GPU baseline (Shoeybi et al. 2019, Table 1; configs/gpt2_1.2b.yaml),
# micro-batch 8 as in that config
PRESETS = {"gpt2-1.2b": dict(layers=40, hidden=1536, heads=16, seq=1024, batch=8, vocab=50257),
           # configs/llama_1b.yaml (Llama 3.2 1B's shape), micro-batch 2 as in that config
           "llama-1b": dict(layers=16, hidden=2048, heads=32, kv_groups=8, seq=4096, batch=2, vocab=128256)}
PRESET_MODEL = {"gpt2-1.2b": "gpt2", "llama-1b": "llama"}
DEFAULTS = dict(layers=6, hidden=384, heads=6, seq=256, batch=4, vocab=50257)
# configs/llama_tiny.yaml's shape (3 layers, hidden 96, 6 heads in 2 key/value groups, seq 64), GPT-2's vocabulary
LLAMA_DEFAULTS = dict(layers=3, hidden=96, heads=6, kv_groups=2, seq=64, batch=4, vocab=50257)
LLAMA_CONFIGS = {None: "configs/llama_tiny.yaml", "llama-1b": "configs/llama_1b.yaml"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:  # noqa: C901
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt2", "llama"], default=None,
                   help="gpt2 (default): ours vs GPT2LMHeadModel; llama: our Llama-style GPT vs LlamaForCausalLM "
                        "(same weights, first-step losses checked equal); a preset implies its model")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model dimensions and micro-batch of a named model (explicit flags below override them)")
    p.add_argument("--layers", type=int, default=None, help=f"default {DEFAULTS['layers']}")
    p.add_argument("--hidden", type=int, default=None, help=f"default {DEFAULTS['hidden']}")
    p.add_argument("--heads", type=int, default=None, help=f"default {DEFAULTS['heads']}")
    p.add_argument("--kv-groups", type=int, default=None,
                   help="--model llama: key/value head groups (GQA), default that of the model's config")
    p.add_argument("--seq", type=int, default=None, help=f"default {DEFAULTS['seq']}")
    p.add_argument("--batch", type=int, default=None,
                   help=f"micro = global batch (one micro-batch per step), default {DEFAULTS['batch']}")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"unpadded vocabulary (padded to a multiple of 128), default {DEFAULTS['vocab']}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="DeepSpeed precision mode of both engines (fp16 = dynamic loss scaling)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer in backward (ours: model.activation_checkpointing; HF: "
                        "gradient_checkpointing_enable); MFU still counts model FLOPs only")
    p.add_argument("--dropout", type=float, default=None,
                   help="hidden, attention and embedding dropout, both models (default 0.1 for gpt2; llama: 0 only, "
                        "as Llama trains and since HF's Llama has no hidden dropout)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", action="store_true",
                   help="also clip the gradient norm as training/trainer.py does in fp32 (DeepSpeed clip_grad_norm_)")
    p.add_argument("--only", choices=["ours", "hf"], default=None, help="time one model only")
    p.add_argument("--engine-default", action="store_true",
                   help="add a third candidate 'ours (engine default)': our model with DeepSpeed's default "
                        "gradient all-reduce at DP=1 left on, to show what the trainer's setting saves")
    p.add_argument("--step-ab", action="store_true",
                   help="add a candidate 'ours (DeepSpeed step)': our model with DeepSpeed's own fp16/bf16 optimizer "
                        "step (a loop over tensors, a host sync each) instead of training.optim.mixed_precision's")
    p.add_argument("--compile", action="store_true",
                   help="add a candidate 'ours (compiled)': our model with every transformer layer compiled "
                        "(model.compile, training/models/compile_layers.py; inductor)")
    p.add_argument("--adam", choices=["auto", "torch", "fused"], default="auto",
                   help="AdamW of every engine: torch's fused AdamW, DeepSpeed's FusedAdam (CUDA; DeepSpeed then "
                        "uses its fused FP16_Optimizer), or auto = what the trainer picks (FusedAdam for fp16 on CUDA)")
    p.add_argument("--adam-ab", action="store_true",
                   help="add a candidate 'ours (torch AdamW)' or 'ours (FusedAdam)': our model with the other AdamW "
                        "than --adam resolves to, same dtype, same O(1) step. Needs --device cuda (DeepSpeed's "
                        "FusedAdam is a CUDA kernel; on CPU it is refused, torch's AdamW being the only one there)")
    p.add_argument("--dtype-ab", choices=["fp32", "bf16", "fp16"], default=None, metavar="DTYPE",
                   help="add a candidate 'ours (DTYPE)': our model under DTYPE's DeepSpeed config (AdamW as --adam "
                        "picks it for DTYPE), e.g. --dtype fp16 --dtype-ab bf16; its MFU is against DTYPE's peak")
    p.add_argument("--counts", type=int, default=0, metavar="STEPS",
                   help="after timing, count per step the operators dispatched (kernel launches on CUDA) and "
                        "the device-to-host syncs of each candidate (benchmarks.host_work; on CUDA also "
                        "torch.profiler's kernel launches and synchronisations), over STEPS steps")
    p.add_argument("--json", type=str, default=None, metavar="PATH",
                   help="also write each candidate's median s/step, TFLOP/s and MFU to PATH (JSON; scripts/gpu_check's "
                        "1.2B row reads HF's from it)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="instead of timing, profile STEPS steps of each model and print the top operators")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args(argv)
    implied = PRESET_MODEL.get(args.preset)
    if args.model is not None and implied is not None and args.model != implied:
        p.error(f"--preset {args.preset} is a {implied} model, not --model {args.model}")
    args.model = args.model or implied or "gpt2"
    if args.model == "gpt2" and args.kv_groups is not None:
        p.error("--kv-groups needs --model llama (GPT-2 has one key/value head per query head)")
    base = {**(LLAMA_DEFAULTS if args.model == "llama" else DEFAULTS), **PRESETS.get(args.preset, {}),
            "dropout": 0.0 if args.model == "llama" else 0.1}
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "threads", "reps", "steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.model == "llama":
        if args.kv_groups < 1 or args.heads % args.kv_groups:
            p.error(f"--kv-groups {args.kv_groups} must divide --heads {args.heads}")
        if args.dropout:
            p.error("--model llama: --dropout must be 0 (Hugging Face's Llama has no hidden dropout, so the two "
                    "models would not compute the same step)")
    if args.dtype_ab == args.dtype:
        p.error(f"--dtype-ab {args.dtype_ab} is --dtype itself: name the other precision to compare")
    if args.adam_ab and args.device != "cuda":
        raise SystemExit("bench_train_step: --adam-ab needs --device cuda (DeepSpeed's FusedAdam is a CUDA kernel; "
                         "on CPU torch's AdamW is the only candidate)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if "bf16" in (args.dtype, args.dtype_ab) and args.device == "cuda" and not torch.cuda.is_bf16_supported():
        p.error("bf16: this GPU has no bf16 support; use fp16")
    return args


def project_config(args):
    from training.config import Config
    from training.models.config import ModelConfig

    cfg = Config()
    if getattr(args, "model", "gpt2") == "llama":
        cfg.model = llama_model_config(args)
    else:
        cfg.model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=args.dropout,
                                attention_dropout=args.dropout, activation_checkpointing=args.activation_checkpointing)
    cfg.precision.dtype = args.dtype
    cfg.precision.allow_fp16_on_cpu = args.device == "cpu" and args.dtype == "fp16"
    cfg.train.micro_batch_size = cfg.train.global_batch_size = args.batch
    cfg.train.iters = 10**6
    return cfg


def llama_model_config(args):
    """The model section of the Llama config (``configs/llama_tiny.yaml``, or ``llama_1b.yaml`` for that preset)
    with the benchmark's dimensions: RoPE base, RMSNorm epsilon, tying and biases from the file; the SwiGLU width
    from the file for its own hidden size, else Llama's rule (2/3 x 4h rounded up to 256)."""
    import dataclasses
    from pathlib import Path

    from training.config import load_config

    root = Path(__file__).resolve().parents[1]
    m = load_config(root / LLAMA_CONFIGS.get(args.preset, LLAMA_CONFIGS[None])).model
    ffn = m.ffn_hidden_size if args.hidden == m.hidden_size else None
    return dataclasses.replace(m, num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_query_groups=None if args.kv_groups == args.heads else args.kv_groups,
                               ffn_hidden_size=ffn, seq_length=args.seq, max_position_embeddings=None,
                               vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0,
                               activation_checkpointing=args.activation_checkpointing, recompute="none")


class Runner:
    """One model under its own DeepSpeed engine; ``step()`` = forward, backward, optimizer step."""

    def __init__(self, name: str, engine: DeepSpeedEngine, model, loss_fn, tokens, labels, clip: float,
                 mpu: ParallelState | None = None):
        self.name, self.engine, self.model, self.loss_fn = name, engine, model, loss_fn
        self.tokens, self.labels, self.clip, self.mpu = tokens, labels, clip, mpu
        self.static_bytes = 0  # GPU memory the engine holds between steps (weights, grads, optimizer state)
        self.first_loss: float | None = None  # the loss of the first step this runner took
        self.dtype: str | None = None  # a precision other than --dtype's (--dtype-ab)

    def warm_up(self, steps: int, max_steps: int = 64) -> int:
        """At least ``steps`` steps, continued (up to ``max_steps``) until the last two were both applied: a
        step fp16 loss scaling skips does no optimizer update and must not be timed, and the first applied step
        sits at the edge of overflow (the scale was halved just before it). Returns the steps taken."""
        n = applied = 0
        while n < max_steps:
            before = self.skipped()
            self.step()
            n += 1
            applied = applied + 1 if self.skipped() == before else 0
            if n >= steps and applied >= 2:
                break
        return n

    def skipped(self) -> int:
        """Optimizer steps skipped so far for fp16 overflow (0 without loss scaling); skips the device decided are
        read and settled (one host read)."""
        return self.engine.settle_pending_skips()

    def timed_applied(self, steps: int, max_extra: int = 32) -> float:
        """Mean seconds of ``steps`` applied steps: a step that fp16 loss scaling skips (no optimizer update,
        so faster) is run but not timed, and another is run in its place (at most ``max_extra`` such). Each
        step ends in ``loss.item()``, which waits for the GPU, so each is timed on its own."""
        times: list[float] = []
        extra = 0
        while len(times) < steps:
            before = self.skipped()
            t0 = time.perf_counter()
            self.step()
            dt = time.perf_counter() - t0
            if self.skipped() == before:
                times.append(dt)
            else:
                extra += 1
                if extra > max_extra:
                    raise RuntimeError(f"{self.name}: {extra} fp16 steps skipped while timing; the loss scale "
                                       "does not settle (raise --warmup or lower the initial scale)")
        return sum(times) / len(times)

    def step(self, read: bool = True) -> float | None:
        """One step; ``read``: end it by reading the loss (waits for the device)."""
        from deepspeed.runtime.utils import clip_grad_norm_

        loss = self.loss_fn(self.engine, self.tokens, self.labels)
        if self.first_loss is None:
            self.first_loss = loss.item()
        self.engine.backward(loss)
        if self.clip:
            clip_grad_norm_(self.model.parameters(), self.clip, mpu=self.mpu)
        self.engine.step()
        return loss.item() if read else None


def tied_safe_optimizer(model, ocfg, iters: int, fused: bool = False, adam: str = "torch"):
    """``training.optim.adamw.build_optimizer``'s AdamW and schedule, with each parameter listed once.

    ``training.optim.adamw.param_groups`` walks modules, so a weight tied across two modules (HF's
    ``lm_head.weight is transformer.wte.weight``) would be listed twice and DeepSpeed rejects that.
    ``adam="fused"``: DeepSpeed's FusedAdam (AdamW mode) instead of torch's AdamW.
    """
    from training.optim.adamw import param_groups
    from training.optim.lr_schedule import DeviceLRSchedule, lr_at

    seen: set[int] = set()
    groups = []
    for g in param_groups(model, ocfg.weight_decay):
        params = [p for p in g["params"] if id(p) not in seen and not seen.add(id(p))]
        groups.append({**g, "params": params})
    if adam == "fused":
        from deepspeed.ops.adam import FusedAdam

        from training.runtime.gpu_settings import deepspeed_buildable_arch_list

        with deepspeed_buildable_arch_list():
            opt = FusedAdam(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, adam_w_mode=True)
    else:
        opt = torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=fused or None)
        if fused:  # the step decides skips on the device: the trainer's device schedule counts them there
            return opt, DeviceLRSchedule(opt, ocfg, iters)
    # FusedAdam and unfused AdamW read the skip on the host and take a Python-float rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_at(it, ocfg, iters) / ocfg.lr)
    return opt, sched


ADAM_NAMES = {"fused": "FusedAdam", "torch": "torch AdamW"}


def adam_for(device: str, dtype: str, adam: str) -> str:
    """'fused' or 'torch': ``adam`` itself, or for 'auto' what the trainer picks for ``dtype`` on ``device``
    (torch's fused AdamW everywhere since issue 40)."""
    if adam != "auto":
        return adam
    from training.runtime.gpu_settings import settings_for

    kind = settings_for(device, dtype).optimizer
    return "fused" if kind == "deepspeed_fused_adam" else "torch"


def build_runners(args, cfg, padded: int, tokens, labels) -> dict[str, Runner]:  # noqa: C901
    from transformers import GPT2Config, GPT2LMHeadModel

    from training.ds_json import deepspeed_config
    from training.models.gpt2 import GPTModel
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ds = deepspeed_config(cfg, 1, args.dtype)
    clip = cfg.optimizer.clip_grad if args.clip else 0.0
    runners: dict[str, Runner] = {}
    ps = ParallelState(tp=1)
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(cfg.train.seed)

    def engine(model, mpu: ParallelState | None = None, backward_allreduce=False, o1_step=True, ds=ds,
               adam=args.adam):
        opt, sched = tied_safe_optimizer(model, cfg.optimizer, cfg.train.iters, fused=True, adam=adam)
        # as the trainer (training.optim.engine): no zero-gradient Adam step from construction, the project's
        # optimizer step (o1_step=False: DeepSpeed's own), the all-reduce of one replica with itself off
        eng = build_engine(model, opt, sched, dict(ds), mpu, own_step=o1_step)
        eng.enable_backward_allreduce = backward_allreduce
        return eng

    def gpu_bytes() -> int:
        return torch.cuda.memory_allocated() if args.device == "cuda" else 0

    ours_loss = lambda e, t, l: e(t, l).mean()  # noqa: E731
    llama = getattr(args, "model", "gpt2") == "llama"  # ours: the Llama options come with cfg.model
    if args.only in (None, "ours"):
        before = gpu_bytes()
        ours = GPTModel(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        runners["ours"] = Runner("ours", engine(ours, ps), ours, ours_loss, tokens, labels, clip, ps)
        runners["ours"].static_bytes = gpu_bytes() - before
    if args.step_ab:
        before = gpu_bytes()
        m = GPTModel(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        runners["ours (DeepSpeed step)"] = Runner("ours (DeepSpeed step)", engine(m, ps, o1_step=False), m, ours_loss,
                                                  tokens, labels, clip, ps)
        runners["ours (DeepSpeed step)"].static_bytes = gpu_bytes() - before
    if args.compile:
        from training.models.compile_layers import compile_layers

        before = gpu_bytes()
        m = GPTModel(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        compile_layers(m)
        runners["ours (compiled)"] = Runner("ours (compiled)", engine(m, ps), m, ours_loss, tokens, labels, clip, ps)
        runners["ours (compiled)"].static_bytes = gpu_bytes() - before
    if getattr(args, "adam_ab", False):
        other = "torch" if args.adam == "fused" else "fused"
        name = f"ours ({ADAM_NAMES[other]})"
        before = gpu_bytes()
        m = GPTModel(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        runners[name] = Runner(name, engine(m, ps, adam=other), m, ours_loss, tokens, labels, clip, ps)
        runners[name].static_bytes = gpu_bytes() - before
    if getattr(args, "dtype_ab", None):
        d = args.dtype_ab
        cfg_d = project_config(argparse.Namespace(**{**vars(args), "dtype": d}))
        name = f"ours ({d})"
        before = gpu_bytes()
        m = GPTModel(cfg_d.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        runners[name] = Runner(name, engine(m, ps, ds=deepspeed_config(cfg_d, 1, d),
                                           adam=getattr(args, "dtype_ab_adam", None) or args.adam),
                               m, ours_loss, tokens, labels, clip, ps)
        runners[name].dtype = d
        runners[name].static_bytes = gpu_bytes() - before
    if args.engine_default:
        before = gpu_bytes()
        m = GPTModel(cfg.model, padded, ps.tp_group, seed=cfg.train.seed).train()
        runners["ours (engine default)"] = Runner("ours (engine default)", engine(m, ps, backward_allreduce=True), m,
                                                  ours_loss, tokens, labels, clip, ps)
        runners["ours (engine default)"].static_bytes = gpu_bytes() - before
    if args.only in (None, "hf"):
        before = gpu_bytes()
        if llama:
            hf = hf_llama_same_weights(cfg, padded, args.activation_checkpointing)
            # HF's own loss over the same s positions as ours: shift_labels = our (already shifted) labels
            hf_loss = lambda e, t, l: e(input_ids=t, labels=l, shift_labels=l).loss  # noqa: E731
        else:
            hcfg = GPT2Config(vocab_size=padded, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                              n_head=args.heads, activation_function="gelu", resid_pdrop=args.dropout,
                              embd_pdrop=args.dropout, attn_pdrop=args.dropout, layer_norm_epsilon=1e-5,
                              initializer_range=0.02)
            torch.manual_seed(cfg.train.seed)
            hf = GPT2LMHeadModel._from_config(hcfg, attn_implementation="sdpa").train()
            if args.activation_checkpointing:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # HF shifts internally: labels = the input ids (loss over s-1 positions, logits over all s)
            hf_loss = lambda e, t, l: e(input_ids=t, labels=t).loss  # noqa: E731
        assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
        runners["hf"] = Runner("hf", engine(hf), hf, hf_loss, tokens, labels, clip)
        runners["hf"].static_bytes = gpu_bytes() - before
    return runners


def hf_llama_same_weights(cfg, padded: int, activation_checkpointing: bool):
    """``LlamaForCausalLM`` (sdpa attention) of ``cfg.model``'s shape with our model's initial weights (ours built
    from the same seed, mapped by ``training.tools.hf_llama.to_hf``; strict load), vocabulary ``padded``."""
    from transformers import LlamaForCausalLM

    from training.models.gpt2 import GPTModel
    from training.tools.hf_llama import hf_config, to_hf

    ref = GPTModel(cfg.model, padded, None, seed=cfg.train.seed)
    weights = to_hf(ref.state_dict(), cfg.model, padded)
    del ref
    hf = LlamaForCausalLM._from_config(hf_config(cfg.model, padded), attn_implementation="sdpa")
    hf.load_state_dict(weights, strict=True)
    if activation_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf.train()


def check_first_losses(first: dict[str, float], dtype: str) -> str:
    """--model llama: ours and HF hold the same weights, so their first-step losses must agree (fp32 to 1e-4
    relative, bf16/fp16 to 2e-2). Returns the report line; raises SystemExit when they differ."""
    ours, hf = first["ours"], first["hf"]
    tol = 1e-4 if dtype == "fp32" else 2e-2
    diff = abs(ours - hf)
    ok = diff <= tol * max(1.0, abs(ours))
    line = (f"First-step loss (same weights): ours {ours:.6f}, HF {hf:.6f}, |diff| {diff:.2e} "
            f"({'equal' if ok else 'DIFFERENT'} within {tol:g} relative)")
    if not ok:
        raise SystemExit(f"bench_train_step: {line}")
    return line


LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemsetAsync",
                 "cudaMemcpyAsync")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def count(runners: dict[str, Runner], steps: int, device: str = "cpu") -> list[list[str]]:
    """Per step of each candidate (after warm-up, applied steps only, no loss read): operators dispatched, kernel
    operators (no views), device-to-host syncs (benchmarks.host_work); on CUDA also the runtime's kernel
    launches and synchronisations seen by torch.profiler."""
    from benchmarks.host_work import HostWork

    rows = []
    for name, r in runners.items():
        r.warm_up(2)
        skipped = r.skipped()
        with HostWork() as w:
            for _ in range(steps):
                r.step(read=False)
        row = [name, f"{w.total / steps:,.0f}", f"{w.kernels / steps:,.0f}", f"{w.syncs / steps:.1f}"]
        if name == "ours (compiled)":  # dynamo runs no compiled frame under a TorchDispatchMode: these are eager's
            row[1:4] = ["n/a"] * 3
        if device == "cuda":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprofile

            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    r.step(read=False)
                torch.cuda.synchronize()
            ev = {e.key: e.count for e in prof.key_averages()}
            launches = sum(ev.get(k, 0) for k in LAUNCH_EVENTS)
            syncs = sum(ev.get(k, 0) for k in SYNC_EVENTS) - 1  # less the one ending the measurement
            row += [f"{launches / steps:,.0f}", f"{syncs / steps:.1f}"]
        row.append(str(r.skipped() - skipped))
        rows.append(row)
    return rows


def profile(runners: dict[str, Runner], steps: int, rows: int, device: str = "cpu") -> None:
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as tprofile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for name, r in runners.items():
        r.warm_up(2)  # past fp16's skipped steps: a skipped step has no optimizer work to profile
        skipped = r.skipped()
        sync()
        t0 = time.perf_counter()
        with tprofile(activities=activities, record_shapes=False) as prof:
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
        sync()
        wall = (time.perf_counter() - t0) / steps
        print(f"\n=== {name}: {steps} steps ({wall * 1e3:.1f} ms each, profiler on; {r.skipped() - skipped} skipped by "
              f"fp16 loss scaling), operators by {sort.replace('_', ' ')} ===")
        if device == "cuda":
            print("(GPU busy share of a step = 'Self CUDA time total' below / steps / the step time above)")
        print(prof.key_averages().table(sort_by=sort, row_limit=rows))
        print(f"=== {name}: phases (total CPU time) ===")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))


def main(argv: list[str] | None = None) -> None:  # noqa: C901
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["DS_ACCELERATOR"] = args.device  # before deepspeed is imported
    common.init_single_process(args.device)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from training.models.config import padded_vocab_size
    from training.plan.accounting import flops_per_iteration
    from training.runtime.hardware import detect_device_kind, measure_cpu_peak_tflops, peak_tflops

    if args.device == "cpu" and "fp16" in (args.dtype, args.dtype_ab):
        from training.resolve import allow_fp16_on_cpu

        allow_fp16_on_cpu()  # slow (no fp16 matmul units here); exercises the fp16 engine path
    if args.adam == "fused" and args.device != "cuda":
        raise SystemExit("bench_train_step: --adam fused needs --device cuda (DeepSpeed's FusedAdam is a CUDA kernel)")
    if args.dtype_ab:
        args.dtype_ab_adam = adam_for(args.device, args.dtype_ab, args.adam)
    args.adam = adam_for(args.device, args.dtype, args.adam)
    info = common.machine_info(gpu=args.device == "cuda")
    cfg = project_config(args)
    padded = padded_vocab_size(args.vocab, cfg.model.make_vocab_size_divisible_by, 1)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    runners = build_runners(args, cfg, padded, tokens, labels)
    if args.profile:
        profile(runners, args.profile, args.profile_rows, args.device)
        return
    warm = {name: r.warm_up(args.warmup) for name, r in runners.items()}
    first_line = (check_first_losses({k: runners[k].first_loss for k in ("ours", "hf")}, args.dtype)
                  if args.model == "llama" and {"ours", "hf"} <= set(runners) else None)
    skipped_before = {name: r.skipped() for name, r in runners.items()}
    clocks = {name: common.CpuClock(lambda r=r: r.timed_applied(args.steps), args.steps)
              for name, r in runners.items()}
    memory = {name: common.Samples() for name in runners}
    candidates: dict = {}
    for name, clock in clocks.items():
        candidates[name] = clock if args.device == "cpu" else common.with_peak_gpu_memory(clock, memory[name])
    dtypes = [args.dtype] + ([args.dtype_ab] if args.dtype_ab else [])  # each candidate's MFU uses its dtype's peak
    if args.device == "cpu":
        peak_fn = getattr(measure_cpu_peak_tflops, "__wrapped__", measure_cpu_peak_tflops)
        for d in dtypes:
            candidates[f"peak {d}"] = lambda d=d: peak_fn(d)  # TFLOP/s, fresh each repetition
        peak_what = f"measured {' and '.join(dtypes)} matmul peak (n=1024, same repetition)"
    else:
        kind = detect_device_kind()
        sheets = {d: peak_tflops(kind, d) for d in dtypes}
        for d, sheet in sheets.items():
            if sheet is None:
                raise SystemExit(f"no data-sheet {d} peak for device kind {kind!r} in training/runtime/hardware.py")
        candidates["matmul"] = lambda: common.gpu_matmul_tflops(args.dtype)
        peak_what = ", ".join(f"data-sheet dense {d} peak of {kind}: {sheets[d]:.1f} TFLOP/s" for d in dtypes)
    samples = common.interleaved(candidates, args.reps)
    peaks = {d: samples[f"peak {d}"] if args.device == "cpu" else common.Samples([sheets[d]] * args.reps)
             for d in dtypes}

    flops = flops_per_iteration(cfg, padded)  # GPT-2's count, or with the Llama MLP width, GQA and SwiGLU
    ntok = args.batch * args.seq
    rate_unit, rate_name = (1e9, "GFLOP/s") if args.device == "cpu" else (1e12, "TFLOP/s")
    rows, medians = [], {}
    for name in runners:
        t, peak = samples[name], peaks[runners[name].dtype or args.dtype]
        medians[name] = {"step_time_s": t.median, "tflops": flops / t.median / 1e12,
                         "mfu": flops / t.median / 1e12 / peak.median, "dtype": runners[name].dtype or args.dtype}
        mfu = common.Samples([flops / dt / 1e12 / pk for dt, pk in zip(t.values, peak.values)])
        row = [name, t.fmt(".3f"), common.Samples([ntok / x for x in t.values]).fmt(",.0f"),
               common.Samples([flops / x / rate_unit for x in t.values]).fmt(".1f"),
               mfu.fmt(".1f", 100), f"{100 * flops / t.lo / 1e12 / peak.hi:.1f}"]
        if args.device == "cpu":
            row += [clocks[name].cpu.fmt(".2f"), clocks[name].sys.fmt(".2f"), clocks[name].faults.fmt(",.0f")]
        else:
            row += [f"{runners[name].static_bytes / 2**30:.1f}", memory[name].fmt(".1f", 2**-30)]
        row.append(f"{warm[name]} ({runners[name].skipped()})"
                   + (f", {runners[name].skipped() - skipped_before[name]} more while timing (re-run, not timed)"
                      if runners[name].skipped() > skipped_before[name] else ""))
        rows.append(row)
    print()
    print(common.markdown_header(info, common.load_average()))
    if args.model == "llama":
        m = cfg.model
        print(f"- Llama-style (ours: RoPE base {m.rotary_base:g}, RMSNorm, SwiGLU MLP {m.ffn_size}, "
              f"{m.query_groups} key/value groups, output layer "
              f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'}, no biases; HF: LlamaForCausalLM, "
              f"sdpa, the same initial weights)")
    print(f"- model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, micro=global "
          f"batch {args.batch}, vocab {args.vocab} padded to {padded} (both models), dropout {args.dropout}, "
          f"{args.dtype} on {args.device}, activation checkpointing {'on' if args.activation_checkpointing else 'off'}"
          f"{f', {args.threads} threads' if args.device == 'cpu' else ''}; {args.reps} interleaved repetitions x "
          f"{args.steps} steps after {args.warmup} warm-up; extra gradient clipping {'on' if args.clip else 'off'}; "
          f"AdamW {args.adam}" + (f"; candidate 'ours ({args.dtype_ab})' in {args.dtype_ab} with AdamW "
                                  f"{args.dtype_ab_adam}" if args.dtype_ab else ""))
    peak = peaks[args.dtype]
    print(f"- model FLOPs per step: {flops / 1e12:.4g} TFLOP; peak: {peak_what}"
          + (" = " + " and ".join(f"{peaks[d].fmt('.4f')}" for d in dtypes) + " TFLOP/s" if args.device == "cpu" else
             f"; measured {args.dtype} matmul 8192^3: {samples['matmul'].fmt('.1f')} TFLOP/s")
          + ". MFU per rep = step rate / peak; best/best = fastest step / highest peak")
    print()
    last = (["process CPU s/step", "system s/step", "page faults/step"] if args.device == "cpu"
            else ["engine GPU memory GiB", "step peak above it GiB"]) + ["warm-up steps (fp16 skipped)"]
    print(common.markdown_table(["model", "s/step median [min-max]", "tokens/s", rate_name,
                                 "MFU % (per rep)", "MFU % best/best", *last], rows))
    if args.device == "cpu":
        print(f"\nTHP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')} (huge pages for large CPU "
              f"allocations; set by training.runtime.process_env.configure(), override with THP_MEM_ALLOC_ENABLE=0)")
    if first_line:
        print(f"\n{first_line}")
    if "ours" in runners and "hf" in runners:
        speed = common.ratio_samples(samples["hf"], samples["ours"])
        line = f"\nSpeed-up ours/HF (HF step time / ours, per repetition): {speed.fmt('.3f')}"
        if args.device == "cpu":
            line += f"; by process CPU time: {common.ratio_samples(clocks['hf'].cpu, clocks['ours'].cpu).fmt('.3f')}"
        print(line)
    if "ours" in runners and "ours (DeepSpeed step)" in runners:
        print(f"O(1) optimizer step vs DeepSpeed's (DeepSpeed-step time / ours): "
              f"{common.ratio_samples(samples['ours (DeepSpeed step)'], samples['ours']).fmt('.3f')}")
    if "ours" in runners and "ours (compiled)" in runners:
        print(f"Compiled layers vs eager (eager step time / compiled): "
              f"{common.ratio_samples(samples['ours'], samples['ours (compiled)']).fmt('.3f')}")
    if "ours" in runners and args.dtype_ab:
        d = args.dtype_ab
        print(f"{args.dtype} vs {d} ({d} step time / {args.dtype}'s, ours): "
              f"{common.ratio_samples(samples[f'ours ({d})'], samples['ours']).fmt('.3f')}")
    if "ours" in runners and args.adam_ab:
        other = "torch" if args.adam == "fused" else "fused"
        print(f"{ADAM_NAMES[args.adam]} vs {ADAM_NAMES[other]} ({ADAM_NAMES[other]} step time / "
              f"{ADAM_NAMES[args.adam]}'s, ours, {args.dtype}): "
              f"{common.ratio_samples(samples[f'ours ({ADAM_NAMES[other]})'], samples['ours']).fmt('.3f')}")
    if "ours" in runners and "ours (engine default)" in runners:
        print(f"Trainer's engine setting vs DeepSpeed's default (engine default step time / ours): "
              f"{common.ratio_samples(samples['ours (engine default)'], samples['ours']).fmt('.3f')}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": args.device, "batch": args.batch, "seq": args.seq, "layers": args.layers,
                       "vocab_padded": padded, "adam": args.adam, "rows": medians}, f, indent=1)
    if args.counts:
        print_counts(args, runners, info)

def print_counts(args, runners: dict[str, Runner], info: dict) -> None:
    head = ["model", "operators/step", "kernel operators/step", "host syncs/step"]
    if args.device == "cuda":
        head += ["CUDA launches/step (profiler)", "CUDA syncs/step (profiler)"]
    print()
    print(f"Host work per step: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.dtype} on {args.device}, AdamW {args.adam}; {args.counts} steps per candidate after warm-up, no "
          f"loss read")
    print()
    print(common.markdown_table(head + ["skipped while counting"], count(runners, args.counts, args.device)))
    if "ours (compiled)" in runners:
        print("\nours (compiled): n/a = not countable by benchmarks.host_work (torch.compile runs no compiled frame "
              "under a TorchDispatchMode, so the layers would run eagerly)"
              + ("; the profiler columns count the compiled kernels" if args.device == "cuda" else ""))


if __name__ == "__main__":
    main()
