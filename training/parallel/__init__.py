"""Megatron-style tensor-parallel building blocks: process groups, collectives, layers, loss, RNG.

Nothing here imports model code. Every layer and function takes its process group explicitly; a
``None`` group (or a group of size 1) is the serial fast path with no communication.
"""
