"""One device rule: batches, buffers and collective operands live on the engine's device.

DeepSpeed's engine does not move inputs, NCCL refuses host tensors and CUDA kernels refuse to mix a
host tensor with a device one, while every CPU test (gloo, one device) accepts all of it. So the
whole project asks this module where tensors go:

* :func:`local_device` -- the device this process computes on, from DeepSpeed's accelerator
  (``cuda:LOCAL_RANK`` on NVIDIA, ``cpu`` under ``DS_ACCELERATOR=cpu``). The engine moves the model
  there; everything else follows the model.
* :func:`module_device` -- where a built model (or engine) actually lives: its first parameter.
* :func:`to_device` -- the one batch mover: any nesting of tensors in dicts, lists and tuples.
* :func:`set_local_device` -- ``torch.cuda.set_device(LOCAL_RANK)`` before any process group, so NCCL
  and ``all_gather_object`` use this process's GPU and not GPU 0.

Counts and sums handed to a collective are created with ``device=`` one of these (float64/int64 on
the device, never on the host). ``tests/parallel/test_device_placement.py`` checks every path against fake
CUDA tensors and a collective guard.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_device() -> torch.device:
    """This process's compute device as DeepSpeed's accelerator names it (the engine's device)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name == "cpu":
        return torch.device("cpu")
    return torch.device(name, local_rank())


def set_local_device(dev: torch.device | None = None) -> torch.device:
    """Bind this process to ``dev`` (default: its accelerator device) before any process group exists;
    a no-op on CPU."""
    from deepspeed.accelerator import get_accelerator

    dev = local_device() if dev is None else dev
    if dev.type != "cpu" and dev.index is not None:
        get_accelerator().set_device(dev.index)
    return dev


def module_device(module: torch.nn.Module) -> torch.device:
    """Device of a model's (or DeepSpeed engine's) first parameter; the local device when it has none."""
    for p in module.parameters():
        return p.device
    return local_device()


def to_device(batch: T, device: torch.device | str) -> T:
    """``batch`` with every tensor moved to ``device`` (dicts, lists, tuples and namedtuples of any depth;
    anything else is returned as is). A host tensor bound for a GPU is pinned first: a copy from pageable memory
    synchronises the stream before it starts (the host would wait for every queued kernel at each micro-batch),
    a ``non_blocking`` copy from pinned memory is queued like a kernel."""
    if isinstance(batch, torch.Tensor):
        if (torch.device(device).type == "cuda" and batch.device.type == "cpu" and torch.cuda.is_available()
                and not batch.is_pinned()):
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)  # type: ignore[return-value]
    if isinstance(batch, Mapping):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))  # type: ignore[return-value]
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)  # type: ignore[return-value]
    return batch


def host_to(values: Any, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Python numbers (a list or a scalar) as a tensor on ``device``: the operand of a collective."""
    return torch.tensor(values, dtype=dtype, device=device)


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far, in GiB: what torch allocated on a CUDA device at most
    (``max_memory_allocated``, a host-side counter: no device sync), or the process's peak resident set on the
    CPU (``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
