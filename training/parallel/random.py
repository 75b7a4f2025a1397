"""Random-number streams for tensor parallelism, through DeepSpeed's activation-checkpointing module.

Two streams (Megatron's scheme, implemented by ``deepspeed.checkpointing``):

| stream                          | seed                  | same across        | drives                              |
|---------------------------------|-----------------------|--------------------|-------------------------------------|
| default generator               | seed                  | all TP and DP ranks| dropout on TP-replicated activations|
| tracker ``model-parallel-rng``  | seed + 2718 + tp_rank | DP replicas        | dropout on TP-local tensors         |

``deepspeed.checkpointing.configure`` must run before seeding; its ``checkpoint`` saves and restores
the CPU, device and tracker RNG states so that recomputation replays the same dropout masks.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import deepspeed
import numpy as np
import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def configure(mpu: Any, num_layers: int, ds_config: dict | None = None) -> None:
    """Hook our mpu (a :class:`training.parallel.state.ParallelState`) into DeepSpeed's activation checkpointing (before any seeding)."""
    deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config, partition_activations=False,
                                      contiguous_checkpointing=False, num_checkpoints=num_layers,
                                      checkpoint_in_cpu=False, synchronize=False, profile=False)


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch, then the two tensor-parallel streams (needs :func:`configure`)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)


def get_tracker() -> Any:
    """DeepSpeed's ``CudaRNGStatesTracker`` (named RNG streams; despite the name, on any device)."""
    return deepspeed.checkpointing.get_cuda_rng_tracker()


def model_parallel_rng() -> contextlib.AbstractContextManager:
    """Context manager: run the body on the TP-local stream (no-op before :func:`configure`)."""
    tracker = get_tracker()
    if MODEL_PARALLEL_RNG in tracker.get_states():
        return tracker.fork(MODEL_PARALLEL_RNG)
    return contextlib.nullcontext()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Recompute ``function(*args)`` in backward with the forward's RNG states restored."""
    return deepspeed.checkpointing.checkpoint(function, *args)


def get_rng_state() -> dict:
    """Every RNG state of this process (for checkpoints)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_tracker().set_states(state["tracker"])
