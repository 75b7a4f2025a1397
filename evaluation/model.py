"""Checkpoint -> scorer: loads a run directory (any training TP degree) for evaluation at TP = k.

Single process: ``k = 1``. Under ``deepspeed --module evaluation ...`` (or torchrun) with W processes
and ``--tp k``: ``W / k`` data-parallel replicas, each example/window scored on exactly one of them,
logits stay vocabulary-parallel (see :mod:`evaluation.scoring`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from evaluation.errors import EvalError
from evaluation.scoring import gpt2_scorer
from evaluation.tasks import DataParallel
from training.checkpoint_reader import load_model_for_eval
from training.layout import data_parallel_size, launched_world_size
from training.parallel.utils import vocab_range
from training.runtime import device as tdev
from training.runtime.distributed import init_distributed

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    pstate: object | None
    dp: DataParallel
    device: torch.device
    is_main: bool


def setup_runtime(tp: int = 1, device: str | None = None) -> Runtime:
    """Initialise torch.distributed, through the training runtime, when launched with several processes."""
    world = launched_world_size()
    if tp < 1:
        raise EvalError(f"--tp must be >= 1, got {tp}")
    data_parallel_size(world, tp, flags=True)  # before any process group exists
    # the accelerator's device for LOCAL_RANK unless --device says otherwise; bound before any group
    dev = torch.device(device) if device else tdev.local_device()
    tdev.set_local_device(dev)
    if world == 1 and tp == 1:
        return Runtime(None, DataParallel(), dev, True)
    if not dist.is_initialized():
        init_distributed("nccl" if dev.type == "cuda" else "gloo")
        tdev.set_local_device(dev)  # init_distributed binds the launcher's device; --device wins
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=tp)
    dp = DataParallel(ps.dp_rank, ps.dims.dp, ps.dp_group)
    return Runtime(ps, dp, dev, dist.get_rank() == 0)


def check_vocab(tokenizer, cfg, padded: int) -> None:
    """The checkpoint's vocabulary must be the tokenizer's (one clear line otherwise)."""
    v = cfg.model.vocab_size
    if v is not None and v != tokenizer.vocab_size:
        raise EvalError(f"checkpoint vocabulary ({v} ids) does not match the tokenizer ({tokenizer.vocab_size} ids): "
                        "evaluate with the tokenizer the model was trained with")
    if padded < tokenizer.vocab_size:
        raise EvalError(f"checkpoint embedding has {padded} rows but the tokenizer has {tokenizer.vocab_size} ids")


def load_scorer(run_dir: str | Path, rt: Runtime, include_vocab_padding: bool = False):
    """``(LMScorer, cfg, tokenizer)`` for a GPT checkpoint in ``run_dir``."""
    p = Path(run_dir)
    if not p.is_dir():
        raise EvalError(f"checkpoint directory {p} does not exist")
    group = rt.pstate.tp_group if rt.pstate is not None else None
    model, cfg, tokenizer = load_model_for_eval(p, group=group, device=str(rt.device))
    if cfg.model.arch == "bert":
        raise EvalError(f"{p} holds a {cfg.model.arch!r} model; WikiText/LAMBADA need a GPT (causal LM) checkpoint")
    model.eval()
    padded = int(getattr(model, "padded_vocab_size"))
    check_vocab(tokenizer, cfg, padded)
    tp = rt.pstate.dims.tp if rt.pstate is not None else 1
    tp_rank = rt.pstate.tp_rank if rt.pstate is not None else 0
    scorer = gpt2_scorer(model, padded if include_vocab_padding else tokenizer.vocab_size, cfg.model.positions,
                         rt.device, vocab_start=vocab_range(padded, tp_rank, tp)[0], tp_group=group)
    return scorer, cfg, tokenizer
