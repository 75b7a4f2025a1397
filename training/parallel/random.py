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

Compiled layers (``model.compile``) cannot switch a generator's state inside a graph, so under ``torch.compile``
the model-parallel stream is a counter-based mask instead (:func:`model_parallel_dropout`): a 32-bit hash of
(a key drawn from the default generator, the tracker's model-parallel seed, the element's index) in plain
integer tensor ops, which the compiler traces and fuses. The key is the same on every TP rank (the default
stream is) and the seed differs per TP rank, so the masks do. Its only state is the default generator, which
activation checkpointing restores (exact replay) and checkpoints save (exact resume), and which on a GPU
advances on the device (CUDA-graph safe). Eager code keeps the tracker fork and its numbers.
"""
from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.nn.functional as F

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


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x c mod 2^32 for int64 x in [0, 2^32): the constant split in 16-bit halves, so no product reaches 2^48
    (signed int64 overflow is undefined behaviour in the C++ kernels)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' ``lowbias32``: xor-shift, multiply, twice) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_mask(shape: torch.Size, key: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """Bool keep-mask of ``shape`` on ``key``'s device, P(keep) = 1 - p (to 2^-32). Element i (flat index, 32-bit
    halves i_lo, i_hi) keeps when ``mix(mix(i_lo ^ mix(key ^ seed_lo)) ^ (i_hi + seed_hi)) >= p 2^32``: a pure
    function of (key, seed, i), no generator state; compiled, one fused element-wise kernel (iota + integer ops)."""
    idx = torch.arange(math.prod(shape), dtype=torch.int64, device=key.device).view(shape)
    stream = _mix32(key.to(torch.int64) ^ (seed & _M32))
    u = _mix32(_mix32((idx & _M32) ^ stream) ^ (((idx >> 32) + (seed >> 32)) & _M32))
    return u >= round(p * 2**32)


def model_parallel_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of ``x`` on the model-parallel stream in traceable ops: the compiled twin of
    ``with model_parallel_rng(): dropout(x, p, True)`` (other numbers, the same distribution).

    One key in [0, 2^31) is drawn from the default generator (the same on every TP rank, so the default stream
    stays in step across them) and hashed with this rank's model-parallel seed (the tracker's ``seed + 2718 +
    tp_rank``): masks differ across TP ranks and repeat across data-parallel replicas, as the tracker's do.
    Before :func:`configure` (no tracker seed) it is dropout on the default stream, as the eager fork is."""
    seeds = get_tracker().seeds_  # {model-parallel seed} after set_seed; read at trace time (a guarded constant)
    if not seeds:
        return F.dropout(x, p, True)
    key = torch.randint(0, 2**31 - 1, (), device=x.device)
    keep = counter_mask(x.shape, key, min(seeds), p)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


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
