"""Random-number streams for tensor parallelism, through DeepSpeed's activation-checkpointing module.

Two streams (Megatron's scheme, implemented by ``deepspeed.checkpointing``):

| stream                          | seed                  | same across        | drives                              |
|---------------------------------|-----------------------|--------------------|-------------------------------------|
| default generator               | seed                  | all TP and DP ranks| dropout on TP-replicated activations|
| tracker ``model-parallel-rng``  | seed + 2718 + tp_rank | DP replicas        | dropout on TP-local tensors         |

``deepspeed.checkpointing.configure`` must run before seeding; its ``checkpoint`` saves and restores
the CPU, device and tracker RNG states so that recomputation replays the same dropout masks.
:func:`recompute` does the same for one small region (selective recomputation of the attention core)
without DeepSpeed's per-call bookkeeping: one device-generator state and the tracker's dict per call.
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


def _device_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _Recompute(torch.autograd.Function):
    """forward: ``function(*tensors)`` without keeping its graph, only its inputs; backward: the same
    call again, replaying the random numbers it drew, then its backward."""

    @staticmethod
    def forward(ctx, function, *tensors):
        ctx.function = function
        ctx.device = tensors[0].device
        # the generator states the call starts from: the device's default generator and the tracker's streams
        # (a fork replaces a stream's state tensor, never writes into it: a shallow copy is a snapshot)
        ctx.rng = _device_rng_state(ctx.device)
        ctx.tracker = get_tracker().get_states()
        ctx.save_for_backward(*tensors)
        return function(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        tracker = get_tracker()
        now_rng, now_tracker = _device_rng_state(ctx.device), tracker.get_states()
        _set_device_rng_state(ctx.device, ctx.rng)
        tracker.set_states(ctx.tracker)
        try:
            with torch.enable_grad():
                out = ctx.function(*inputs)
        finally:  # back to where backward was: the replay must not rewind the streams
            _set_device_rng_state(ctx.device, now_rng)
            tracker.set_states(now_tracker)
        torch.autograd.backward(out, grad)
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


def recompute(function: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``function(*tensors)`` (one tensor out) whose intermediate activations are not kept: backward runs it
    again, from the same device-generator and tracker states, so dropout inside (on either stream) draws
    the same mask, and gets the same numbers bitwise. Keeps only ``tensors`` (saved for backward, so
    ``saved_tensors_hooks`` see them). ``function`` must be deterministic given those states and must not
    mutate its inputs; it runs without a graph in forward."""
    return _Recompute.apply(function, *tensors)


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
