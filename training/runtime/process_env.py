"""Process-wide settings for the training and evaluation entry points, applied explicitly by them.

Importing ``training`` has no side effects; the entry points (``python -m training.*``, ``python -m
evaluation``, the ``megatron-ds-*`` console commands, the benchmarks) call :func:`configure` before
torch is imported.

THP_MEM_ALLOC_ENABLE=1: PyTorch's CPU allocator then backs allocations of 2 MB and more with
transparent huge pages (madvise). Without it, every fresh large tensor of a step (logits, cross-entropy
buffers, vocabulary-sized gradients: hundreds of MB on CPU, returned to the OS when freed) page-faults
4 KB at a time: ~175k page faults per step of the CPU benchmark model, 15-16k with it, and ~35 % less
system time (benchmarks/RESULTS.md). torch reads the variable once, at its first allocation, so it has
to be set before torch is imported. An explicit THP_MEM_ALLOC_ENABLE=0 in the environment wins.
"""
from __future__ import annotations

import os


def configure() -> None:
    """Set the process defaults above (idempotent; explicit environment values win)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
