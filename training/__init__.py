"""Megatron-style tensor/pipeline-parallel GPT-2 and BERT training under DeepSpeed."""
import os

# PyTorch's CPU allocator backs allocations of 2 MB and more with transparent huge pages (madvise) when
# THP_MEM_ALLOC_ENABLE=1. Without it, every fresh large tensor of a step (logits, cross-entropy buffers,
# vocabulary-sized gradients: hundreds of MB on CPU, returned to the OS when freed) page-faults 4 KB at a
# time: ~175k page faults per step of the CPU benchmark model, 15-16k with it, and ~35 % less system
# time (benchmarks/RESULTS.md). torch reads the variable once, at its first allocation, so it is set here,
# before torch is imported by any entry point (`python -m training.*`, `python -m evaluation`).
# An explicit THP_MEM_ALLOC_ENABLE=0 in the environment wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
