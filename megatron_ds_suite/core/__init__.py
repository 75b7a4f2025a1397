"""The shared core: what all three stages need and none of them owns.

The data contract between stages (tokenizers, the Megatron ``.bin/.idx`` format, the corpus manifest),
the RACE reading and encoding that training and evaluation share, the common error base (``errors``),
the one strict config loader (``config``: YAML, ``a.b=value`` overrides, typed dataclasses) and atomic
file writes (``atomic``). The core imports no stage (``tests/unit/test_architecture.py`` checks it).
"""
