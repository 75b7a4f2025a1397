"""An honest CPU peak for MFU: every rank measures at the same time, for long enough to be stable.

On a CPU the peak is measured, not read from a data sheet. Measured per process at start-up (0.5 s while
the other ranks are still importing and building), one rank could get the whole machine and another a
share, and MFU of the same job swung between 38 % and 82 % (peaks 0.044 vs 0.024 TFLOP/s). Here all ranks
of the job first meet at a barrier, then each runs n x n x n matmuls in the training dtype for the same
``seconds``, so each sees the contention it will see while training (all ranks busy). Per rank the rate
is the median over its matmuls; the job's peak per device is the mean over ranks, reported with the
rank range and the within-rank spread (relative interquartile range), in the log and in ``metrics.jsonl``
(event ``cpu_peak``, which the main job's report prints).
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPeak:
    tflops: float
    """Mean over ranks of each rank's median matmul rate: the peak one device (rank) can reach."""
    rank_min: float
    rank_max: float
    within_rank_spread: float
    """Largest relative interquartile range of one rank's matmul rates."""
    seconds: float
    ranks: int
    threads: int
    dtype: str

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"CPU peak {self.tflops:.4f} TFLOP/s per rank ({self.dtype}; {self.ranks} rank(s) x {self.threads} "
                f"thread(s) measuring together for {self.seconds:.1f} s after a barrier; ranks "
                f"{self.rank_min:.4f}-{self.rank_max:.4f}, within-rank spread {100 * self.within_rank_spread:.1f} %)")


def _rates(dtype: str, seconds: float, n: int) -> list[float]:
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(tdt)
    b = torch.randn(n, n, generator=gen).to(tdt)
    torch.matmul(a, b)  # warm-up (allocation, kernel selection)
    rates = []
    start = time.perf_counter()
    while len(rates) < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        rates.append(2.0 * n**3 / (time.perf_counter() - t0) / 1e12)
    return rates


def measure_cpu_peak_together(dtype: str = "fp32", seconds: float = 1.0, n: int = 512, group=None) -> CpuPeak:
    """Collective over ``group`` (all ranks when None; one process without torch.distributed)."""
    together = dist.is_available() and dist.is_initialized()
    if together:
        dist.barrier(group=group)
    rates = _rates(dtype, seconds, n)
    q = statistics.quantiles(rates, n=4)
    mine = torch.tensor([statistics.median(rates), (q[2] - q[0]) / statistics.median(rates)], dtype=torch.float64)
    if together:
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
    else:
        every = [mine]
    medians = [float(t[0]) for t in every]
    return CpuPeak(tflops=sum(medians) / len(medians), rank_min=min(medians), rank_max=max(medians),
                   within_rank_spread=max(float(t[1]) for t in every), seconds=seconds, ranks=len(every),
                   threads=torch.get_num_threads(), dtype=dtype)
