"""Device and interconnect table for the planner (training.plan) and for MFU in the training metrics.

Every number is a vendor data-sheet value unless marked otherwise; the table is the only place a
hardware constant lives. Conventions:

* ``peak_tflops``: dense (no 2:4 sparsity) peak of one device in TFLOP/s. fp16/bf16 = tensor-core
  rate; fp32 = plain (non-tensor-core, non-TF32) FP32 rate. ``None`` = the device has no such mode.
* ``intra_node_gbs``: NVLink/NVSwitch bandwidth of ONE GPU, GB/s **per direction** (a ring all-reduce
  sends and receives at the same time, so the per-direction rate is what limits it). The data sheets
  quote the bidirectional sum (``intra_node_bidir_gbs``), twice this.
* ``inter_node_gbs``: InfiniBand bandwidth of ONE NODE (all its NICs together), GB/s per direction.
  All GPUs of a node share it.
* ``hbm_gbs``: device-memory bandwidth, GB/s (used for the memory-bound, TP-replicated element-wise
  work in the step-time model).
* ``achievable_fraction``: fraction of the fp16/bf16 peak that a well-tuned dense transformer step
  reaches on one device (model FLOPs incl. recomputation / wall time). The planner recalibrates it
  for V100 from the Megatron paper's own baseline (see training.plan.paper.calibrate_compute_fraction); the
  table values are the fallbacks with their source in ``note``.

The 'cpu' entry has no fixed peak: :func:`peak_tflops` measures a matmul once per process.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict[str, float | None]
    """dtype ('fp16', 'bf16', 'fp32') -> dense peak TFLOP/s; None = unsupported; missing = measure."""
    memory_gb: float
    """Device memory in GiB as marketed (a '32 GB' V100 has 32 GiB of HBM2)."""
    hbm_gbs: float | None
    intra_node_gbs: float | None
    intra_node_bidir_gbs: float | None
    inter_node_gbs: float | None
    gpus_per_node: int
    achievable_fraction: float
    note: str


HARDWARE: dict[str, Hardware] = {
    "v100-32gb": Hardware(
        name="v100-32gb",
        peak_tflops={"fp16": 125.0, "bf16": None, "fp32": 15.7},
        memory_gb=32.0, hbm_gbs=900.0,
        intra_node_gbs=150.0, intra_node_bidir_gbs=300.0,  # 6 NVLink2 x 25 GB/s per direction via NVSwitch
        inter_node_gbs=100.0,  # DGX-2H: 8 x 100 Gb/s InfiniBand EDR per 16-GPU server (Megatron paper)
        gpus_per_node=16,      # DGX-2H, the Megatron-LM (2019) cluster
        achievable_fraction=39.0 / 125.0,
        note="Megatron-LM 2019 setup (DGX-2H: NVSwitch 300 GB/s bidirectional, IB 100 GB/s per server); "
             "achievable fraction = the paper's 39 TFLOP/s single-GPU baseline",
    ),
    "a100-80gb": Hardware(
        name="a100-80gb",
        peak_tflops={"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
        memory_gb=80.0, hbm_gbs=2039.0,
        intra_node_gbs=300.0, intra_node_bidir_gbs=600.0,  # NVLink3, 12 links x 25 GB/s per direction
        inter_node_gbs=200.0,  # DGX A100: 8 x 200 Gb/s HDR compute NICs
        gpus_per_node=8,
        achievable_fraction=0.44,
        note="achievable fraction from Narayanan et al. 2021 Table 1 (1.7B GPT, 137 TFLOP/s = 44% of peak)",
    ),
    "h100-sxm": Hardware(
        name="h100-sxm",
        peak_tflops={"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
        memory_gb=80.0, hbm_gbs=3350.0,
        intra_node_gbs=450.0, intra_node_bidir_gbs=900.0,  # NVLink4, 18 links
        inter_node_gbs=400.0,  # DGX H100: 8 x 400 Gb/s NDR
        gpus_per_node=8,
        achievable_fraction=0.44,
        note="achievable fraction assumed equal to A100's (not calibrated on H100)",
    ),
    "h200": Hardware(
        name="h200",
        peak_tflops={"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
        memory_gb=141.0, hbm_gbs=4800.0,
        intra_node_gbs=450.0, intra_node_bidir_gbs=900.0,
        inter_node_gbs=400.0,
        gpus_per_node=8,
        achievable_fraction=0.44,
        note="same compute and links as H100 SXM, more and faster HBM3e; achievable fraction assumed",
    ),
    "cpu": Hardware(
        name="cpu",
        peak_tflops={},  # measured by peak_tflops('cpu', dtype)
        memory_gb=0.0, hbm_gbs=None,
        intra_node_gbs=None, intra_node_bidir_gbs=None, inter_node_gbs=None,
        gpus_per_node=1,
        achievable_fraction=1.0,
        note="peak = measured torch.matmul throughput of this process (so MFU on CPU is relative to it)",
    ),
}

ALIASES: dict[str, str] = {
    "v100": "v100-32gb", "v100-32": "v100-32gb", "v100-sxm": "v100-32gb",
    "a100": "a100-80gb", "a100-80": "a100-80gb",
    "h100": "h100-sxm", "h100-80gb": "h100-sxm",
    "h200-141gb": "h200",
}

_DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def canonical_kind(device_kind: str) -> str | None:
    """'H100' / 'v100' / 'a100-80gb' -> table key, or None when unknown."""
    k = device_kind.strip().lower()
    k = ALIASES.get(k, k)
    return k if k in HARDWARE else None


def get_hardware(device_kind: str) -> Hardware:
    """Table entry for ``device_kind`` (aliases allowed); ValueError naming the choices otherwise."""
    k = canonical_kind(device_kind)
    if k is None:
        choices = ", ".join(sorted(set(HARDWARE) | set(ALIASES)))
        raise ValueError(f"unknown device kind {device_kind!r}; choose one of: {choices}")
    return HARDWARE[k]


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of one ``device_kind`` device in ``dtype``; None when unknown/unsupported.

    For 'cpu' the value is measured (best-of-N ``torch.matmul`` at the current thread count), once
    per process and dtype.
    """
    d = _DTYPES.get(dtype.strip().lower())
    k = canonical_kind(device_kind)
    if d is None or k is None:
        return None
    if k == "cpu":
        return measure_cpu_peak_tflops(d)
    return HARDWARE[k].peak_tflops.get(d)


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_tflops(dtype: str = "fp32", n: int = 1024, budget_s: float = 0.5) -> float:
    """Best observed TFLOP/s of an n x n x n matmul (2 n^3 FLOPs) within ~budget_s seconds."""
    import torch

    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(tdt)
    b = torch.randn(n, n, generator=gen).to(tdt)
    torch.matmul(a, b)  # warm-up (allocations, kernel selection)
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < 3 or (time.perf_counter() - start < budget_s and reps < 50):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    tflops = 2.0 * n**3 / best / 1e12
    log.info("measured CPU matmul peak: %.4f TFLOP/s (%s, n=%d, %d threads)", tflops, dtype, n,
             torch.get_num_threads())
    return tflops


_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"h200", "h200"),
    (r"h100", "h100-sxm"),   # also PCIe/NVL parts; those have lower peaks, see docs/plan.md
    (r"a100", "a100-80gb"),  # 40 GB parts have the same peak
    (r"v100", "v100-32gb"),  # 16 GB parts have the same peak
]


def device_kind_from_name(cuda_name: str) -> str:
    """Map a CUDA device name ('NVIDIA H100 80GB HBM3') to a table key; unknown -> a slug of the name."""
    low = cuda_name.lower()
    for pattern, kind in _NAME_PATTERNS:
        if re.search(pattern, low):
            return kind
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown-gpu"


def detect_device_kind() -> str:
    """Table key of CUDA device 0 when CUDA is available, else 'cpu'."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of training
        return "cpu"
    if torch.cuda.is_available():
        return device_kind_from_name(torch.cuda.get_device_name(0))
    return "cpu"


def device_memory_gib(device) -> float:
    """Memory of ``device`` in GiB: a GPU's total memory, or on CPU this process's share of the host's RAM
    (total / LOCAL_WORLD_SIZE processes)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return host_memory_gib() / max(local, 1)


def host_memory_gib() -> float:
    """The host's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
