"""The context-parallel benchmark's memory probe (benchmarks/bench_context.py): :class:`PeakRSS` sees a tensor that
lives only inside the measured block, freed before it ends (the sampling thread, not the reading at exit)."""
from __future__ import annotations

import time

import torch

from benchmarks.bench_context import MIB, PeakRSS


def test_peak_rss_growth_sees_a_transient_tensor():
    with PeakRSS(0.001) as peak:
        t = torch.ones(64 * MIB // 4)                                    # 64 MiB, touched
        time.sleep(0.05)
        del t                                                            # glibc returns a block this large at once
        time.sleep(0.01)
    assert 60 * MIB <= peak.growth < 100 * MIB, peak.growth / MIB
    with PeakRSS(0.001) as idle:
        time.sleep(0.02)
    assert idle.growth < 8 * MIB, idle.growth / MIB
