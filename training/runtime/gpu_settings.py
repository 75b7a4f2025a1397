"""GPU-grade settings, chosen by the device type and kept off the CPU path.

One pure function, :func:`settings_for`, decides from ``(device type, training dtype, whether
the dtype)``; the trainer, the RACE fine-tuner and the optimizer builder read its answer, and ``tests/unit/test_gpu_settings.py`` checks it on CPU for every case.

On CUDA:

* **optimizer** -- torch's fused AdamW (one CUDA kernel for all parameters) in every dtype. In fp16 DeepSpeed
  wraps it in ``FP16_UnfusedOptimizer`` (one fp32 master per parameter), whose step the project replaces by its
  own multi-tensor one (``training.optim.mixed_precision``), and torch's kernel takes the skip decision as a
  device flag (``found_inf``): the step reads nothing back. DeepSpeed's ``FusedAdam`` (which DeepSpeed wraps in
  its flat ``FP16_Optimizer``; the trainer's fp16 choice before issue 40) has no such flag, so its skip decision
  costs one host read per step; ``benchmarks.bench_train_step --adam fused`` still measures it.
* **process group** -- ``torch.cuda.set_device(LOCAL_RANK)`` before any group
  (:func:`training.runtime.device.set_local_device`), then NCCL (DeepSpeed's accelerator backend).
* **attention** -- ``F.scaled_dot_product_attention`` with ``is_causal=True`` and no explicit mask
  (GPT-2), which lets PyTorch pick the flash / memory-efficient kernels; BERT passes its key-padding
  mask (memory-efficient kernel). The CPU-only fp32 dropout path of ``training.models.ops`` is never
  taken on CUDA.
* **precision** -- ``precision.dtype: auto`` is fp16 with dynamic loss scaling (the paper's setting);
  ``precision.dtype=bf16`` is the one override for bf16.

On CPU: torch's fused AdamW, gloo, the CPU attention fast path, fp32 for ``auto``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

OptimizerKind = Literal["deepspeed_fused_adam", "torch_fused_adamw"]


@dataclass(frozen=True)
class DeviceSettings:
    optimizer: OptimizerKind
    """Which AdamW implementation the engine gets (see the module docstring for why)."""
    backend: str
    """torch.distributed backend: ``nccl`` on CUDA, ``gloo`` on CPU."""
    set_device: bool
    """Bind the process to GPU ``LOCAL_RANK`` before creating any process group."""
    causal_attention: str
    """``sdpa_is_causal`` (flash / memory-efficient kernels) or ``cpu_fused`` (CPU fp32 fast path)."""
    auto_dtype: str
    """What ``precision.dtype: auto`` resolves to."""


def settings_for(device_type: str, dtype: str = "fp16") -> DeviceSettings:
    """The settings for a process computing on ``device_type`` ('cuda' or 'cpu') in ``dtype``."""
    if device_type == "cuda":
        return DeviceSettings("torch_fused_adamw", "nccl", True, "sdpa_is_causal", "fp16")
    if device_type == "cpu":
        return DeviceSettings("torch_fused_adamw", "gloo", False, "cpu_fused", "fp32")
    raise ValueError(f"unsupported device type {device_type!r}: this project trains on 'cuda' (NVIDIA) or 'cpu'")


@functools.lru_cache(maxsize=1)
def fused_adam_available() -> bool:
    """Whether DeepSpeed's FusedAdam kernel is (or can be JIT-)built here: CUDA present and the op
    builder compatible (nvcc/ninja found, or a pre-built op)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder

        return bool(FusedAdamBuilder().is_compatible(verbose=False))
    except Exception as e:  # noqa: BLE001 - any builder failure means: use torch's fused AdamW
        log.warning("DeepSpeed FusedAdam unavailable (%s): torch fused AdamW instead", e)
        return False


def plain_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without architecture-specific suffixes (``9.0a`` -> ``9.0``, ``10.0f`` -> ``10.0``;
    ``+PTX`` kept). DeepSpeed 0.19's op builder parses each entry as numbers and fails on ``9.0a``, which some
    CUDA images (NVIDIA's PyTorch containers among them) set for Hopper, so its FusedAdam never builds there."""
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    out = []
    for e in entries:
        m = re.fullmatch(r"(\d+)\.(\d+)[a-zA-Z]*(\+PTX)?", e)
        plain = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else e
        if plain not in out:
            out.append(plain)
    return ";".join(out)


@contextlib.contextmanager
def deepspeed_buildable_arch_list():
    """Inside: ``TORCH_CUDA_ARCH_LIST`` as :func:`plain_arch_list` gives it (restored after), so DeepSpeed's
    JIT op builds accept it. A no-op when the variable is unset or already plain."""
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    new = plain_arch_list(old) if old else old
    if new == old:
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = new
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = old
